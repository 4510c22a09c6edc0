"""OpenAI's Responses API (``POST /v1/responses``) against `kvmesh run`, through the
official openai client (``client.responses.create``), streamed and not: text, tools,
``text.format`` JSON schemas, ``previous_response_id`` chaining over the frontend's
store, errors in OpenAI's shape, the API key, and a stream whose worker is SIGKILLed
mid-way giving the text of an undisturbed run."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import kvmesh_run, migrations_total, streams_cut_mid_way

pytestmark = pytest.mark.processes

MODEL = "kvmesh-tiny"
KEY = "sk-test-responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ORDER = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "done": {"type": "boolean"}},
    "required": ["title", "done"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("responses"), "--api-key", KEY, "--canary-interval", "0") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


def _ask(client, **kwargs):
    kwargs.setdefault("extra_body", {"ignore_eos": True})
    return client.responses.create(model=MODEL, **kwargs)


@pytest.mark.timeout(120)
def test_text_input_streamed_equals_unary(client):
    unary = _ask(client, input="Say something.", instructions="Be brief.", max_output_tokens=12)
    assert unary.id.startswith("resp_") and unary.object == "response" and unary.model == MODEL
    assert unary.status == "incomplete" and unary.incomplete_details.reason == "max_output_tokens"
    assert unary.output_text and unary.usage.output_tokens == 12
    assert unary.usage.total_tokens == unary.usage.input_tokens + 12 and unary.instructions == "Be brief."
    events = list(_ask(client, input="Say something.", instructions="Be brief.", max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == unary.output_text == events[-1].response.output_text  # the mocker is deterministic
    assert events[-1].response.usage.output_tokens == 12


@pytest.mark.timeout(120)
def test_items_input_with_a_tool_round_trip_completes(client):
    resp = _ask(client, max_output_tokens=6, input=[
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo","unit":"celsius"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 3}'},
    ], tools=[WEATHER])  # fmt: skip
    assert resp.output[0].type == "message" and resp.usage.output_tokens == 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_is_a_function_call_item(client, stream):
    kwargs = dict(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_output_tokens=60, extra_body={})
    if stream:
        events = list(_ask(client, stream=True, **kwargs))
        assert "response.function_call_arguments.delta" in [e.type for e in events]
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1
        resp = events[-1].response
        assert done[0].arguments == resp.output[0].arguments
    else:
        resp = _ask(client, **kwargs)
    assert resp.status == "completed"
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


@pytest.mark.timeout(120)
def test_text_format_json_schema_is_followed(client):
    fmt = {"format": {"type": "json_schema", "name": "order", "schema": ORDER}}
    resp = _ask(client, input="An order, please.", text=fmt, max_output_tokens=80, extra_body={"seed": 3})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), ORDER)
    assert resp.text.format.type == "json_schema"


@pytest.mark.timeout(120)
def test_previous_response_id_continues_the_conversation(client):
    first = _ask(client, input="My name is Ada.", max_output_tokens=8)
    second = _ask(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=8)
    alone = _ask(client, input="What is my name?", max_output_tokens=8)
    assert second.previous_response_id == first.id
    # the second prompt holds the first turn (its input and its answer) before its own input
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    third = _ask(client, input="And again?", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


@pytest.mark.timeout(120)
def test_an_unknown_or_unstored_previous_response_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(client, input="x", previous_response_id="resp_" + "0" * 32, max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id" and "not found" in caught.value.body["message"]
    unstored = _ask(client, input="x", store=False, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="not found"):
        _ask(client, input="y", previous_response_id=unstored.id, max_output_tokens=4)


@pytest.mark.timeout(60)
def test_bad_requests_are_400s_in_openai_shape(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(client, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert caught.value.body["param"] == "input[0].content[0].type"
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL}, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "input" in error["message"]


@pytest.mark.timeout(60)
def test_a_missing_or_wrong_key_is_a_401(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0) as wrong, pytest.raises(
        openai.AuthenticationError
    ):
        wrong.responses.create(model=MODEL, input="x")
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 401 and "error" in r.json()


@pytest.mark.timeout(60)
def test_openapi_lists_the_dialects(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for path, schema in (("/v1/responses", "ResponsesRequest"), ("/v1/messages", "MessagesRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{schema}"}
        assert schema in doc["components"]["schemas"]


# ---------------------------------------------------------------- migration

STREAMS = 4
MAX_TOKENS = 120



async def _stream(client: openai.AsyncOpenAI, i: int, progress: list[int]) -> str:
    parts = []
    stream = await client.responses.create(
        model=MODEL, input=f"story {i}", max_output_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True}
    )
    async for event in stream:
        assert event.type != "error", event
        if event.type == "response.output_text.delta":
            parts.append(event.delta)
            progress[i] += 1
    assert event.type == "response.incomplete" and event.response.usage.output_tokens == MAX_TOKENS
    assert event.response.output_text == "".join(parts)
    return "".join(parts)


async def _unary(client: openai.AsyncOpenAI, i: int) -> str:
    resp = await client.responses.create(
        model=MODEL, input=f"story {i}", max_output_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    return resp.output_text


@pytest.mark.timeout(240)
async def test_a_stream_whose_worker_is_killed_gives_the_undisturbed_text(tmp_path):
    # speedup 1: modelled step times, so a stream lasts long enough to be cut mid-way
    with kvmesh_run(tmp_path, "--router-mode", "round_robin", "--canary-interval", "0", workers=2, speedup="1") as server:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            reference = [await _unary(client, i) for i in range(STREAMS)]
            before = migrations_total(server.url)
            streamed = await streams_cut_mid_way(server, lambda i, progress: _stream(client, i, progress), STREAMS)
        assert migrations_total(server.url) > before, "no stream was migrated"
    assert streamed == reference
