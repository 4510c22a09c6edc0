"""Chat Completions (``POST /v1/chat/completions``): the delta stream as SSE chunks
(:class:`ChatStream`) or one ``chat.completion`` body (:class:`ChatBody`)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.frontend.deltas import Delta, Finish, Start, Text, TokenLogprob, ToolCall
from kvmesh.frontend.dialects.openai import OpenAIStream, chunk_head, completion_body

__all__ = ["ChatStream", "ChatBody", "RESPONSE_PREFIX"]

_json = msgspec.json.encode
RESPONSE_PREFIX = "chatcmpl-"


def _logprobs(lps: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries."""
    return [
        {
            "token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top],
        }
        for lp in lps
    ]  # fmt: skip


class ChatStream(OpenAIStream):
    """SSE events of one streamed chat completion (``include_usage``: a usage chunk
    before the end)."""

    __slots__ = ()

    _TEXT_END = b'},"finish_reason":null}]}\n\n'
    _LOGPROBS = b'},"logprobs":{"content":'
    _LOGPROBS_END = _TEXT_END

    def _logprobs_json(self, lps: tuple[TokenLogprob, ...]) -> bytes:
        return _json(_logprobs(lps))

    def _event(self, delta: Start | ToolCall | Finish) -> bytes:
        if isinstance(delta, Start):
            return self._start(delta)
        if isinstance(delta, ToolCall):
            return self._tool_call(delta)
        return self._finish(delta)

    def _start(self, start: Start) -> bytes:
        self._head = chunk_head("chat.completion.chunk", RESPONSE_PREFIX + start.request_id, start.created, start.model)
        self._prefix = self._head + b'[{"index":0,"delta":{"content":'
        return self._head + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'

    def _tool_call(self, call: ToolCall) -> bytes:
        part: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
        if call.id is not None:
            part = {"index": call.index, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
        return self._head + b'[{"index":0,"delta":{"tool_calls":[' + _json(part) + b']},"finish_reason":null}]}\n\n'

    def _finish(self, finish: Finish) -> bytes:
        event = self._head + b'[{"index":0,"delta":{},"finish_reason":"' + finish.reason.encode() + b'"}]}\n\n'
        return self._end(event, finish.usage)


class ChatBody:
    """One ``chat.completion`` object (``logprobs``: the request asked for them;
    ``route``: the router's explanation, when asked)."""

    __slots__ = ("_start", "_parts", "_logprobs", "_calls", "_finish", "_route")

    def __init__(self, logprobs: bool = False, route: object = None) -> None:
        self._route = route
        self._start: Start | None = None
        self._parts: list[str] = []
        self._logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self._calls: list[dict[str, Any]] = []
        self._finish: Finish | None = None

    def add(self, delta: Delta) -> None:
        if isinstance(delta, Text):
            self._parts.append(delta.text)
            if delta.logprobs is not None and self._logprobs is not None:
                self._logprobs += _logprobs(delta.logprobs)
        elif isinstance(delta, ToolCall):
            if delta.id is not None:
                self._calls.append({"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}})
            self._calls[-1]["function"]["arguments"] += delta.arguments
        elif isinstance(delta, Start):
            self._start = delta
        else:
            self._finish = delta

    def body(self) -> bytes:
        start, finish = self._start, self._finish
        assert start is not None and finish is not None  # the stream's grammar
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._parts)}
        if self._calls:
            message = {"role": "assistant", "content": None, "tool_calls": self._calls}
        logprobs = None if self._logprobs is None else {"content": self._logprobs}
        choice = {"index": 0, "finish_reason": finish.reason, "logprobs": logprobs, "message": message}
        return completion_body("chat.completion", RESPONSE_PREFIX + start.request_id, start, finish, choice, self._route)
