"""What Chat Completions and Completions share: OpenAI's usage object, the constant
head of a stream's chunks, its error event and end marker (pure)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.frontend.deltas import Usage
from kvmesh.frontend.sse import DONE

__all__ = ["DONE", "usage_object", "chunk_head", "usage_event", "error_event", "OpenAIStream"]

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


class OpenAIStream:
    """What a streamed chat completion and a streamed completion share: the chunk head
    (set at Start), the end (finish event, the usage chunk when ``include_usage``,
    ``[DONE]``) and the error event."""

    __slots__ = ("_head", "_prefix", "_include_usage")

    def __init__(self, include_usage: bool = False) -> None:
        self._include_usage = include_usage
        self._head = b""
        self._prefix = b""  # a text delta's event up to its JSON string (set at Start)

    def _end(self, finish_event: bytes, usage: Usage) -> bytes:
        if self._include_usage:
            finish_event += usage_event(self._head, usage)
        return finish_event + DONE

    def error(self, message: str, kind: str, status: int) -> bytes:
        return error_event(message, kind, status)
