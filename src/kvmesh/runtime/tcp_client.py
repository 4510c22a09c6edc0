"""The TCP request plane, caller side.

One :class:`TcpClient` per worker address keeps one connection and multiplexes any
number of streams on it. One reader (the protocol's ``data_received``) fans frames
out to a per-stream mailbox; a mailbox given a ``merge`` function keeps at most one
pending item, merging deltas when the consumer lags, so a slow consumer never blocks
the reader and memory stays bounded by the response itself.

Failures come out of the stream as typed errors: ``CannotConnect`` /
``ConnectionTimeout`` before the request is sent, ``ResponseTimeout`` when the first
response item is late, ``Disconnected`` when the connection drops mid-stream, and the
worker's own typed errors unchanged.

With a cluster secret the connection is usable only after the mutual handshake
(:mod:`kvmesh.runtime.auth`), run once per connection within ``connect_timeout``; a
worker that cannot prove the secret is ``CannotConnect`` with the reason. Without TLS
every frame after it travels in authenticated records: data that fails its check
closes the connection (one log line) and its streams end ``Disconnected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvmesh.errors import CannotConnect, ConnectionTimeout, Disconnected, InvalidArgument, ResponseTimeout, from_wire
from kvmesh.runtime import auth
from kvmesh.runtime.auth import HANDSHAKE_TIMEOUT_S, AuthError, ClusterSecret, Handshake, ProtocolHandshake, TlsContexts
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import KILL, STOP, Ack, Ctl, End, Err, Out, Req
from kvmesh.runtime.stream import FramedConnection, Mailbox, StreamClient

__all__ = ["TcpClient"]

log = logging.getLogger(__name__)

class _Connection(FramedConnection):
    def __init__(self, address: str, secret: ClusterSecret | None = None) -> None:
        super().__init__()
        self.address = address
        self.streams: dict[int, Mailbox] = {}
        self._next_sid = 1
        self._secret = secret
        self.gate: ProtocolHandshake | None = None  # the handshake, kept for its ``ready``
        self.foreign_frames = 0  # frames for no stream open on this connection
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # set by connection_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._secret is not None:
            hs = Handshake(self._secret, "request", client=True, peer=f"worker {self.address}")
            self.auth = self.gate = ProtocolHandshake(hs, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.closed.done():
            self.closed.set_result(None)
        streams, self.streams = self.streams, {}
        for box in streams.values():
            box.finish(Disconnected(f"connection to worker {self.address} lost"))

    def data_received(self, data: bytes) -> None:
        frames = self.admitted_frames(data)
        if isinstance(frames, InvalidArgument):
            log.warning("closing connection to worker %s: %s", self.address, frames.message)
            self._fail_all(frames)
            return
        streams = self.streams
        for frame in frames:
            box = streams.get(frame.sid)
            if box is None:
                if frame.sid == 0 and type(frame) is Err:  # the worker refused the connection
                    self._refused(frame.message)
                    return
                self.foreign_frames += 1
                continue
            kind = type(frame)
            if kind is Out:
                box.put(frame.payload)
            elif kind is End:
                del streams[frame.sid]
                box.finish()
            elif kind is Err:
                del streams[frame.sid]
                box.finish(from_wire(frame.kind, frame.message))
            elif kind is Ack:
                pass

    def _refused(self, message: str) -> None:
        log.warning("worker %s refused the connection: %s", self.address, message)
        streams, self.streams = self.streams, {}
        for box in streams.values():
            box.finish(CannotConnect(f"worker {self.address} refused the connection: {message}"))
        if self.transport is not None:
            self.transport.close()

    def _fail_all(self, exc: BaseException) -> None:
        streams, self.streams = self.streams, {}
        for box in streams.values():
            box.finish(Disconnected(f"bad data from worker {self.address}: {exc}"))
        if self.transport is not None:
            self.transport.close()

    @property
    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def open(self, endpoint: str, payload: bytes, box: Mailbox) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.streams[sid] = box
        self._send(Req(sid, endpoint, msgspec.Raw(payload)))
        return sid

    def control(self, sid: int, action: int) -> None:
        self._send(Ctl(sid, action))

    def _send(self, frame: Any) -> None:
        self._writer.send(frame)


class TcpClient(StreamClient):
    """Streams requests to one worker at ``host:port``."""

    def __init__(
        self,
        address: str,
        connect_timeout: float = 5.0,
        response_timeout: float | None = None,
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
        tls: TlsContexts | None | auth._FromEnv = auth.FROM_ENV,
    ) -> None:
        self.secret = auth.resolve(secret)
        self.tls = auth.resolve_tls(tls)
        host, _, port = address.rpartition(":")
        self.address = address
        self._host = host.strip("[]")
        self._port = int(port)
        self.connect_timeout = connect_timeout
        self.response_timeout = response_timeout
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._close_when_idle = False

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        secret = self.secret
        tls = self.tls.client if self.tls is not None else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self.address, secret), self._host, self._port, ssl=tls,
                    server_hostname=self._host if tls else None, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls else None,
                ),
                self.connect_timeout,
            )
        except TimeoutError:
            raise ConnectionTimeout(f"connecting to worker {self.address} took over {self.connect_timeout} s") from None
        except OSError as exc:
            raise CannotConnect(f"cannot connect to worker {self.address}: {exc.strerror or exc}") from None
        if conn.gate is not None:
            try:
                await asyncio.wait_for(asyncio.shield(conn.gate.ready), self.connect_timeout)
            except BaseException as exc:
                await _closed(conn)
                if isinstance(exc, TimeoutError):
                    raise ConnectionTimeout(
                        f"worker {self.address} did not finish the cluster-secret handshake within {self.connect_timeout} s"
                    ) from None
                if isinstance(exc, AuthError):
                    raise CannotConnect(f"cannot connect to worker {self.address}: {exc.message}") from None
                raise
        self._conn = conn
        return conn

    async def _open(
        self, endpoint: str, payload: bytes, ctx: Context, box: Mailbox
    ) -> Callable[[], Awaitable[None] | None]:
        conn = await self._connection()
        sid = conn.open(endpoint, payload, box)
        if self.response_timeout is not None:
            box.timer = asyncio.get_running_loop().call_later(
                self.response_timeout, self._timed_out, conn, sid, box
            )
        ctx.on_stop(lambda c: self._on_stop(conn, sid, box, c))

        def done() -> Awaitable[None] | None:
            if not box.ended:
                box.finish()
                if conn.streams.pop(sid, None) is not None:
                    conn.control(sid, KILL)
            return self.close() if self._close_when_idle and not conn.streams else None

        return done

    @staticmethod
    def _on_stop(conn: _Connection, sid: int, box: Mailbox, ctx: Context) -> None:
        if box.ended:
            return
        conn.control(sid, KILL if ctx.is_killed() else STOP)

    def _timed_out(self, conn: _Connection, sid: int, box: Mailbox) -> None:
        box.timer = None
        if box.answered or box.ended:
            return
        if conn.streams.pop(sid, None) is not None:
            conn.control(sid, KILL)
        box.finish(ResponseTimeout(f"worker {self.address} sent no response within {self.response_timeout} s"))

    @property
    def open_streams(self) -> int:
        return len(self._conn.streams) if self._conn is not None else 0

    async def close_when_idle(self) -> None:
        """Close once the streams now open have ended (a worker that left discovery
        finishes what it serves); at once if none is open."""
        self._close_when_idle = True
        if self.open_streams == 0:
            await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()


async def _closed(conn: _Connection) -> None:
    """Close a connection that failed its handshake and wait (briefly) until its
    socket is closed, so that a refused caller leaves nothing open behind it."""
    if conn.transport is not None:
        conn.transport.abort()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(conn.closed), 1.0)
