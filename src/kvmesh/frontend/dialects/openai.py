"""What Chat Completions and Completions share: OpenAI's usage object, the constant
head of a stream's chunks, its error event and end marker (pure)."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from kvmesh.frontend.deltas import Delta, Finish, Start, Text, TokenLogprob, ToolCall, Usage
from kvmesh.frontend.sse import DONE

__all__ = ["DONE", "usage_object", "chunk_head", "usage_event", "error_event", "completion_body", "OpenAIStream"]

_json = msgspec.json.encode


def usage_object(u: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` (the one place it is shaped, streamed or not)."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def chunk_head(object_name: str, response_id: str, created: int, model: str) -> bytes:
    """Every chunk's constant part, up to ``"choices":`` (encoded once per request)."""
    return (
        b'data: {"id":' + _json(response_id) + b',"object":"' + object_name.encode()
        + b'","created":' + str(created).encode() + b',"model":' + _json(model) + b',"choices":'
    )  # fmt: skip


def usage_event(head: bytes, u: Usage) -> bytes:
    return head + b'[],"usage":' + _json(usage_object(u)) + b"}\n\n"


def error_event(message: str, kind: str, status: int) -> bytes:
    """A failure after the stream started: one ``error`` event, then the end marker."""
    body = _json({"error": {"message": message, "type": kind, "param": None, "code": status}})
    return b"event: error\ndata: " + body + b"\n\n" + DONE


def completion_body(object_name: str, response_id: str, start: Start, finish: Finish, choice: dict[str, Any], route: object) -> bytes:
    """One non-streamed ``chat.completion`` or ``text_completion`` object around its one
    ``choice`` (``route``: the router's explanation, when asked)."""
    body: dict[str, Any] = {
        "id": response_id, "object": object_name, "created": start.created,
        "model": start.model, "choices": [choice], "usage": usage_object(finish.usage),
    }  # fmt: skip
    if route is not None:
        body["kvmesh_route"] = route
    return _json(body)


class OpenAIStream:
    """What a streamed chat completion and a streamed completion share: the chunk head
    (set at Start), a text delta's event (the dialect's bytes around its text and
    logprobs), the end (finish event, the usage chunk when ``include_usage``,
    ``[DONE]``) and the error event."""

    __slots__ = ("_head", "_prefix", "_text_end", "_include_usage")

    # A text delta's event after its JSON string: without logprobs (``_TEXT_END``), or
    # ``_LOGPROBS`` + the dialect's logprobs JSON (:meth:`_logprobs_json`) + ``_LOGPROBS_END``.
    _TEXT_END: ClassVar[bytes]
    _LOGPROBS: ClassVar[bytes]
    _LOGPROBS_END: ClassVar[bytes]

    def __init__(self, include_usage: bool = False) -> None:
        self._include_usage = include_usage
        self._head = b""
        self._prefix = b""  # a text delta's event up to its JSON string (set at Start)
        self._text_end = self._TEXT_END  # NOTE: read per chunk, and a slot reads faster than a class attribute

    def encode(self, delta: Delta) -> bytes:
        if isinstance(delta, Text):  # NOTE: per chunk; the other deltas come once or rarely
            if delta.logprobs is None:
                return self._prefix + _json(delta.text) + self._text_end
            lps = self._logprobs_json(delta.logprobs)
            return self._prefix + _json(delta.text) + self._LOGPROBS + lps + self._LOGPROBS_END
        return self._event(delta)

    def _logprobs_json(self, lps: tuple[TokenLogprob, ...]) -> bytes:
        raise NotImplementedError

    def _event(self, delta: Start | ToolCall | Finish) -> bytes:
        """The event of a delta other than text (Start sets ``_head`` and ``_prefix``)."""
        raise NotImplementedError

    def _end(self, finish_event: bytes, usage: Usage) -> bytes:
        if self._include_usage:
            finish_event += usage_event(self._head, usage)
        return finish_event + DONE

    def error(self, message: str, kind: str, status: int) -> bytes:
        return error_event(message, kind, status)
