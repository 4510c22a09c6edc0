"""The Responses and Messages dialects without a server: request translation into the
internal chat request, their limits, the bounded response store, and the encoders'
bytes read by the official clients (openai, anthropic) through an in-memory transport
and validated against the clients' own event and body types."""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import msgspec
import openai
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument
from kvmesh.frontend.deltas import Finish, Start, Text, ToolCall, Usage
from kvmesh.frontend.dialects import messages_api, responses_api
from kvmesh.frontend.dialects.messages import MessageBody, MessageEvents
from kvmesh.frontend.dialects.responses import ResponseBody, ResponseEvents, new_response_id
from kvmesh.frontend.dialects.store import ResponseStore

pytestmark = pytest.mark.timeout(60)

START = Start("r1", "kvmesh-tiny", 1_700_000_000, 7)
USAGE = Usage(7, 3, 2)


def _responses(body: dict) -> responses_api.ResponsesRequest:
    return responses_api.parse(json.dumps({"model": "kvmesh-tiny", **body}).encode())


def _messages(body: dict) -> messages_api.MessagesRequest:
    return messages_api.parse(json.dumps({"model": "kvmesh-tiny", "max_tokens": 8, **body}).encode())


# ---------------------------------------------------------------- the store


def test_store_expires_entries_after_the_ttl():
    store = ResponseStore(max_entries=4, max_bytes=100, ttl_s=10)
    assert store.put("a", b"x", now=0)
    assert store.get("a", now=9.9) == b"x"
    assert store.get("a", now=10) is None
    assert len(store) == 0 and store.size == 0


def test_store_evicts_the_oldest_past_either_bound():
    store = ResponseStore(max_entries=2, max_bytes=10, ttl_s=100)
    store.put("a", b"1234", now=0)
    store.put("b", b"1234", now=1)
    store.put("c", b"12", now=2)  # a third entry: a goes
    assert store.get("a", now=3) is None and store.get("b", now=3) == b"1234"
    store.put("d", b"123456789", now=3)  # 9 bytes: b and c go
    assert [store.get(k, now=4) for k in "bcd"] == [None, None, b"123456789"]
    assert store.size == 9


def test_store_refuses_one_value_over_the_byte_bound_and_keeps_the_rest():
    store = ResponseStore(max_entries=2, max_bytes=4, ttl_s=100)
    store.put("a", b"12", now=0)
    assert not store.put("b", b"12345", now=0)
    assert store.get("a", now=1) == b"12" and store.get("b", now=1) is None


def test_store_replacing_a_key_counts_its_bytes_once():
    store = ResponseStore(max_entries=4, max_bytes=10, ttl_s=100)
    store.put("a", b"123456", now=0)
    store.put("a", b"1234", now=1)
    assert store.size == 4 and len(store) == 1


def test_response_ids_are_random():
    ids = {new_response_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("resp_") and len(i) == 37 for i in ids)


# ---------------------------------------------------------------- Responses → chat


def test_responses_text_input_and_instructions_become_system_then_user():
    chat = responses_api.to_chat(_responses({"input": "hi", "instructions": "be brief", "max_output_tokens": 9}), [], "r")
    turns = chat.turns
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert [(m.role, m.content) for m in turns] == [("user", "hi")]  # instructions are not carried over
    assert chat.token_limit() == 9


def test_responses_items_history_and_tool_round_trip():
    history = [msgspec.json.decode(b'{"role":"user","content":"earlier"}', type=responses_api.ChatMessage)]
    req = _responses({"input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]})  # fmt: skip
    chat = responses_api.to_chat(req, history, "r")
    turns = chat.turns
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "system", "assistant", "tool"]
    call = json.loads(bytes(chat.messages[2].tool_calls[0]))
    assert call == {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[3].content == "sunny"
    assert turns == chat.messages
    stored = responses_api.decode_turns(responses_api.encode_turns([*turns, responses_api.output_turn("ok", [])]))
    assert [m.role for m in stored] == ["user", "system", "assistant", "tool", "assistant"]


def test_responses_tools_choice_and_json_schema_format_map_to_the_chat_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _responses({
        "input": "x", "tools": [{"type": "function", "name": "f", "parameters": schema}],
        "tool_choice": {"type": "function", "name": "f"},
    })  # fmt: skip
    chat = responses_api.to_chat(req, [], "r")
    assert chat.tools[0].function.name == "f" and chat.tools[0].function.parameters == schema
    assert chat.tool_choice.function.name == "f"
    req = _responses({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}})
    chat = responses_api.to_chat(req, [], "r")
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema == schema


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "message", "content": "no role"}]}, "input[0].role"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"input": []}, "input"),
    ],
)
def test_responses_bad_items_are_400s_naming_the_field(body, where):
    with pytest.raises(InvalidArgument, match=f"at `\\$.{where.replace('[', '.').replace(']', '.')}"):
        responses_api.to_chat(_responses(body), [], "r")


def test_responses_unknown_item_types_are_refused_by_the_schema():
    with pytest.raises(InvalidArgument, match=r"input\[0\]\.type"):
        _responses({"input": [{"type": "reasoning", "summary": []}]})


def test_responses_limits_name_the_largest_field_in_its_own_terms():
    limits = SecurityConfig(max_message_chars=100, max_messages=2)
    req = _responses({"input": [{"role": "user", "content": "a" * 60}, {"role": "user", "content": "b" * 50}]})
    with pytest.raises(InvalidArgument, match=r"110 characters.*at `\$\.input\[0\]\.content`"):
        responses_api.check_limits(req, limits)
    req = _responses({"input": "x", "tools": [{"type": "function", "name": "f", "description": "d" * 200}]})
    with pytest.raises(InvalidArgument, match=r"at `\$\.tools\[0\]\.description`"):
        responses_api.check_limits(req, limits)
    with pytest.raises(InvalidArgument, match="input holds 3 items"):
        responses_api.check_limits(_responses({"input": [{"role": "user", "content": "a"}] * 3}), limits)


# ---------------------------------------------------------------- Messages → chat


def test_messages_blocks_tool_use_and_tool_result_map_in_order():
    req = _messages({
        "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "so?"},
            ]},
        ],
        "stop_sequences": ["END"], "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
    })  # fmt: skip
    chat = messages_api.to_chat(req)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "sys"), ("user", "hi"), ("assistant", "let me look"), ("tool", "sunny"), ("user", "so?"),
    ]  # fmt: skip
    call = json.loads(bytes(chat.messages[2].tool_calls[0]))
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert chat.messages[3].tool_call_id == "toolu_1"
    assert chat.stop_strings() == ["END"] and chat.max_tokens == 8
    assert chat.tool_choice == "required" and chat.tools[0].function.parameters == {"type": "object"}


@pytest.mark.parametrize(
    ("choice", "expected"), [({"type": "auto"}, "auto"), ({"type": "none"}, "none"), (None, None)]
)
def test_messages_tool_choice(choice, expected):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}}]}
    if choice is not None:
        body["tool_choice"] = choice
    assert messages_api.to_chat(_messages(body)).tool_choice == expected
    body["tool_choice"] = {"type": "tool", "name": "f"}
    assert messages_api.to_chat(_messages(body)).tool_choice.function.name == "f"


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ([{"type": "image", "source": {}}], r"messages\[0\]\.content\[0\]\.type"),
        ([{"type": "tool_use", "id": "a", "name": "f", "input": {}}], r"messages\[0\]\.content\[0\]\.type"),
        ([{"type": "tool_result", "content": "x"}], r"messages\[0\]\.content\[0\]\.tool_use_id"),
    ],
)
def test_messages_bad_blocks_are_400s_naming_the_block(content, where):
    with pytest.raises(InvalidArgument, match=where):
        messages_api.to_chat(_messages({"messages": [{"role": "user", "content": content}]}))


def test_messages_limits():
    limits = SecurityConfig(max_message_chars=100, max_stop=2)
    req = _messages({"messages": [{"role": "user", "content": "a" * 101}]})
    with pytest.raises(InvalidArgument, match=r"at `\$\.messages\[0\]\.content`"):
        messages_api.check_limits(req, limits)
    req = _messages({"messages": [{"role": "user", "content": "a"}], "stop_sequences": ["a", "b", "c"]})
    with pytest.raises(InvalidArgument, match="stop_sequences holds 3"):
        messages_api.check_limits(req, limits)
    with pytest.raises(InvalidArgument, match=r"max_tokens"):
        messages_api.parse(b'{"model":"m","messages":[{"role":"user","content":"a"}]}')


def test_anthropic_error_body():
    body = json.loads(messages_api.error_body(401, "no key", "r1"))
    assert body == {"type": "error", "error": {"type": "authentication_error", "message": "no key"}, "request_id": "r1"}
    assert messages_api.error_type(503) == "overloaded_error" and messages_api.error_type(500) == "api_error"


# ---------------------------------------------------------------- encoders, read by the official clients

TEXT_RUN = [START, Text("Hel"), Text(""), Text("lo"), Finish("length", USAGE)]
TOOL_RUN = [
    START, ToolCall(0, "", "call_abc", "get_weather"), ToolCall(0, '{"city":'), ToolCall(0, '"Oslo"}'),
    Finish("tool_calls", USAGE),
]  # fmt: skip


def _sse(encoder, deltas) -> bytes:
    return b"".join(encoder.encode(d) for d in deltas)


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            head, data = block.split("\n", 1)
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def _transport(http, body: bytes, stream: bool):
    """``http``: httpx (the openai client's) or httpx2 (the anthropic client's)."""
    ctype = "text/event-stream" if stream else "application/json"
    return http.MockTransport(lambda request: http.Response(200, content=body, headers={"content-type": ctype}))


def _openai(body: bytes, stream: bool) -> openai.OpenAI:
    http = httpx.Client(transport=_transport(httpx, body, stream))
    return openai.OpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=0)


def _anthropic(body: bytes, stream: bool) -> anthropic.Anthropic:
    http = httpx2.Client(transport=_transport(httpx2, body, stream))
    return anthropic.Anthropic(base_url="http://test", api_key="k", http_client=http, max_retries=0)


def _responses_events(req, deltas) -> bytes:
    return _sse(ResponseEvents(req, "resp_0123", None), deltas)


def test_responses_stream_events_validate_as_the_clients_types_in_order():
    raw = _responses_events(_responses({"input": "x", "stream": True}), TEXT_RUN)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(data) for _, data in _events(raw)]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in _events(raw))
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == "Hello" and final.usage.output_tokens == 3 and final.usage.input_tokens_details.cached_tokens == 2


def test_responses_stream_read_by_the_openai_client():
    req = _responses({"input": "x", "stream": True})
    raw = _responses_events(req, [*TEXT_RUN[:-1], Finish("stop", USAGE)])
    client = _openai(raw, stream=True)
    events = list(client.responses.create(model="kvmesh-tiny", input="x", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello"


def test_responses_tool_call_stream_and_body_read_by_the_openai_client():
    req = _responses({"input": "x", "tools": [{"type": "function", "name": "get_weather"}], "tool_choice": "required"})
    raw = _responses_events(req, TOOL_RUN)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(data) for _, data in _events(raw)]
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    (call,) = events[-1].response.output
    assert (call.type, call.name, call.call_id, call.arguments) == ("function_call", "get_weather", "call_abc", '{"city":"Oslo"}')
    body = ResponseBody(req, "resp_0123", None)
    for d in TOOL_RUN:
        body.add(d)
    resp = _openai(body.body(), stream=False).responses.create(model="kvmesh-tiny", input="x")
    Response.model_validate(json.loads(body.body()))
    assert resp.output[0].type == "function_call" and json.loads(resp.output[0].arguments) == {"city": "Oslo"}
    assert resp.tools[0].name == "get_weather" and resp.tool_choice == "required"


def test_responses_text_then_tool_call_numbers_the_output_items():
    req = _responses({"input": "x"})
    raw = _responses_events(req, [START, Text("thinking"), *TOOL_RUN[1:]])
    events = [data for _, data in _events(raw)]
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call")]
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["message", "function_call"]


def test_responses_body_and_the_store_callback():
    req = _responses({"input": "x", "instructions": "be brief", "metadata": {"k": "v"}})
    done = []
    body = ResponseBody(req, "resp_0123", lambda text, calls: done.append((text, calls)))
    for d in [START, Text("Hel"), Text("lo"), Finish("stop", USAGE)]:
        body.add(d)
    resp = Response.model_validate(json.loads(body.body()))
    assert resp.id == "resp_0123" and resp.status == "completed" and resp.output_text == "Hello"
    assert resp.instructions == "be brief" and resp.metadata == {"k": "v"} and resp.usage.total_tokens == 10
    assert done == [("Hello", [])]


def test_responses_error_event_then_failed():
    events = ResponseEvents(_responses({"input": "x"}), "resp_0123", None)
    raw = events.encode(START) + events.error("the worker went away", "disconnected", 502)
    kinds = [pydantic.TypeAdapter(ResponseStreamEvent).validate_python(d).type for _, d in _events(raw)]
    assert kinds == ["response.created", "response.in_progress", "error", "response.failed"]


def test_messages_stream_read_by_the_anthropic_client():
    raw = _sse(MessageEvents("msg_1"), [*TEXT_RUN[:-1], Finish("stop", USAGE, "END")])
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    kinds = [adapter.validate_python(d).type for _, d in _events(raw)]
    assert kinds == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    client = _anthropic(raw, stream=True)
    with client.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello" and final.content[0].text == "Hello"
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (5, 2, 3)


def test_messages_tool_use_stream_and_body_read_by_the_anthropic_client():
    raw = _sse(MessageEvents("msg_1"), [START, Text("let me see"), *TOOL_RUN[1:]])
    with _anthropic(raw, stream=True).messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Oslo"} and final.content[1].id == "toolu_abc"
    assert final.stop_reason == "tool_use"
    body = MessageBody("msg_1")
    for d in TOOL_RUN:
        body.add(d)
    msg = _anthropic(body.body(), stream=False).messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    )
    Message.model_validate(json.loads(body.body()))
    assert msg.content[0].type == "tool_use" and msg.content[0].name == "get_weather"
    assert msg.content[0].input == {"city": "Oslo"} and msg.stop_reason == "tool_use"


def test_messages_body_stop_reasons():
    for finish, reason in [(Finish("length", USAGE), "max_tokens"), (Finish("stop", USAGE), "end_turn")]:
        body = MessageBody("msg_1")
        for d in [START, Text("hi"), finish]:
            body.add(d)
        msg = Message.model_validate(json.loads(body.body()))
        assert msg.stop_reason == reason and msg.content[0].text == "hi" and msg.model == "kvmesh-tiny"


def test_messages_error_event_is_raised_by_the_anthropic_client():
    events = MessageEvents("msg_1")
    raw = events.encode(START) + events.error("the worker went away", "disconnected", 502)
    with pytest.raises(anthropic.APIStatusError, match="the worker went away"):
        list(_anthropic(raw, stream=True).messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}], stream=True
        ))  # fmt: skip


# ---------------------------------------------------------------- the dialects' parse and store, and the key


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_responses_dialect_chains_through_the_store_until_the_ttl():
    from kvmesh.frontend.dialects.responses import responses_dialect

    clock = _Clock()
    dialect = responses_dialect(ResponseStore(10, 10_000, ttl_s=60), clock)
    limits = SecurityConfig()
    first = dialect.parse(b'{"model":"m","input":"My name is Ada.","instructions":"Be brief."}', limits, "")
    body = dialect.body(first, None)
    for d in [START, Text("Hello Ada"), Finish("stop", USAGE)]:
        body.add(d)
    assert json.loads(body.body())["id"] == first.response_id
    ask = b'{"model":"m","input":"Who am I?","previous_response_id":"%s"}' % first.response_id.encode()
    second = dialect.parse(ask, limits, "")
    assert [(m.role, m.content) for m in second.messages] == [
        ("user", "My name is Ada."), ("assistant", "Hello Ada"), ("user", "Who am I?"),
    ]  # fmt: skip
    clock.now = 60.0
    with pytest.raises(InvalidArgument, match=r"not found.*at `\$\.previous_response_id`"):
        dialect.parse(ask, limits, "")


def test_with_api_keys_a_stored_response_is_continued_only_with_the_key_that_made_it():
    from kvmesh.frontend.dialects.responses import responses_dialect

    store = ResponseStore(10, 10_000, ttl_s=60)
    dialect = responses_dialect(store, _Clock())
    limits = SecurityConfig()
    first = dialect.parse(b'{"model":"m","input":"My PIN is 4711."}', limits, "Bearer key-a")
    body = dialect.body(first, None)
    for d in [START, Text("Noted"), Finish("stop", USAGE)]:
        body.add(d)
    body.body()  # the finished answer is stored
    ask = b'{"model":"m","input":"What is my PIN?","previous_response_id":"%s"}' % first.response_id.encode()
    with pytest.raises(InvalidArgument, match=r"not found.*at `\$\.previous_response_id`"):
        dialect.parse(ask, limits, "Bearer key-b")  # another tenant who learned the id
    with pytest.raises(InvalidArgument, match="not found"):
        dialect.parse(ask, limits, "")  # nor a caller without a key
    mine = dialect.parse(ask, limits, "Bearer key-a")
    assert [m.content for m in mine.messages] == ["My PIN is 4711.", "Noted", "What is my PIN?"]
    assert all("key-a" not in k for k in store._entries)  # the key itself is never kept


def test_responses_dialect_keeps_nothing_without_store_and_bounds_the_whole_conversation():
    from kvmesh.frontend.dialects.responses import responses_dialect

    store = ResponseStore(10, 10_000, ttl_s=60)
    dialect = responses_dialect(store, _Clock())
    unstored = dialect.parse(b'{"model":"m","input":"x","store":false}', SecurityConfig(), "")
    events = dialect.stream(unstored)
    for d in [START, Text("y"), Finish("stop", USAGE)]:
        events.encode(d)
    assert len(store) == 0
    stored = dialect.parse(b'{"model":"m","input":"' + b"a" * 60 + b'"}', SecurityConfig(), "")
    events = dialect.stream(stored)
    for d in [START, Text("b" * 30), Finish("stop", USAGE)]:
        events.encode(d)
    assert len(store) == 1
    ask = b'{"model":"m","input":"' + b"c" * 20 + b'","previous_response_id":"%s"}' % stored.response_id.encode()
    with pytest.raises(InvalidArgument, match="with the 2 earlier messages of previous_response_id"):
        dialect.parse(ask, SecurityConfig(max_message_chars=100), "")  # 20 new characters alone would pass


def test_messages_dialect_errors_in_anthropic_shape():
    from kvmesh.frontend.dialects.messages import MESSAGES

    with pytest.raises(InvalidArgument) as caught:
        MESSAGES.parse(b'{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"x"}]}', SecurityConfig(), "")
    response = MESSAGES.error(caught.value, "rid")
    assert response.status == 400 and response.headers["x-request-id"] == "rid"
    body = json.loads(response.body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["request_id"] == "rid"
    assert "max_tokens" in body["error"]["message"]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"authorization": "Bearer k1"}, "Bearer k1"),
        ({"x-api-key": "k2"}, "Bearer k2"),
        ({"authorization": "Bearer k1", "x-api-key": "k2"}, "Bearer k1"),
        ({"x-api-key": ""}, None),
        ({}, None),
    ],
)
def test_the_key_is_read_from_authorization_or_x_api_key(headers, expected):
    from kvmesh.frontend.auth import Authenticator, presented

    assert presented(headers) == expected
    auth = Authenticator(SecurityConfig(api_keys=(("k2", "standard"),)))
    if expected == "Bearer k2":
        assert auth.tier_of(presented(headers)) == "standard"
