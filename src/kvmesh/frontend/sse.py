"""Server-sent events: writing a stream of events to the socket.

:class:`DeltaSSE` writes a request owner's delta stream as a dialect's encoder turns it
into events (:mod:`kvmesh.frontend.dialects`): the owner's generator is the only async
generator between the request plane's stream and the socket. :class:`SSEResponse`
writes pre-encoded events from any async generator (the dashboard).

Writing: the head goes out with the first event (or the first
keep-alive comment); an event is written at once unless the stream already wrote in this
loop iteration (then it goes out with the others of that iteration at the start of the
next: :class:`~kvmesh.frontend.server.ResponseStream`); the end of a stream (the encoder's bytes for ``Finish``, or for an error) + the chunked
terminator and anything still held, is one write; the
client's disconnect, a callback from the connection, stops the request's context
(which stops the engine); :class:`KeepAlive` sends ``: keep-alive`` comments on
streams that have been idle for its interval, from one task for all streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

from kvmesh.errors import KvmeshError
from kvmesh.frontend.deltas import Finish, StreamEncoder
from kvmesh.frontend.owner import RequestOwner
from kvmesh.frontend.server import ResponseStream
from kvmesh.runtime.context import Context
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = ["DeltaSSE", "SSEResponse", "KeepAlive", "DONE"]

DONE = b"data: [DONE]\n\n"
_KEEPALIVE = b": keep-alive\n\n"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


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


class _SSE:
    """What every event stream does: the head, keep-alives, and the client's disconnect
    stopping the request's context."""

    __slots__ = ("headers", "ctx", "keepalive", "on_disconnect")

    def __init__(self, ctx: Context, keepalive: KeepAlive, on_disconnect: Callable[[], None] | None,
                 headers: list[tuple[bytes, bytes]] | None) -> None:  # fmt: skip
        self.headers = _HEADERS + headers if headers else _HEADERS
        self.ctx = ctx
        self.keepalive = keepalive
        self.on_disconnect = on_disconnect

    def _begin(self, out: ResponseStream) -> _Live:
        """Send the head; the stream keeps alive until ``keepalive.unregister``."""
        out.on_disconnect = self._disconnected
        if out.disconnected:  # gone before the stream started
            self._disconnected()
        out.start(200, self.headers)
        return self.keepalive.register(out.write)

    def _disconnected(self) -> None:
        if self.on_disconnect is not None:
            self.on_disconnect()
        self.ctx.stop_generating()


class SSEResponse(_SSE):
    """A streaming response of pre-encoded SSE events from ``events``."""

    __slots__ = ("events", "on_close")

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        ctx: Context,
        keepalive: KeepAlive,
        on_disconnect: Callable[[], None] | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(ctx, keepalive, on_disconnect, headers)
        # runs when the response is done with however it ended (``events`` may never
        # have started: an async generator that never ran has no ``finally`` to run)
        self.on_close = on_close
        self.events = events

    async def send_to(self, out: ResponseStream) -> None:
        live = self._begin(out)
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


class DeltaSSE(_SSE):
    """A streaming response of one request: its owner's deltas, encoded by a dialect.

    The owner's ``async with`` block spans the whole response, so its booking is given
    back however the response ends, even when no delta was ever read (the client left
    before the first event). ``public`` says what a client may read of an error.
    """

    __slots__ = ("owner", "encoder", "public")

    def __init__(
        self,
        owner: RequestOwner,
        encoder: StreamEncoder,
        keepalive: KeepAlive,
        public: Callable[[BaseException, str], tuple[str, str]],
        on_disconnect: Callable[[], None] | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(owner.ctx, keepalive, on_disconnect, headers)
        self.owner = owner
        self.encoder = encoder
        self.public = public

    async def send_to(self, out: ResponseStream) -> None:
        live = self._begin(out)
        owner, encode, monotonic = self.owner, self.encoder.encode, time.monotonic
        try:
            async with owner:
                try:
                    async for delta in owner.deltas():
                        if out.disconnected:
                            break
                        live.last = monotonic()
                        data = encode(delta)
                        if type(delta) is Finish:  # the last event: with the terminator, one write
                            out.end(data)
                        elif data:
                            out.write(data)
                            if out.paused:
                                await out.drain()
                except KvmeshError as exc:
                    if not owner.ctx.is_stopped():
                        message, kind = self.public(exc, owner.request.request_id)
                        out.end(self.encoder.error(message, kind, exc.status))
        finally:
            self.keepalive.unregister(live)
