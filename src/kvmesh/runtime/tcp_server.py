"""The TCP request plane, worker side: serve endpoints to many callers, many streams
per connection.

An endpoint handler is ``handler(payload: bytes-like, ctx) -> AsyncIterator[Struct]``;
each item goes back as one ``Out`` frame, the end of the iterator as ``End``, a raised
KvmeshError as ``Err`` with its type. Frames are written a few loop iterations after
the iteration that produced them (at most ``frames.COALESCE_ROUNDS``, and not much past
``COALESCE_MAX_S``), with one syscall for all of them (``FrameWriter`` with
``coalesce``: a busy engine's back-to-back steps share a write, and a caller's stream
one wake-up for them); a stream's first item (the first token) goes out in the
iteration that produced it. A stream of a ``merging`` endpoint (``StreamServer.merging``:
its source merges what accumulates unread, like an engine's mailbox) is read again only
as the window that holds its last item closes, just before the write: what it made
meanwhile goes out as one item in that write (``FrameWriter.window``), not one per step.

Cancellation: a ``Ctl`` STOP frame calls ``ctx.stop_generating()``, KILL calls
``ctx.kill()``; a dropped connection kills every stream it carried.

Trust: with a cluster secret (:mod:`kvmesh.runtime.auth`) a connection serves nothing
until the caller has passed the handshake, and then (without TLS) only frames in
records that pass their check: an altered or injected byte closes the connection,
killing its streams. Stream ids live in the connection that
opened them: a frame naming another connection's stream reaches nothing (counted in
``TcpServer.foreign_frames``). At most ``max_streams`` streams are open per connection
and a caller's frame is at most ``max_frame_bytes`` (see :mod:`kvmesh.runtime.frames`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from kvmesh.errors import EngineShutdown, InvalidArgument, KvmeshError, ResourceExhausted
from kvmesh.runtime import auth
from kvmesh.runtime.auth import HANDSHAKE_TIMEOUT_S, AuthError, ClusterSecret, Handshake, ProtocolHandshake, TlsContexts
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import (
    KILL,
    STOP,
    Ack,
    Ctl,
    End,
    Err,
    OutItem,
    Req,
)
from kvmesh.runtime.stream import FramedConnection, Handler, StreamHost, StreamServer

__all__ = ["Handler", "TcpServer", "ServerConnection"]

log = logging.getLogger(__name__)

class _Conn(FramedConnection):
    """One caller's connection (accepted, or dialled out by the NATS plane's call-home:
    ``client=True`` then plays the client side of the handshake)."""

    def __init__(self, server: StreamHost, client: bool = False) -> None:
        super().__init__(server.max_frame_bytes, coalesce=True)
        self._server = server
        self._streams: dict[int, Context] = {}
        self._paused: asyncio.Future[None] | None = None
        self._client = client
        self._first = True  # nothing received yet
        self.gate: ProtocolHandshake | None = None  # the handshake, kept for its ``ready``

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._server._conns.add(self)
        secret: ClusterSecret | None = self._server.secret
        if secret is not None:
            what = "caller" if not self._client else "call-home server"
            hs = Handshake(secret, self._server.channel, self._client, f"{what} {self.peer}")
            self.auth = self.gate = ProtocolHandshake(hs, transport, self._server.handshake_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._server._conns.discard(self)
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
        if self._first:
            self._first = False
            if self.auth is None:
                if self._refuse_unexpected(data):
                    return
            elif not self._client and not auth.looks_like_handshake(data):
                # A caller without the secret reads frames: tell it why, in one it understands.
                self._send(Err(0, InvalidArgument.kind, "this worker requires the fleet's cluster secret (--cluster-secret-file)"))
                self._writer.flush()
        frames = self.admitted_frames(data)
        if isinstance(frames, InvalidArgument):
            log.warning("closing connection from %s: %s", self.peer, frames.message)
            if not isinstance(frames, AuthError):  # a caller's bug: tell it; tampering: just close
                self._send(Err(0, frames.kind, frames.message))
                self._writer.flush()
            if self.transport is not None:
                self.transport.close()
            return
        for frame in frames:
            if type(frame) is Req:
                self._open(frame)
            elif type(frame) is Ctl:
                self._control(frame)
            elif type(frame) is Err and frame.sid == 0:
                log.warning("%s refused this connection: %s", self.peer, frame.message)
            else:
                log.warning("ignoring unexpected frame %s from a caller", type(frame).__name__)

    def _refuse_unexpected(self, data: bytes) -> bool:
        """A peer speaking a layer this process lacks (a handshake, TLS): one clear line."""
        if self._server.secret is None and auth.looks_like_handshake(data):
            why = "it sent a cluster-secret handshake but this process has no cluster secret (set --cluster-secret-file)"
        elif self._server.tls is None and auth.looks_like_tls(data):
            why = "it speaks TLS but this process has no --tls-cert/--tls-key/--tls-ca"
        else:
            return False
        log.warning("refusing connection from %s: %s", self.peer, why)
        if self.transport is not None:
            self.transport.close()
        return True

    # -- streams
    def _open(self, req: Req) -> None:
        if req.sid in self._streams:
            self._send(Err(req.sid, InvalidArgument.kind, f"stream id {req.sid} is already open"))
            return
        if len(self._streams) >= self._server.max_streams:
            self._send(Err(req.sid, ResourceExhausted.kind, f"over {self._server.max_streams} streams open on one connection"))
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
        self._server.tasks.spawn(self._serve(req.sid, handler, req.payload, ctx, req.endpoint in self._server.merging))

    def _control(self, ctl: Ctl) -> None:
        ctx = self._streams.get(ctl.sid)
        if ctx is None:
            # not open on this connection (ended, or another connection's id)
            self._server.foreign_frames += 1
            return
        if ctl.action == KILL:
            ctx.kill()
        elif ctl.action == STOP:
            ctx.stop_generating()

    async def _serve(self, sid: int, handler: Handler, payload: msgspec.Raw, ctx: Context, merging: bool = False) -> None:
        self._send(Ack(sid))
        stream: AsyncIterator[object] | None = None
        first = True  # a stream's first item goes out without waiting for company
        writer = self._writer
        try:
            stream = handler(payload, ctx)  # a handler that raises here reports like its stream would
            async for item in stream:
                if self.transport is None:
                    break
                writer.send(OutItem(sid, item), first)
                first = False
                if self._paused is not None:
                    await self._paused
                elif merging and (window := writer.window()) is not None:
                    await window  # what the stream makes meanwhile is read as one item, into this write
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
        if self.transport is not None:
            self._writer.send(frame)

    def close(self) -> None:
        """Close after writing every frame already queued (a last ``End`` or ``Err``)."""
        if self.transport is not None:
            self._writer.flush()
            self.transport.close()

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- for the NATS plane's call-home (runtime/nats/server.py)
    @property
    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def gone(self) -> bool:
        return self.transport is None

    def serve(self, req: Req) -> None:
        """Open the stream ``req`` asks for (Ack, then its handler in a task)."""
        self._open(req)


# The worker side of a stream connection: accepted here, dialled out by the NATS plane.
ServerConnection = _Conn


class TcpServer(StreamServer):
    """Listens on ``host:port`` (0 = any free port) and serves registered endpoints."""

    channel = "request"  # what the handshake binds a connection to

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
        tls: TlsContexts | None | auth._FromEnv = auth.FROM_ENV,
    ) -> None:
        super().__init__(secret, tls)
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self.started = False

    def register(self, endpoint: str, handler: Handler) -> None:
        self.endpoints[endpoint] = handler

    async def start(self, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        tls = self.tls.server if self.tls is not None else None
        timeout = HANDSHAKE_TIMEOUT_S if tls is not None else None
        if sock is not None:
            self._server = await loop.create_server(lambda: _Conn(self), sock=sock, ssl=tls, ssl_handshake_timeout=timeout)
        else:
            self._server = await loop.create_server(lambda: _Conn(self), self.host, self.port, ssl=tls, ssl_handshake_timeout=timeout)
        self.port = self._server.sockets[0].getsockname()[1]
        self.started = True

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop_accepting(self) -> None:
        """Drain: close the listening socket and refuse new streams (``EngineShutdown``,
        which callers retry elsewhere); streams already open keep going."""
        self.draining = True
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        await self.stop_accepting()
        await self.tasks.cancel_all()
        for conn in list(self._conns):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
