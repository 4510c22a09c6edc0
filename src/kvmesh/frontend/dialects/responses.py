"""OpenAI Responses encoding: one request's delta stream (:mod:`kvmesh.frontend.deltas`)
as a response object (JSON body) or as Responses' semantic SSE events.

Events of one stream (each ``event: <type>`` + ``data: {...,"sequence_number": n}``)::

    response.created, response.in_progress
    [response.output_item.added (message), response.content_part.added (output_text),
     response.output_text.delta*, response.output_text.done, response.content_part.done,
     response.output_item.done]                              the text, if any
    [response.output_item.added (function_call), response.function_call_arguments.delta*,
     response.function_call_arguments.done, response.output_item.done]*    each tool call
    response.completed | response.incomplete (max_output_tokens)

A failure after the start is an ``error`` event then ``response.failed``. The message
item opens with the first text; an answer with neither text nor tool calls is one
message with empty text (as the body gives). The response object echoes the request's
settings (instructions, tools, tool_choice, text.format ...), built once per request.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument
from kvmesh.frontend.deltas import Delta, Finish, Start, Text, ToolCall, Usage
from kvmesh.frontend.dialects import responses_api
from kvmesh.frontend.dialects.common import Answer, EventEncoder
from kvmesh.frontend.dialects.responses_api import ResponsesChat, ResponsesRequest
from kvmesh.frontend.dialects.store import ResponseStore
from kvmesh.frontend.generate import Dialect, GenerationRequest
from kvmesh.frontend.schemas import ChatMessage, check_limits

__all__ = ["ResponseEvents", "ResponseBody", "new_response_id", "responses_dialect"]

_json = msgspec.json.encode

# (text, tool calls as (call_id, name, arguments)): what a finished response leaves to its store
OnDone = Callable[[str, list[tuple[str, str, str]]], None]


def new_response_id() -> str:
    """``resp_`` + 128 random bits: an id is the key to a stored conversation."""
    return "resp_" + os.urandom(16).hex()


class _Shape:
    """The parts of one request's response objects that never change (ids, echo)."""

    __slots__ = ("id", "message_id", "echo")

    def __init__(self, req: ResponsesRequest, response_id: str) -> None:
        self.id = response_id
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.echo = _echo(req)

    def call_id(self, index: int) -> str:
        return f"fc_{self.id.removeprefix('resp_')}_{index}"

    def response(self, created: int, model: str, status: str, output: list[Any], usage: Usage | None) -> dict[str, Any]:
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "usage": _usage(usage), "error": None, "incomplete_details": details, **self.echo,
        }  # fmt: skip

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": [content]}

    def call(self, index: int, call: list[str], status: str) -> dict[str, Any]:
        return {
            "id": self.call_id(index), "type": "function_call", "status": status, "call_id": call[0], "name": call[1],
            "arguments": call[2] if status != "in_progress" else "",
        }  # fmt: skip

    def output(self, answer: Answer, status: str) -> list[Any]:
        items = [self.call(i, c, "completed") for i, c in enumerate(answer.calls)]
        if answer.parts and answer.text or not items:
            items.insert(0, self.message(answer.text, "incomplete" if status == "incomplete" else "completed"))
        return items


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
    return {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "store": req.store, "temperature": req.temperature, "top_p": req.top_p, "text": {"format": fmt},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled", "user": req.user,
    }  # fmt: skip


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }  # fmt: skip


def _status(finish: Finish) -> str:
    if finish.reason == "length":
        return "incomplete"
    return "cancelled" if finish.reason == "cancelled" else "completed"


class ResponseBody:
    """The unary answer: one response object (a :class:`~kvmesh.frontend.deltas.BodyEncoder`)."""

    __slots__ = ("_shape", "_answer", "_start", "_finish", "_on_done")

    def __init__(self, req: ResponsesRequest, response_id: str, on_done: OnDone | None = None) -> None:
        self._shape = _Shape(req, response_id)
        self._answer = Answer()
        self._start: Start | None = None
        self._finish: Finish | None = None
        self._on_done = on_done

    def add(self, delta: Delta) -> None:
        if isinstance(delta, Start):
            self._start = delta
        elif isinstance(delta, Finish):
            self._finish = delta
        else:
            self._answer.add(delta)

    def body(self) -> bytes:
        start, finish, answer = self._start, self._finish, self._answer
        assert start is not None and finish is not None  # the stream's grammar: Start ... Finish
        status = _status(finish)
        if self._on_done is not None and status != "cancelled":
            self._on_done(answer.text, answer.call_list())
        output = self._shape.output(answer, status)
        return _json(self._shape.response(start.created, start.model, status, output, finish.usage))


class ResponseEvents(EventEncoder):
    """SSE events of one streamed response, in the order the module docstring draws (a
    :class:`~kvmesh.frontend.deltas.StreamEncoder`)."""

    __slots__ = ("_shape", "_seq", "_answer", "_message_open", "_created", "_model", "_delta_head", "_on_done")

    def __init__(self, req: ResponsesRequest, response_id: str, on_done: OnDone | None = None) -> None:
        self._shape = _Shape(req, response_id)
        self._seq = 0
        self._answer = Answer()
        self._message_open = False
        self._created = 0
        self._model = ""
        self._on_done = on_done
        self._delta_head = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":'
            + _json(self._shape.message_id) + b',"output_index":0,"content_index":0,"logprobs":[],"delta":'
        )  # fmt: skip

    def _event(self, kind: str, body: dict[str, Any]) -> bytes:
        data = _json({"type": kind, **body, "sequence_number": self._seq})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _start(self, d: Start) -> bytes:
        self._created, self._model = d.created, d.model
        response = self._shape.response(d.created, d.model, "in_progress", [], None)
        return self._event("response.created", {"response": response}) + self._event(
            "response.in_progress", {"response": response}
        )

    def _text(self, d: Text) -> bytes:
        if not d.text:
            return b""
        head = b"" if self._message_open else self._open_message()
        self._answer.parts.append(d.text)
        seq = self._seq
        self._seq += 1
        return head + self._delta_head + _json(d.text) + b',"sequence_number":' + str(seq).encode() + b"}\n\n"

    def _open_message(self) -> bytes:
        self._message_open = True
        item = self._shape.message("", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": self._shape.message_id, "output_index": 0, "content_index": 0}
        return self._event("response.output_item.added", {"output_index": 0, "item": item}) + self._event(
            "response.content_part.added", {**where, "part": part}
        )

    def _close_message(self, status: str) -> bytes:
        text = self._answer.text
        where = {"item_id": self._shape.message_id, "output_index": 0, "content_index": 0}
        item = self._shape.message(text, status)
        return (
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
            + self._event("response.content_part.done", {**where, "part": item["content"][0]})
            + self._event("response.output_item.done", {"output_index": 0, "item": item})
        )

    def _output_index(self, call: int) -> int:
        return call + (1 if self._message_open else 0)

    def _tool_call(self, d: ToolCall) -> bytes:
        out = b""
        if d.index == len(self._answer.calls):  # a new call: the text and the previous call are complete
            if self._message_open and not self._answer.calls:
                out += self._close_message("completed")
            if self._answer.calls:
                out += self._close_call(d.index - 1)
            self._answer.add_call(d)
            item = self._shape.call(d.index, self._answer.calls[d.index], "in_progress")
            out += self._event("response.output_item.added", {"output_index": self._output_index(d.index), "item": item})
        else:
            self._answer.add_call(d)
        if d.arguments:
            where = {"item_id": self._shape.call_id(d.index), "output_index": self._output_index(d.index)}
            out += self._event("response.function_call_arguments.delta", {**where, "delta": d.arguments})
        return out

    def _close_call(self, index: int) -> bytes:
        call = self._answer.calls[index]
        where = {"item_id": self._shape.call_id(index), "output_index": self._output_index(index)}
        item = self._shape.call(index, call, "completed")
        return self._event("response.function_call_arguments.done", {**where, "name": call[1], "arguments": call[2]}) + (
            self._event("response.output_item.done", {"output_index": where["output_index"], "item": item})
        )

    def _finish(self, d: Finish) -> bytes:
        """The last events: open items closed, then the whole response."""
        status = _status(d)
        out = b""
        if not self._answer.calls and not self._message_open:
            out += self._open_message()  # no output at all: one empty message, as the body has
        if self._message_open and not self._answer.calls:
            out += self._close_message("incomplete" if status == "incomplete" else "completed")
        if self._answer.calls:
            out += self._close_call(len(self._answer.calls) - 1)
        if self._on_done is not None and status != "cancelled":
            self._on_done(self._answer.text, self._answer.call_list())
        response = self._shape.response(
            self._created, self._model, status, self._shape.output(self._answer, status), d.usage
        )
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": response})

    def error(self, message: str, kind: str, status: int) -> bytes:
        """A failure after the start: an ``error`` event, then ``response.failed``."""
        response = self._shape.response(self._created, self._model, "failed", [], None)
        response["error"] = {"code": "server_error", "message": message}
        return self._event("error", {"code": kind, "message": message, "param": None}) + self._event(
            "response.failed", {"response": response}
        )


# ---- the route: /v1/responses as a dialect of the generation routes


def responses_dialect(store: ResponseStore, clock: Callable[[], float] = time.monotonic) -> Dialect:
    """``POST /v1/responses``: a body → its chat request (limits checked in the
    request's own terms, then the chat route's over the whole conversation); a finished
    response with ``store`` leaves its conversation in ``store``."""

    def parse(body: bytes, security: SecurityConfig, caller: str) -> ResponsesChat:
        req = responses_api.parse(body)
        responses_api.check_limits(req, security)
        scope = _scope(caller)
        history = _history(store, scope, req.previous_response_id, clock())
        chat = responses_api.to_chat(req, history, new_response_id())
        chat.scope = scope
        _check_conversation(chat, security, len(history))
        return chat

    def keep(chat: ResponsesChat) -> OnDone | None:
        if not chat.source.store:
            return None

        def done(text: str, calls: list[tuple[str, str, str]]) -> None:
            turns = [*chat.turns, responses_api.output_turn(text, calls)]
            store.put(chat.scope + chat.response_id, responses_api.encode_turns(turns), clock())

        return done

    def stream(req: GenerationRequest) -> ResponseEvents:
        chat = _translated(req)
        return ResponseEvents(chat.source, chat.response_id, keep(chat))

    def body(req: GenerationRequest, route: object) -> ResponseBody:
        chat = _translated(req)
        return ResponseBody(chat.source, chat.response_id, keep(chat))

    return Dialect("responses", parse, stream, body)


def _translated(req: GenerationRequest) -> ResponsesChat:
    assert isinstance(req, ResponsesChat)  # this dialect's parse made it
    return req


def _scope(caller: str) -> str:
    """Whose conversations a request may continue: with API keys, the key's (a digest of
    it, never the key) — another key naming the id finds nothing, as if it never existed;
    without keys, everyone's."""
    return hashlib.sha256(caller.encode()).hexdigest()[:32] + "/" if caller else ""


def _history(store: ResponseStore, scope: str, previous: str | None, now: float) -> list[ChatMessage]:
    if previous is None:
        return []
    stored = store.get(scope + previous, now)
    if stored is None:
        raise InvalidArgument(
            f"Previous response with id {previous!r} not found: it was never stored here (store: false, another "
            "frontend), or it expired or was evicted (--responses-store-ttl, --responses-store-entries); send the "
            "conversation as input items instead - at `$.previous_response_id`"
        )
    return responses_api.decode_turns(stored)


def _check_conversation(chat: ResponsesChat, security: SecurityConfig, earlier: int) -> None:
    """The chat route's limits over the whole conversation (earlier turns included)."""
    try:
        check_limits(chat, security)
    except InvalidArgument as exc:
        if not earlier:
            raise
        raise InvalidArgument(f"with the {earlier} earlier messages of previous_response_id: {exc.message}") from None
