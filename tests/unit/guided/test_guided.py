"""Structured outputs, the pure parts: constraint → grammar (and its 400s), the compile
cache, the closing path within a budget, the request mapping (response_format, guided_*,
tools), the wire form, vLLM's StructuredOutputsParams fields, the mocker's guided oracle."""

from __future__ import annotations

import json
import random

import jsonschema
import msgspec
import numpy as np
import pytest

from kvmesh.engines.mocker.guided import guided_token
from kvmesh.engines.vllm.mapping import structured_outputs_kwargs
from kvmesh.errors import InvalidArgument
from kvmesh.frontend.schemas import parse
from kvmesh.frontend.tools import chat_messages, guided_of, parse_tool_call, tool_mode
from kvmesh.preprocess.guided import GuidedTokenizer, check
from kvmesh.preprocess.model import bundled_model_path
from kvmesh.protocol import GuidedDecoding, PreprocessedRequest

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}, "c": {"type": "boolean"}},
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok() -> GuidedTokenizer:
    return GuidedTokenizer.from_folder(bundled_model_path(), 2048, [2])


def _chat(**body) -> object:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return parse(msgspec.json.encode(payload), "chat")


def _walk(tok: GuidedTokenizer, g: GuidedDecoding, budget: int, seed: int) -> tuple[str, bool]:
    """Random allowed tokens (an adversarial 'model') until EOS or the budget."""
    guide = tok.guide(g)
    rng = random.Random(seed)
    out: list[int] = []
    for left in range(budget, 0, -1):
        ids = np.flatnonzero(guide.allowed(left))
        t = guide.settle(int(ids[rng.randrange(len(ids))]), left)  # as the samplers do
        assert guide.consume(t)
        if t == tok.eos:
            return tok.tok.decode_str(out), True
        out.append(t)
    return tok.tok.decode_str(out), False


# optional properties (one with a format) can be opened at the last moment; "}" is string content
OPTIONAL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string", "format": "email"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("schema", [SCHEMA, OPTIONAL], ids=["required", "optional"])
@pytest.mark.parametrize("extra", [0, 1, 5, 30, 200])
def test_random_tokens_inside_the_grammar_end_in_valid_json_within_the_budget(tok, schema, extra):
    g = GuidedDecoding("json_schema", json.dumps(schema))
    shortest = tok.guide(g).closing_cost(1000)  # the fewest tokens any valid output needs
    assert 0 < shortest < 1000
    for seed in range(20):
        text, _ = _walk(tok, g, shortest + extra, seed)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_without_the_closing_path_random_tokens_would_not_close(tok):
    g = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    guide = tok.guide(g)
    rng = random.Random(0)
    for _ in range(20):
        ids = np.flatnonzero(guide.allowed(None))
        guide.consume(int(ids[rng.randrange(len(ids))]))
    assert not guide.matcher.is_accepting()  # 20 random tokens: still open, hence the closing path


def test_compiled_once_per_distinct_constraint(tok):
    g = GuidedDecoding("regex", "[a-z]{2,4}-[0-9]+")
    before = tok.compiles
    tok.guide(g), tok.guide(g), tok.guide(GuidedDecoding("regex", "[a-z]{2,4}-[0-9]+"))
    assert tok.compiles == before + 1
    tok.guide(GuidedDecoding("regex", "x+"))
    assert tok.compiles == before + 2


def test_a_resumed_guide_continues_after_the_tokens_already_streamed(tok):
    g = GuidedDecoding("choice", choices=("alpha", "beta"))
    done = tok.tok.tokenize_str("alp")
    guide = tok.guide(g, done)
    text, ended = "alp", False
    for left in range(10, 0, -1):
        t = int(np.flatnonzero(guide.allowed(left))[0])
        guide.consume(t)
        if t == tok.eos:
            ended = True
            break
        text += tok.tok.decode_str([t])
    assert ended and text == "alpha"
    with pytest.raises(InvalidArgument, match="do not match"):
        tok.guide(g, tok.tok.tokenize_str("zzz"))


@pytest.mark.parametrize(
    "g, words",
    [
        (GuidedDecoding("json_schema", '{"type": "string", "format": "no-such"}'), ["not supported", "no-such"]),
        (GuidedDecoding("json_schema", "[1, 2]"), ["JSON object"]),
        (GuidedDecoding("regex", "(a"), ["guided_regex"]),
        (GuidedDecoding("grammar", "start: nope"), ["guided_grammar", "Lark"]),
        (GuidedDecoding("choice"), ["at least one"]),
        (GuidedDecoding("regex", "a" * 70000), ["at most"]),
    ],
)
def test_unsupported_or_malformed_constraints_are_invalid_arguments(g, words):
    with pytest.raises(InvalidArgument) as info:
        check(g)
    for word in words:
        assert word in info.value.message


def test_request_fields_map_to_one_typed_constraint():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    g = guided_of(_chat(response_format=fmt))
    assert g is not None and g.kind == "json_schema" and json.loads(g.spec) == SCHEMA
    assert guided_of(_chat(response_format={"type": "json_object"})) == GuidedDecoding("json_object")
    assert guided_of(_chat(response_format={"type": "text"})) is None
    assert guided_of(_chat(guided_choice=["x", "y"])) == GuidedDecoding("choice", choices=("x", "y"))
    assert guided_of(_chat(guided_regex="a+")) == GuidedDecoding("regex", "a+")
    assert guided_of(_chat(guided_grammar="start: \"a\"")) == GuidedDecoding("grammar", 'start: "a"')
    assert guided_of(_chat(guided_json=SCHEMA)).kind == "json_schema"
    with pytest.raises(InvalidArgument, match="one output constraint"):
        guided_of(_chat(guided_regex="a", response_format={"type": "json_object"}))


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def test_forced_tool_calls_constrain_name_and_arguments():
    req = _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    assert tool_mode(req) == "forced"
    schema = json.loads(guided_of(req).spec)
    jsonschema.validate({"name": "f", "arguments": {"x": 1}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "g", "arguments": {"x": 1}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"x": "no"}}, schema)
    assert tool_mode(_chat(tools=[TOOL])) == "auto" and guided_of(_chat(tools=[TOOL])) is None
    assert tool_mode(_chat(tools=[TOOL], tool_choice="none")) == "none"
    assert "You may call these functions" in chat_messages(_chat(tools=[TOOL]))[0]["content"]


def test_tool_calls_are_parsed_from_outputs():
    names = frozenset({"f"})
    call = parse_tool_call('{"name":"f","arguments":{"x":1}}', "forced", names)
    assert call is not None and call.name == "f" and json.loads(call.arguments) == {"x": 1}
    auto = parse_tool_call('Sure. <tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>', "auto", names)
    assert auto is not None and json.loads(auto.arguments) == {"x": 2}
    assert parse_tool_call("just text", "auto", names) is None
    assert parse_tool_call('<tool_call>{"name": "other", "arguments": {}}</tool_call>', "auto", names) is None
    assert parse_tool_call('{"name":"f","argu', "forced", names) is None


def test_the_constraint_travels_on_the_wire_with_older_peers_unaffected():
    g = GuidedDecoding("choice", choices=("a", "b"))
    req = PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2], guided=g)
    wire = msgspec.msgpack.encode(req)
    assert msgspec.msgpack.decode(wire, type=PreprocessedRequest).guided == g
    plain = msgspec.msgpack.encode(PreprocessedRequest(request_id="r", model="m", token_ids=[1]))
    assert b"guided" not in plain  # omitted by default: the frame of a free-text request is unchanged


def test_vllm_structured_outputs_fields():
    assert structured_outputs_kwargs(GuidedDecoding("json_schema", json.dumps(SCHEMA))) == {"json": SCHEMA}
    assert structured_outputs_kwargs(GuidedDecoding("json_object")) == {"json_object": True}
    assert structured_outputs_kwargs(GuidedDecoding("regex", "a+")) == {"regex": "a+"}
    assert structured_outputs_kwargs(GuidedDecoding("choice", choices=("a", "b"))) == {"choice": ["a", "b"]}
    assert structured_outputs_kwargs(GuidedDecoding("grammar", 'start: "a"')) == {"grammar": 'start: "a"'}


def test_the_mocker_oracle_stays_in_the_grammar_and_is_deterministic(tok):
    g = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    vocab = tuple(range(3, 2048))

    def run(key: int) -> list[int]:
        guide, out = tok.guide(g), []
        for pos in range(60):
            h = hash((key, pos)) & ((1 << 64) - 1)
            t = guided_token(guide, h, vocab, 60 - pos, eos_drawn=False)
            if t is None:
                break
            out.append(t)
        return out

    first = run(1)
    assert first == run(1)
    jsonschema.validate(json.loads(tok.tok.decode_str(first)), SCHEMA)


def test_the_hf_sampler_masks_only_guided_rows_and_a_ban_gives_way_to_the_grammar(tok):
    torch = pytest.importorskip("torch")
    from kvmesh.engines.hf.sampling import SampleParams, sample

    logits = torch.zeros(3, 2048)
    logits[:, 7] = 10.0  # the "model" wants token 7 everywhere
    guide = tok.guide(GuidedDecoding("choice", choices=("yes",)))
    forced = tok.tok.tokenize_str("yes")[0]
    eos_guide = tok.guide(GuidedDecoding("choice", choices=("no",)), tok.tok.tokenize_str("no"))
    params = [SampleParams(), SampleParams(guide=guide, remaining=10), SampleParams(guide=eos_guide, banned=(2,))]
    out = [s.token for s in sample(logits, params)]
    assert out[0] == 7  # free row untouched
    assert out[1] == forced  # guided row: only the grammar's token
    assert out[2] == 2  # the grammar allows only EOS: the min_tokens ban gives way


async def test_an_engine_without_structured_outputs_refuses_a_guided_request():
    from kvmesh.engines.adapter import AbortMonitor, run_generate
    from kvmesh.engines.sample import EchoEngine
    from kvmesh.runtime.context import Context

    engine = EchoEngine()
    await engine.start()
    req = PreprocessedRequest(request_id="r", model="echo", token_ids=[1, 2], guided=GuidedDecoding("regex", "a+"))
    monitor = AbortMonitor(engine)
    with pytest.raises(InvalidArgument, match="does not support structured outputs"):
        async for _ in run_generate(engine, req, Context("r"), monitor):
            pass
    free = msgspec.structs.replace(req, guided=None, request_id="r2")
    assert [c async for c in run_generate(engine, free, Context("r2"), monitor)]
    await monitor.close()
    await engine.cleanup()
