"""What the request planes (TCP, NATS) share: the seams and the stream transport.

Seams (``typing.Protocol``; :class:`~kvmesh.runtime.tcp_client.TcpClient` and
:class:`~kvmesh.runtime.nats.NatsRequestClient` are both a :class:`RequestClient`,
:class:`~kvmesh.runtime.tcp_server.TcpServer` and
:class:`~kvmesh.runtime.nats.NatsRequestServer` both a :class:`RequestServer`):

- :data:`Handler`: an endpoint, ``handler(payload, ctx) -> AsyncIterator[item]``;
- :class:`RequestServer`: serves handlers (register, start, drain, close);
- :class:`RequestClient`: streams one request's response items, decoded by the
  caller's ``decode`` (raw msgpack without one), merged by ``merge`` when the
  consumer lags;
- :class:`StreamHost`: what the worker-side connection protocol reads from the
  server it serves for (the TCP server, or the NATS server's call-home dialler).

Transport: :class:`Mailbox`, a stream's slot between the connection's reader and
the consumer (bounded by ``merge``), and :data:`END`, what it yields at the end;
:class:`FramedConnection`, what every request-plane connection (the worker's, the
caller's, the call-home listener's) does alike: socket options, the handshake while it
runs, then (with a cluster secret, without TLS) sealed frames (tag frames in the
stream), frames in and out.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar, cast, overload

import msgspec

from kvmesh.errors import InvalidArgument
from kvmesh.runtime import auth
from kvmesh.runtime.auth import ClusterSecret, ProtocolHandshake, TlsContexts
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import MAX_FRAME_BYTES, MAX_REQUEST_FRAME, MAX_STREAMS, FrameReader, FrameWriter
from kvmesh.runtime.sockets import tune_stream_socket

__all__ = ["Handler", "RequestServer", "RequestClient", "StreamHost", "Mailbox", "END", "Decode", "Merge", "FramedConnection", "StreamTasks", "StreamServer", "StreamClient",
           "OpenStream"]  # fmt: skip

T = TypeVar("T")

# An endpoint: the request's msgpack payload and its context in, response items out
# (each one a msgspec-encodable value).
Handler = Callable[[bytes, Context], AsyncIterator[object]]
Decode = Callable[[msgspec.Raw], Any]  # a response item's msgpack → the caller's value
Merge = Callable[[Any, Any], Any]  # two pending items → one (a lagging consumer)


class RequestServer(Protocol):
    """The worker side of a request plane."""

    def register(self, endpoint: str, handler: Handler) -> None: ...
    async def start(self) -> None: ...
    async def stop_accepting(self) -> None: ...
    async def wait_idle(self, timeout: float) -> bool: ...
    async def close(self) -> None: ...

    @property
    def in_flight(self) -> int: ...


class RequestClient(Protocol):
    """The caller side of a request plane, bound to one worker instance."""

    @overload
    def stream(self, endpoint: str, payload: bytes, ctx: Context) -> AsyncGenerator[msgspec.Raw, None]: ...
    @overload
    def stream(
        self,
        endpoint: str,
        payload: bytes,
        ctx: Context,
        decode: Callable[[msgspec.Raw], T],
        merge: Callable[[T, T], T] | None = None,
    ) -> AsyncGenerator[T, None]: ...
    async def open_stream(self, endpoint: str, payload: bytes, ctx: Context, decode: Decode | None = None,
                          merge: Merge | None = None) -> OpenStream: ...  # fmt: skip
    async def close(self) -> None: ...


class StreamHost(Protocol):
    """What a worker-side connection (``tcp_server.ServerConnection``) reads from the
    server it serves streams for."""

    endpoints: dict[str, Handler]
    merging: set[str]  # endpoints whose streams merge what accumulates unread (FrameWriter.window)
    max_frame_bytes: int
    max_streams: int
    secret: ClusterSecret | None
    tls: TlsContexts | None
    channel: str  # what the handshake binds a connection to
    handshake_timeout_s: float
    foreign_frames: int
    draining: bool
    _conns: set[Any]  # the server's open connections (kept by the connections themselves)
    tasks: StreamTasks  # the tasks serving its streams


class _End:
    """The type of :data:`END`."""

    __slots__ = ()


END = _End()  # what Mailbox.next returns once the stream has ended without an error


class Mailbox:
    """One stream's response items between the connection's reader and its consumer.

    The reader ``put``s raw items (decoded here); with ``merge`` at most one item waits,
    pending items merged into it, so a slow consumer never holds more than the
    response itself. ``timer`` (the first-item deadline) is cancelled by the first item.
    """

    __slots__ = ("items", "error", "ended", "waiter", "timer", "decode", "merge", "answered")

    def __init__(self, decode: Decode | None, merge: Merge | None) -> None:
        self.items: deque[Any] = deque()
        self.error: BaseException | None = None
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.decode = decode
        self.merge = merge
        self.answered = False

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _answered(self) -> None:
        self.answered = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def put(self, payload: msgspec.Raw) -> None:
        if not self.answered:
            self._answered()
        item = self.decode(payload) if self.decode is not None else payload
        if self.merge is not None and self.items:
            self.items[-1] = self.merge(self.items[-1], item)
        else:
            self.items.append(item)
        self._wake()

    def finish(self, error: BaseException | None = None) -> None:
        if self.ended:
            return
        self._answered()
        self.ended = True
        self.error = error
        self._wake()

    async def next(self) -> Any:
        """The next item, or :data:`END`; raises the stream's error."""
        while True:
            if self.items:
                return self.items.popleft()
            if self.ended:
                if self.error is not None:
                    raise self.error
                return END
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None


class FramedConnection(asyncio.Protocol):
    """An ``asyncio.Protocol`` carrying request-plane frames (:mod:`kvmesh.runtime.frames`).

    A subclass starts its handshake in ``connection_made`` (setting ``auth``, after
    calling this class's), ends its streams in ``connection_lost`` (likewise), and reads
    ``data_received`` through :meth:`admitted_frames`. Once the handshake is done, a
    connection that is not TLS seals what it writes (:meth:`FrameWriter.seal`) and reads
    through a :class:`~kvmesh.runtime.frames.SealedFrameReader`; a tag that fails its
    check is an error like a malformed frame (the caller closes)."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES, *, coalesce: bool = False) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.auth: ProtocolHandshake | None = None  # set while the handshake runs
        self._reader = FrameReader(max_frame_bytes)
        self._writer = FrameWriter(coalesce=coalesce)
        self._tls = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's transport
        self._writer.transport = self.transport
        self._tls = transport.get_extra_info("ssl_object") is not None
        tune_stream_socket(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"

    def connection_lost(self, exc: Exception | None) -> None:
        if self.auth is not None:
            self.auth.lost()
        self.transport = None
        self._writer.transport = None

    def admitted_frames(self, data: bytes) -> list[Any] | InvalidArgument:
        """The frames ``data`` completes once past the handshake (none while it runs),
        or the error of bytes that break the protocol (the caller closes the connection).
        Any: the caller dispatches on ``type(frame)``, which mypy does not follow."""
        if self.auth is not None:
            gate = self.auth
            data, self.auth = gate.admit(data)
            if self.auth is None:
                self._seal(gate)
            if not data:
                return []
        try:
            return self._reader.feed(data)
        except InvalidArgument as exc:  # AuthError included: a tag that failed its check
            return exc

    def _seal(self, gate: ProtocolHandshake) -> None:
        """The handshake is done: from now on both directions are sealed under keys from
        it (TLS authenticates its bytes itself)."""
        if self._tls:
            return
        send, recv = gate.keys()
        self._writer.seal(send)
        self._reader = self._reader.sealed(recv)


class StreamTasks:
    """The tasks serving a request server's streams: owned (a strong reference each),
    counted (``len``: the streams in flight), waited for when draining."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no stream is in flight; False if the timeout passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._tasks:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=remaining)
        return True

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class StreamServer:
    """What both request servers (TCP, NATS) keep alike: the :class:`StreamHost` state
    their connections read (limits, credentials, endpoints) and the tasks of their streams.
    ``secret`` and ``tls`` left at :data:`~kvmesh.runtime.auth.FROM_ENV` are the process's;
    the limits are the wire's (:mod:`kvmesh.runtime.frames`), lowered per instance in tests."""

    max_frame_bytes: int = MAX_REQUEST_FRAME  # the largest frame a caller may send
    max_streams: int = MAX_STREAMS  # streams open at once on one connection

    def __init__(self, secret: ClusterSecret | None | auth._FromEnv, tls: TlsContexts | None | auth._FromEnv) -> None:
        self.secret = auth.resolve(secret)
        self.tls = auth.resolve_tls(tls)
        self.handshake_timeout_s = auth.HANDSHAKE_TIMEOUT_S  # a caller that has not proven itself by then is dropped
        self.foreign_frames = 0  # control frames naming no stream of their connection
        self.endpoints: dict[str, Handler] = {}
        # endpoints whose streams merge what accumulates while they are not read (an
        # engine's mailbox): their next item is read as the connection's write window
        # closes, so a window's tokens travel as one item (FrameWriter.window)
        self.merging: set[str] = set()
        self.draining = False  # no new streams; those open keep going
        self.tasks = StreamTasks()

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no stream is in flight; False if the timeout passed first."""
        return await self.tasks.wait_idle(timeout)


class OpenStream:
    """One stream read without a generator of its own (the frontend's per-chunk path,
    issue 36): ``await next()`` gives each item, then :data:`END` (or raises the
    stream's error); ``close()`` once the caller is done, however it ended (a stream
    left before its end is killed)."""

    __slots__ = ("next", "_done")

    def __init__(self, box: Mailbox, done: Callable[[], Awaitable[None] | None]) -> None:
        self.next = box.next
        self._done: Callable[[], Awaitable[None] | None] | None = done

    async def close(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            more = done()
            if more is not None:
                await more


class StreamClient:
    """What both request clients (TCP, NATS) do alike: a :class:`Mailbox` per stream,
    its items yielded until :data:`END` (or read through an :class:`OpenStream`). A
    plane implements :meth:`_open`."""

    async def open_stream(self, endpoint: str, payload: bytes, ctx: Context, decode: Decode | None = None,
                          merge: Merge | None = None) -> OpenStream:  # fmt: skip
        """Send one request (as :meth:`stream` does); its items through the handle."""
        box = Mailbox(decode, merge)
        return OpenStream(box, await self._open(endpoint, payload, ctx, box))

    async def stream(
        self,
        endpoint: str,
        payload: bytes,
        ctx: Context,
        decode: Decode | None = None,
        merge: Merge | None = None,
    ) -> AsyncGenerator[Any, None]:
        """Send one request; yield the decoded response items until the stream ends.

        Stopping ``ctx`` sends STOP (or KILL) to the worker; the stream then ends with
        whatever the worker sends last. Leaving the iteration early kills the stream.
        """
        box = Mailbox(decode, merge)
        done = await self._open(endpoint, payload, ctx, box)
        try:
            while True:
                item = await box.next()
                if item is END:
                    return
                yield item
        finally:
            more = done()
            if more is not None:
                await more

    async def _open(
        self, endpoint: str, payload: bytes, ctx: Context, box: Mailbox
    ) -> Callable[[], Awaitable[None] | None]:
        """Send the request, its items to go into ``box``, and stop it when ``ctx``
        stops; returns what to call once the caller is done with the stream (at its end,
        or when it leaves early: then the stream is killed), which may return something
        to await (no coroutine per stream unless there is something to wait for)."""
        raise NotImplementedError
