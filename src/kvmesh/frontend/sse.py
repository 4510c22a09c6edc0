"""Server-sent events: encoding OpenAI stream chunks and writing them to the socket.

Encoding: the constant parts of every chunk of one response (id, created, model) are
encoded once per request; a content event is then ``prefix + json(text) + suffix``.

Writing (:class:`SSEResponse`): the head goes out with the first event (or the first
keep-alive comment); an event is written at once unless the stream already wrote in this
loop iteration (then it goes out with the others of that iteration at the start of the
next: :class:`~kvmesh.frontend.server.ResponseStream`); the end of a stream, ``finish``
+ ``usage`` + ``[DONE]`` + the chunked terminator and anything still held, is one write; the
client's disconnect, a callback from the connection, stops the request's context
(which stops the engine); :class:`KeepAlive` sends ``: keep-alive`` comments on
streams that have been idle for its interval, from one task for all streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from kvmesh.frontend.server import ResponseStream
from kvmesh.runtime.context import Context
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = ["ChatChunks", "CompletionChunks", "SSEResponse", "KeepAlive", "DONE", "error_event"]

_json = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
_KEEPALIVE = b": keep-alive\n\n"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def _head(object_name: str, response_id: str, created: int, model: str) -> bytes:
    return (
        b'data: {"id":' + _json(response_id) + b',"object":"' + object_name.encode()
        + b'","created":' + str(created).encode() + b',"model":' + _json(model) + b',"choices":'
    )  # fmt: skip


def _usage(prompt: int, completion: int, cached: int) -> bytes:
    return _json(
        {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
    )


def error_event(message: str, kind: str, status: int) -> bytes:
    body = _json({"error": {"message": message, "type": kind, "param": None, "code": status}})
    return b"event: error\ndata: " + body + b"\n\n"


class ChatChunks:
    """Event bytes for one streamed chat completion."""

    __slots__ = ("_head", "_content_prefix")

    def __init__(self, response_id: str, created: int, model: str) -> None:
        self._head = _head("chat.completion.chunk", response_id, created, model)
        self._content_prefix = self._head + b'[{"index":0,"delta":{"content":'

    def role(self) -> bytes:
        return self._head + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'

    def content(self, text: str) -> bytes:
        return self._content_prefix + _json(text) + b'},"finish_reason":null}]}\n\n'

    def content_with_logprobs(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        return (
            self._content_prefix + _json(text) + b'},"logprobs":{"content":' + _json(logprobs)
            + b'},"finish_reason":null}]}\n\n'
        )  # fmt: skip

    def finish(self, reason: str) -> bytes:
        return self._head + b'[{"index":0,"delta":{},"finish_reason":"' + reason.encode() + b'"}]}\n\n'

    def usage(self, prompt: int, completion: int, cached: int) -> bytes:
        return self._head + b'[],"usage":' + _usage(prompt, completion, cached) + b"}\n\n"

    def tool_call(self, call_id: str, name: str, arguments: str) -> bytes:
        """A tool call as OpenAI streams one: a delta naming it, then its arguments."""
        head = {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        args = {"index": 0, "function": {"arguments": arguments}}
        return b"".join(
            self._head + b'[{"index":0,"delta":{"tool_calls":[' + _json(part) + b']},"finish_reason":null}]}\n\n'
            for part in (head, args)
        )


class CompletionChunks:
    """Event bytes for one streamed text completion."""

    __slots__ = ("_head", "_text_prefix")

    def __init__(self, response_id: str, created: int, model: str) -> None:
        self._head = _head("text_completion", response_id, created, model)
        self._text_prefix = self._head + b'[{"index":0,"text":'

    def role(self) -> bytes | None:
        return None

    def content(self, text: str) -> bytes:
        return self._text_prefix + _json(text) + b',"logprobs":null,"finish_reason":null}]}\n\n'

    def content_with_logprobs(self, text: str, logprobs: dict[str, Any]) -> bytes:
        return self._text_prefix + _json(text) + b',"logprobs":' + _json(logprobs) + b',"finish_reason":null}]}\n\n'

    def finish(self, reason: str) -> bytes:
        return self._text_prefix + b'"","logprobs":null,"finish_reason":"' + reason.encode() + b'"}]}\n\n'

    def usage(self, prompt: int, completion: int, cached: int) -> bytes:
        return self._head + b'[],"usage":' + _usage(prompt, completion, cached) + b"}\n\n"


class _Live:
    """A stream the keep-alive task may write a comment to."""

    __slots__ = ("send", "last", "open")

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self.send = send
        self.last = time.monotonic()
        self.open = True


class KeepAlive:
    """Sends ``: keep-alive`` on streams idle for ``interval`` seconds (one task)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._streams: set[_Live] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def register(self, send: Callable[[bytes], None]) -> _Live:
        live = _Live(send)
        self._streams.add(live)
        return live

    def unregister(self, live: _Live) -> None:
        live.open = False
        self._streams.discard(live)

    async def _run(self) -> None:
        tick = max(self.interval / 4, 0.01)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for live in [s for s in self._streams if now - s.last >= self.interval]:
                live.last = now
                try:
                    live.send(_KEEPALIVE)
                except (RuntimeError, OSError):
                    self._streams.discard(live)


class SSEResponse:
    """A streaming response of pre-encoded SSE events from ``events``."""

    __slots__ = ("headers", "events", "ctx", "keepalive", "on_disconnect", "on_close")

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        ctx: Context,
        keepalive: KeepAlive,
        on_disconnect: Callable[[], None] | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.headers = _HEADERS + headers if headers else _HEADERS
        # runs when the response is done with however it ended (``events`` may never
        # have started: an async generator that never ran has no ``finally`` to run)
        self.on_close = on_close
        self.events = events
        self.ctx = ctx
        self.keepalive = keepalive
        self.on_disconnect = on_disconnect

    async def send_to(self, out: ResponseStream) -> None:
        out.on_disconnect = self._disconnected
        if out.disconnected:  # gone before the stream started
            self._disconnected()
        out.start(200, self.headers)
        live = self.keepalive.register(out.write)
        events = self.events
        monotonic = time.monotonic
        try:
            async for event in events:
                if out.disconnected:
                    break
                live.last = monotonic()
                if event.endswith(DONE):  # the last event: with the terminator, one write
                    out.end(event)
                    continue
                out.write(event)
                if out.paused:
                    await out.drain()
        finally:
            self.keepalive.unregister(live)
            try:
                await events.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()

    def _disconnected(self) -> None:
        if self.on_disconnect is not None:
            self.on_disconnect()
        self.ctx.stop_generating()
