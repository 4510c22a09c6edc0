"""The TCP request plane, worker side: serve endpoints to many callers, many streams
per connection.

An endpoint handler is ``handler(payload: bytes-like, ctx) -> AsyncIterator[Struct]``;
each item goes back as one ``Out`` frame, the end of the iterator as ``End``, a raised
KvmeshError as ``Err`` with its type. Frames are written one loop iteration after the
iteration that produced them, with one syscall for all of them (``FrameWriter``
with ``coalesce``: an engine's back-to-back steps share a write); a stream's first
item (the first token) goes out in the iteration that produced it.

Cancellation: a ``Ctl`` STOP frame calls ``ctx.stop_generating()``, KILL calls
``ctx.kill()``; a dropped connection kills every stream it carried.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from kvmesh.errors import EngineShutdown, InvalidArgument, KvmeshError
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import KILL, STOP, Ack, Ctl, End, Err, FrameReader, FrameWriter, OutItem, Req
from kvmesh.runtime.sockets import tune_stream_socket

__all__ = ["Handler", "TcpServer"]

log = logging.getLogger(__name__)

Handler = Callable[[memoryview | bytes, Context], AsyncIterator[Any]]


class _Conn(asyncio.Protocol):
    def __init__(self, server: TcpServer) -> None:
        self._server = server
        self._reader = FrameReader(server.max_frame_bytes)
        self._writer = FrameWriter(coalesce=True)
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, Context] = {}
        self._paused: asyncio.Future[None] | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._writer.transport = transport  # type: ignore[assignment]
        tune_stream_socket(transport.get_extra_info("socket"))
        self._server._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._conns.discard(self)
        self._transport = None
        self._writer.transport = None
        for ctx in list(self._streams.values()):
            ctx.kill()
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    def pause_writing(self) -> None:
        if self._paused is None:
            self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None:
            if not self._paused.done():
                self._paused.set_result(None)
            self._paused = None

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except InvalidArgument as exc:
            log.warning("closing connection: %s", exc.message)
            self._send(Err(0, exc.kind, exc.message))
            self._writer.flush()
            if self._transport is not None:
                self._transport.close()
            return
        for frame in frames:
            if type(frame) is Req:
                self._open(frame)
            elif type(frame) is Ctl:
                self._control(frame)
            else:
                log.warning("ignoring unexpected frame %s from a caller", type(frame).__name__)

    # -- streams
    def _open(self, req: Req) -> None:
        if req.sid in self._streams:
            self._send(Err(req.sid, InvalidArgument.kind, f"stream id {req.sid} is already open"))
            return
        if self._server.draining:
            self._send(Err(req.sid, EngineShutdown.kind, "this worker is draining; send the request to another worker"))
            return
        handler = self._server.endpoints.get(req.endpoint)
        if handler is None:
            known = ", ".join(sorted(self._server.endpoints)) or "none"
            self._send(Err(req.sid, InvalidArgument.kind, f"unknown endpoint {req.endpoint!r} (known: {known})"))
            return
        ctx = Context(f"{id(self):x}-{req.sid}")
        self._streams[req.sid] = ctx
        self._server._spawn(self._serve(req.sid, handler, req.payload, ctx))

    def _control(self, ctl: Ctl) -> None:
        ctx = self._streams.get(ctl.sid)
        if ctx is None:
            return
        if ctl.action == KILL:
            ctx.kill()
        elif ctl.action == STOP:
            ctx.stop_generating()

    async def _serve(self, sid: int, handler: Handler, payload: msgspec.Raw, ctx: Context) -> None:
        self._send(Ack(sid))
        stream = handler(payload, ctx)
        first = True  # a stream's first item goes out without waiting for company
        try:
            async for item in stream:
                if self._transport is None:
                    break
                self._writer.send(OutItem(sid, item), first)
                first = False
                if self._paused is not None:
                    await self._paused
            else:
                self._send(End(sid))
        except KvmeshError as exc:
            self._send(Err(sid, exc.kind, exc.message))
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            log.exception("endpoint handler failed")
            self._send(Err(sid, "unknown", f"{type(exc).__name__}: {exc}"))
        finally:
            self._streams.pop(sid, None)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    # -- writing
    def _send(self, frame: Any) -> None:
        if self._transport is not None:
            self._writer.send(frame)

    def close(self) -> None:
        """Close after writing every frame already queued (a last ``End`` or ``Err``)."""
        if self._transport is not None:
            self._writer.flush()
            self._transport.close()

    @property
    def open_streams(self) -> int:
        return len(self._streams)


class TcpServer:
    """Listens on ``host:port`` (0 = any free port) and serves registered endpoints."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_frame_bytes: int = 64 * 1024 * 1024) -> None:
        self.host = host
        self.port = port
        self.max_frame_bytes = max_frame_bytes
        self.endpoints: dict[str, Handler] = {}
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.started = False
        self.draining = False

    def register(self, endpoint: str, handler: Handler) -> None:
        self.endpoints[endpoint] = handler

    async def start(self, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(lambda: _Conn(self), sock=sock)
        else:
            self._server = await loop.create_server(lambda: _Conn(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.started = True

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop_accepting(self) -> None:
        """Drain: close the listening socket and refuse new streams (``EngineShutdown``,
        which callers retry elsewhere); streams already open keep going."""
        self.draining = True
        if self._server is not None:
            self._server.close()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no stream is in flight; False if the timeout passed first."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._tasks:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=remaining)
        return True

    async def close(self) -> None:
        await self.stop_accepting()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in list(self._conns):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
