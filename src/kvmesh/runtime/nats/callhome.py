"""The caller's call-home listener: workers stream responses to it over TCP.

Stream ids are random 63-bit numbers drawn here, and a stream is bound to the
call-home connection whose ``Ack`` claimed it first; ``Out``, ``End`` and ``Err``
frames for it from any other connection are dropped and counted
(``CallHomeServer.foreign_frames``). With a cluster secret a call-home connection
starts with the mutual handshake (channel ``callhome``), and its frames then travel in
authenticated records (without TLS): one that fails its check closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from kvmesh.errors import Disconnected, InvalidArgument, from_wire
from kvmesh.runtime import auth
from kvmesh.runtime.auth import HANDSHAKE_TIMEOUT_S, ClusterSecret, Handshake, ProtocolHandshake, TlsContexts
from kvmesh.runtime.frames import KILL, MAX_FRAME_BYTES, Ack, Ctl, End, Err, Out
from kvmesh.runtime.stream import FramedConnection, Mailbox
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = ["CallHomeServer", "CallHomeStream"]

log = logging.getLogger("kvmesh.runtime.nats")


class CallHomeStream:
    """One stream as the call-home server sees it; ``conn`` is set by the worker's Ack."""

    __slots__ = ("sid", "box", "conn", "pending", "ack_timer")

    def __init__(self, sid: int, box: Mailbox) -> None:
        self.sid = sid
        self.box = box
        self.conn: _HomeConn | None = None
        self.pending = 0  # a STOP/KILL asked for before the worker called home
        self.ack_timer: asyncio.TimerHandle | None = None


class _HomeConn(FramedConnection):
    """One worker's call-home connection: routes its frames to the streams it carries."""

    def __init__(self, home: CallHomeServer) -> None:
        super().__init__(home.max_frame_bytes)
        self._home = home
        self.sids: set[int] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._home._conns.add(self)
        if self._home.secret is not None:
            hs = Handshake(self._home.secret, "callhome", client=False, peer=f"worker {self.peer}")
            self.auth = ProtocolHandshake(hs, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._home._conns.discard(self)
        sids, self.sids = self.sids, set()
        for sid in sids:
            self._home._end(sid, Disconnected(f"call-home connection from worker {self.peer} lost"))

    def data_received(self, data: bytes) -> None:
        frames = self.admitted_frames(data)
        if isinstance(frames, InvalidArgument):
            log.warning("closing call-home connection from %s: %s", self.peer, frames.message)
            if self.transport is not None:
                self.transport.close()  # connection_lost ends its streams
            return
        home = self._home
        streams = home.streams
        for frame in frames:
            kind = type(frame)
            if kind is Ack:
                home._bind(frame.sid, self)
                continue
            stream = streams.get(frame.sid)
            if stream is None:
                continue  # ended here already (the caller left, or timed out)
            if stream.conn is not self:
                home.foreign_frames += 1  # another connection's stream, or not yet acknowledged
                continue
            if kind is Out:
                stream.box.put(frame.payload)
            elif kind is End:
                self.sids.discard(frame.sid)
                home._end(frame.sid, None)
            elif kind is Err:
                self.sids.discard(frame.sid)
                home._end(frame.sid, from_wire(frame.kind, frame.message))

    def control(self, sid: int, action: int) -> None:
        if self.transport is not None:
            self._writer.send(Ctl(sid, action))


class CallHomeServer:
    """The caller's TCP listener that workers stream responses to; one per process,
    shared by every :class:`NatsRequestClient` of that process.

    Stream ids are allocated here, so they are unique per call-home address (the key a
    worker multiplexes its connection by). ``advertise_host`` is the host workers dial
    when ``host`` is a wildcard address.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
        tls: TlsContexts | None | auth._FromEnv = auth.FROM_ENV,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = auth.resolve_tls(tls)
        self.advertise_host = advertise_host or host
        self.max_frame_bytes = max_frame_bytes
        self.secret = auth.resolve(secret)
        self.streams: dict[int, CallHomeStream] = {}
        self.foreign_frames = 0  # frames for a stream bound to another connection (or to none yet)
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Task[None] | None = None
        self._conns: set[_HomeConn] = set()

    async def start(self) -> None:
        """Listen; idempotent, concurrent callers share one start."""
        if self._server is not None:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._listen())
        try:
            await asyncio.shield(self._starting)
        finally:
            if self._starting is not None and self._starting.done():
                self._starting = None

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        tls = self.tls.server if self.tls is not None else None
        timeout = HANDSHAKE_TIMEOUT_S if tls is not None else None
        server = await loop.create_server(lambda: _HomeConn(self), self.host, self.port, ssl=tls, ssl_handshake_timeout=timeout)
        self.port = server.sockets[0].getsockname()[1]
        self._server = server

    @property
    def address(self) -> str:
        host = self.advertise_host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def open_streams(self) -> int:
        return len(self.streams)

    # -- streams (called by NatsRequestClient and _HomeConn)
    def open(self, box: Mailbox) -> CallHomeStream:
        # Random, so that nobody can guess the ids of other callers' streams.
        sid = secrets.randbits(63)
        while sid == 0 or sid in self.streams:
            sid = secrets.randbits(63)
        stream = CallHomeStream(sid, box)
        self.streams[stream.sid] = stream
        return stream

    def rekey(self, stream: CallHomeStream) -> None:
        """Give an unanswered stream a new id before its request is sent again: a late
        Ack for the old id finds no stream and is killed (see _bind), so a request
        sent twice is served once."""
        self.streams.pop(stream.sid, None)
        fresh = self.open(stream.box)
        stream.sid = fresh.sid
        self.streams[stream.sid] = stream

    def _bind(self, sid: int, conn: _HomeConn) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            # The caller already left (or timed out): end the worker's stream too.
            conn.control(sid, KILL)
            return
        if stream.conn is not None:
            if stream.conn is not conn:
                self.foreign_frames += 1  # claimed by another connection first
            return
        stream.conn = conn
        conn.sids.add(sid)
        if stream.ack_timer is not None:
            stream.ack_timer.cancel()
            stream.ack_timer = None
        if stream.pending:
            conn.control(sid, stream.pending)

    def _end(self, sid: int, error: BaseException | None) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None:
            self._disarm(stream)
            stream.box.finish(error)

    def control(self, stream: CallHomeStream, action: int) -> None:
        if stream.box.ended:
            return
        if stream.conn is not None:
            stream.conn.control(stream.sid, action)
        else:
            stream.pending = max(stream.pending, action)

    def abandon(self, stream: CallHomeStream, error: BaseException | None = None) -> None:
        """The caller is done with a live stream: kill it on the worker and forget it."""
        if self.streams.pop(stream.sid, None) is None:
            return
        self._disarm(stream)
        if stream.conn is not None:
            stream.conn.sids.discard(stream.sid)
            stream.conn.control(stream.sid, KILL)
        # an unbound stream is killed when (if) its worker's Ack arrives: see _bind
        stream.box.finish(error)

    @staticmethod
    def _disarm(stream: CallHomeStream) -> None:
        if stream.ack_timer is not None:
            stream.ack_timer.cancel()
            stream.ack_timer = None

    async def close(self) -> None:
        """Stop listening and drop every connection; open streams end as Disconnected."""
        starting, self._starting = self._starting, None
        await cancel_and_wait(starting)
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.close()
        for sid in list(self.streams):
            self._end(sid, Disconnected("the call-home server closed"))
        if server is not None:
            await server.wait_closed()
