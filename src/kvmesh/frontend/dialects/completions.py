"""Completions (``POST /v1/completions``): the delta stream as SSE chunks
(:class:`CompletionStream`) or one ``text_completion`` body (:class:`CompletionBody`)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.frontend.deltas import Delta, Finish, Start, Text, TokenLogprob, ToolCall
from kvmesh.frontend.dialects.openai import OpenAIStream, chunk_head, completion_body

__all__ = ["CompletionStream", "CompletionBody", "RESPONSE_PREFIX"]

_json = msgspec.json.encode
RESPONSE_PREFIX = "cmpl-"


def _logprobs(lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """The legacy ``logprobs`` object of a completion choice."""
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [dict(lp.top) for lp in lps],
        "text_offset": [],
    }


class CompletionStream(OpenAIStream):
    """SSE events of one streamed text completion (no role event; tool calls do not
    occur: completions read no tools)."""

    __slots__ = ()

    _TEXT_END = b',"logprobs":null,"finish_reason":null}]}\n\n'
    _LOGPROBS = b',"logprobs":'
    _LOGPROBS_END = b',"finish_reason":null}]}\n\n'

    def _logprobs_json(self, lps: tuple[TokenLogprob, ...]) -> bytes:
        return _json(_logprobs(lps))

    def _event(self, delta: Start | ToolCall | Finish) -> bytes:
        if isinstance(delta, Start):
            self._head = chunk_head("text_completion", RESPONSE_PREFIX + delta.request_id, delta.created, delta.model)
            self._prefix = self._head + b'[{"index":0,"text":'
            return b""
        if isinstance(delta, Finish):
            event = self._prefix + b'"","logprobs":null,"finish_reason":"' + delta.reason.encode() + b'"}]}\n\n'
            return self._end(event, delta.usage)
        return b""


class CompletionBody:
    """One ``text_completion`` object (``logprobs``: the request asked for them;
    ``route``: the router's explanation, when asked)."""

    __slots__ = ("_start", "_parts", "_logprobs", "_finish", "_route")

    def __init__(self, logprobs: bool = False, route: object = None) -> None:
        self._route = route
        self._start: Start | None = None
        self._parts: list[str] = []
        self._logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self._finish: Finish | None = None

    def add(self, delta: Delta) -> None:
        if isinstance(delta, Text):
            self._parts.append(delta.text)
            if delta.logprobs is not None and self._logprobs is not None:
                self._logprobs += delta.logprobs
        elif isinstance(delta, Start):
            self._start = delta
        elif isinstance(delta, Finish):
            self._finish = delta

    def body(self) -> bytes:
        start, finish = self._start, self._finish
        assert start is not None and finish is not None  # the stream's grammar
        logprobs = None if self._logprobs is None else _logprobs(tuple(self._logprobs))
        choice = {"index": 0, "finish_reason": finish.reason, "logprobs": logprobs, "text": "".join(self._parts)}
        return completion_body("text_completion", RESPONSE_PREFIX + start.request_id, start, finish, choice, self._route)
