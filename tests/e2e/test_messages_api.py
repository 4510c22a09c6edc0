"""Anthropic's Messages API (``POST /v1/messages``) against `kvmesh run`, through the
official anthropic client, streamed and not: system prompts, stop sequences, tools
(``tool_use`` out, ``tool_result`` in), errors in Anthropic's shape, the key as
``x-api-key`` or Bearer, and a stream whose worker is SIGKILLed mid-way giving the text
of an undisturbed run."""

from __future__ import annotations


import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers import kvmesh_run, migrations_total, streams_cut_mid_way

pytestmark = pytest.mark.processes

MODEL = "kvmesh-tiny"
KEY = "sk-test-messages"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
HELLO = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("messages"), "--api-key", KEY, "--canary-interval", "0") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    # the client sends its key as x-api-key
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


def _ask(client, **kwargs):
    kwargs.setdefault("extra_body", {"ignore_eos": True})
    kwargs.setdefault("messages", HELLO)
    return client.messages.create(model=MODEL, **kwargs)


@pytest.mark.timeout(120)
def test_unary_and_streamed_give_the_same_message(client):
    msg = _ask(client, max_tokens=12, system="Be brief.")
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.content[0].type == "text" and msg.content[0].text and msg.usage.output_tokens == 12
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0
    with client.messages.stream(
        model=MODEL, max_tokens=12, system="Be brief.", messages=HELLO, extra_body={"ignore_eos": True}
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == msg.content[0].text  # the mocker is deterministic
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


@pytest.mark.timeout(120)
def test_a_stop_sequence_ends_the_message_and_is_named(client):
    full = _ask(client, max_tokens=40).content[0].text
    stop = full[5:8]
    assert len(stop) == 3
    msg = _ask(client, max_tokens=40, stop_sequences=[stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == full[: full.index(stop)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_is_a_tool_use_block(client, stream):
    kwargs = dict(max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, extra_body={},
                  messages=[{"role": "user", "content": "Weather in Oslo?"}])  # fmt: skip
    if stream:
        with client.messages.stream(model=MODEL, **kwargs) as events:
            kinds = [e.type for e in events]
            msg = events.get_final_message()
        assert "content_block_delta" in kinds
    else:
        msg = client.messages.create(model=MODEL, **kwargs)
    assert msg.stop_reason == "tool_use"
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])


@pytest.mark.timeout(120)
def test_a_tool_result_continues_the_conversation(client):
    msg = _ask(client, max_tokens=6, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "unit": "celsius"}},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 degrees"}]},
    ])  # fmt: skip
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 6


@pytest.mark.timeout(60)
def test_bad_requests_are_400s_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _ask(client, max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": HELLO}, headers={"x-api-key": KEY})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", json={"model": "nope", "max_tokens": 4, "messages": HELLO}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.timeout(60)
def test_the_key_as_x_api_key_or_bearer_and_a_401_in_anthropic_shape(server):
    with anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0) as bearer:
        assert bearer.messages.create(model=MODEL, max_tokens=2, messages=HELLO).usage.output_tokens <= 2
    with anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0) as wrong, pytest.raises(
        anthropic.AuthenticationError
    ) as caught:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert caught.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": HELLO})
    assert r.status_code == 401 and r.json()["type"] == "error"


# ---------------------------------------------------------------- migration

STREAMS = 4
MAX_TOKENS = 120



async def _stream(client: anthropic.AsyncAnthropic, i: int, progress: list[int]) -> str:
    parts = []
    messages = [{"role": "user", "content": f"story {i}"}]
    async with client.messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, messages=messages, extra_body={"ignore_eos": True}
    ) as stream:
        async for text in stream.text_stream:
            parts.append(text)
            progress[i] += 1
        final = await stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == MAX_TOKENS
    return "".join(parts)


async def _unary(client: anthropic.AsyncAnthropic, i: int) -> str:
    msg = await client.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": f"story {i}"}],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return msg.content[0].text


@pytest.mark.timeout(240)
async def test_a_stream_whose_worker_is_killed_gives_the_undisturbed_text(tmp_path):
    # speedup 1: modelled step times, so a stream lasts long enough to be cut mid-way
    with kvmesh_run(tmp_path, "--router-mode", "round_robin", "--canary-interval", "0", workers=2, speedup="1") as server:
        async with anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as client:
            reference = [await _unary(client, i) for i in range(STREAMS)]
            before = migrations_total(server.url)
            streamed = await streams_cut_mid_way(server, lambda i, progress: _stream(client, i, progress), STREAMS)
        assert migrations_total(server.url) > before, "no stream was migrated"
    assert streamed == reference
