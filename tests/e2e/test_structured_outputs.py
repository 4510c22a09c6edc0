"""Structured outputs and tool calls (issue 18) against `kvmesh run --engine hf` with
the bundled tiny model, through the official openai client. The model is small and
barely trained: its outputs only validate because the grammar masks every token and
closes the structure within max_tokens."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import kvmesh_run

pytest.importorskip("torch")

pytestmark = pytest.mark.processes

MODEL = "kvmesh-tiny"
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "qty": {"type": "number"}},
                    "required": ["sku", "qty"],
                },
            },
            "status": {"enum": ["open", "closed"]},
            "note": {"type": ["string", "null"]},
        },
        "required": ["items", "status", "note"],
    },
    "list": {"type": "array", "items": {"type": "boolean"}, "maxItems": 5},
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("guided"), "--engine", "hf", workers=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "Describe one customer order as JSON."}])
    return client.chat.completions.create(model=MODEL, **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(client, name, temperature):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    resp = _ask(client, response_format=fmt, max_tokens=60, temperature=temperature, seed=7)
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    assert resp.usage.completion_tokens <= 60


def test_json_object_and_a_small_budget_still_close(client):
    resp = _ask(client, response_format={"type": "json_object"}, max_tokens=12, temperature=1.0, seed=3)
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_regex_and_choice(client):
    resp = _ask(client, max_tokens=20, temperature=1.0, extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}(-x)?"})
    text = resp.choices[0].message.content
    assert __import__("re").fullmatch(r"[A-Z]{2}-[0-9]{3}(-x)?", text), text
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        resp = _ask(client, max_tokens=10, temperature=1.0, seed=seed, extra_body={"guided_choice": choices})
        assert resp.choices[0].message.content in choices


def test_lark_grammar(client):
    grammar = 'start: "(" expr ")"\nexpr: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/'
    resp = _ask(client, max_tokens=30, temperature=1.0, extra_body={"guided_grammar": grammar})
    assert __import__("re").fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", resp.choices[0].message.content)


def test_streamed_structured_output_validates(client):
    schema = SCHEMAS["person"]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    stream = _ask(client, response_format=fmt, max_tokens=40, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_forced_named_tool_call_is_parsed_by_the_client(client):
    resp = _ask(
        client, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60,
    )  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_call_picks_one_of_the_tools(client):
    for seed in range(2):
        resp = _ask(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, temperature=1.0, seed=seed)
        (call,) = resp.choices[0].message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_call_is_assembled_from_deltas_by_the_client(client):
    with client.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_tool_result_round_trip_is_accepted(client):
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome","unit":"celsius"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]  # fmt: skip
    resp = _ask(client, messages=messages, tools=[WEATHER], max_tokens=8)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "body, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such-format"}}}}, ["not supported", "no-such-format"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ["json_schema.schema"]),
        ({"guided_regex": "(unclosed"}, ["guided_regex", "unclosed"]),
        ({"guided_grammar": "start: missing_rule"}, ["guided_grammar", "missing_rule"]),
        ({"guided_choice": []}, ["guided_choice"]),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, ["one output constraint"]),
        ({"tool_choice": "required"}, ["lists no tools"]),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["'nope'", "not in tools"]),
    ],
)
def test_constraint_errors_are_400s_that_say_what_to_fix(server, body, words):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    resp = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    for word in words:
        assert word in message, message
