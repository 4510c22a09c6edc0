"""Anthropic Messages encoding: one request's delta stream (:mod:`kvmesh.frontend.deltas`)
as a message (JSON body) or as Messages' SSE events.

Events of one stream (each ``event: <type>`` + ``data: {"type": <type>, ...}``)::

    message_start                                  the message, empty, with input_tokens
    [content_block_start (text), content_block_delta (text_delta)*, content_block_stop]
    [content_block_start (tool_use), content_block_delta (input_json_delta)*,
     content_block_stop]*                          each tool call
    message_delta                                  stop_reason, stop_sequence, usage
    message_stop

A failure after the start is one ``error`` event (Anthropic's error shape). Usage in
Anthropic's terms: ``input_tokens`` are the prompt's tokens not read from the KV cache,
``cache_read_input_tokens`` the ones that were (``message_start`` reports the whole
prompt, before the cache is known; the ``message_delta`` totals replace it).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from kvmesh.config import SecurityConfig
from kvmesh.frontend.deltas import Delta, Finish, Start, Text, ToolCall, Usage
from kvmesh.frontend.dialects import messages_api
from kvmesh.frontend.dialects.messages_api import error_body, error_type
from kvmesh.frontend.dialects.common import Answer, EventEncoder
from kvmesh.frontend.failures import error_response
from kvmesh.frontend.generate import Dialect, GenerationRequest
from kvmesh.frontend.schemas import ChatCompletionRequest, check_limits
from kvmesh.frontend.server import Response

__all__ = [
    "MessageEvents", "MessageBody", "new_message_id", "stop_reason", "error_event", "anthropic_error_response",
    "MESSAGES",
]  # fmt: skip

_json = msgspec.json.encode


def new_message_id() -> str:
    return "msg_" + os.urandom(12).hex()


def _tool_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or os.urandom(12).hex()).removeprefix("call_")


def stop_reason(finish: Finish, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0,
    }  # fmt: skip


def _input(arguments: str) -> msgspec.Raw:
    """A tool call's arguments as ``tool_use.input``, which must be an object."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        value = arguments
    return msgspec.Raw(arguments.encode()) if isinstance(value, dict) else msgspec.Raw(_json({"arguments": value}))


class MessageBody:
    """The unary answer: one message, its text then one tool_use block per call (a
    :class:`~kvmesh.frontend.deltas.BodyEncoder`)."""

    __slots__ = ("_id", "_answer", "_model", "_finish")

    def __init__(self, message_id: str) -> None:
        self._id = message_id
        self._answer = Answer()
        self._model = ""
        self._finish: Finish | None = None

    def add(self, delta: Delta) -> None:
        if isinstance(delta, Start):
            self._model = delta.model
        elif isinstance(delta, Finish):
            self._finish = delta
        else:
            self._answer.add(delta)

    def body(self) -> bytes:
        finish, answer = self._finish, self._answer
        assert finish is not None  # the stream's grammar: ... Finish
        content: list[dict[str, Any]] = [{"type": "text", "text": answer.text}] if answer.parts else []
        for call_id, name, arguments in answer.call_list():
            content.append({"type": "tool_use", "id": _tool_id(call_id), "name": name, "input": _input(arguments)})
        return _json({
            "id": self._id, "type": "message", "role": "assistant", "model": self._model, "content": content,
            "stop_reason": stop_reason(finish, bool(answer.calls)), "stop_sequence": finish.stop_sequence,
            "usage": _usage(finish.usage),
        })  # fmt: skip


def error_event(status: int, message: str) -> bytes:
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return b"event: error\ndata: " + _json(body) + b"\n\n"


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json({"type": kind, **body}) + b"\n\n"


_TEXT_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'


class MessageEvents(EventEncoder):
    """SSE events of one streamed message, in the order the module docstring draws (a
    :class:`~kvmesh.frontend.deltas.StreamEncoder`)."""

    __slots__ = ("_id", "_block", "_open", "_calls")

    def __init__(self, message_id: str) -> None:
        self._id = message_id
        self._block = -1  # index of the last block started
        self._open: str | None = None  # "text" / "tool_use": the block not yet stopped
        self._calls = 0

    def error(self, message: str, kind: str, status: int) -> bytes:
        return error_event(status, message)

    def _start(self, d: Start) -> bytes:
        message: dict[str, Any] = {
            "id": self._id, "type": "message", "role": "assistant", "model": d.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": d.prompt_tokens, "output_tokens": 0},
        }  # fmt: skip
        return _event("message_start", {"message": message})

    def _text(self, d: Text) -> bytes:
        if not d.text:
            return b""
        head = b""
        if self._open != "text":
            head = self._stop() + self._begin("text", {"type": "text", "text": ""})
        delta = b',"delta":{"type":"text_delta","text":' + _json(d.text) + b"}}\n\n"
        return head + _TEXT_DELTA + str(self._block).encode() + delta

    def _tool_call(self, d: ToolCall) -> bytes:
        head = b""
        if d.index == self._calls:  # a new call: the block before it is complete
            self._calls += 1
            block = {"type": "tool_use", "id": _tool_id(d.id), "name": d.name or "", "input": {}}
            head = self._stop() + self._begin("tool_use", block)
        if not d.arguments:
            return head
        delta = {"type": "input_json_delta", "partial_json": d.arguments}
        return head + _event("content_block_delta", {"index": self._block, "delta": delta})

    def _finish(self, d: Finish) -> bytes:
        """The last events: the open block stopped, the stop reason and usage, the end."""
        delta = {"stop_reason": stop_reason(d, self._calls > 0), "stop_sequence": d.stop_sequence}
        return (
            self._stop()
            + _event("message_delta", {"delta": delta, "usage": _usage(d.usage)})
            + _event("message_stop", {})
        )

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        self._block += 1
        self._open = kind
        return _event("content_block_start", {"index": self._block, "content_block": block})

    def _stop(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"index": self._block})


# ---- the route: /v1/messages as a dialect of the generation routes


def anthropic_error_response(exc: BaseException, request_id: str | None = None) -> Response:
    """:func:`~kvmesh.frontend.failures.error_response` (status, headers, what a client
    may read) in Anthropic's shape."""
    response = error_response(exc, request_id)
    message = msgspec.json.decode(response.body)["error"]["message"]
    response.body = error_body(response.status, message, response.headers["x-request-id"])
    return response


def _parse(body: bytes, security: SecurityConfig, caller: str) -> ChatCompletionRequest:
    req = messages_api.parse(body)
    messages_api.check_limits(req, security)
    chat = messages_api.to_chat(req)
    check_limits(chat, security)  # the chat route's own, over what the blocks became
    return chat


def _stream(req: GenerationRequest) -> MessageEvents:
    return MessageEvents(new_message_id())


def _body(req: GenerationRequest, route: object) -> MessageBody:
    return MessageBody(new_message_id())


MESSAGES = Dialect("messages", _parse, _stream, _body, anthropic_error_response)
