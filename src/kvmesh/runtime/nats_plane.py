"""The NATS request plane: a request travels as a NATS message, its response streams
back over a direct TCP connection from the worker to the caller ("call home").

::

    caller process                                            worker process
    CallHomeServer listens on host:port (one per process)
    NatsRequestClient.stream(endpoint, payload, ctx)
      1. register a mailbox for a fresh sid
      2. NATS request  {namespace}.{component}.{endpoint}-{lease_id:x}
         NatsRequest(sid, callhome "host:port", payload)  ────▶  NatsRequestServer
      3.                    ◀──── NATS reply NatsReply()       accepted at once, or a
                                                            typed error (malformed);
                                                            nobody subscribed → "no
                                                            responders" → CannotConnect
         (the stream does not wait for the reply: it races the call-home frames and
         matters only as an error, or to start the wait for the worker's Ack)
      4.          ◀════ TCP connection to callhome (one per caller address, reused)
                  ◀──── Ack(sid)                         identifies the stream
                  ◀──── Out(sid, item) … End(sid) | Err(sid, kind, message)
                  ────▶ Ctl(sid, STOP | KILL)            ctx.stop_generating() / ctx.kill()

The worker end of a call-home connection is the TCP plane's own connection protocol
(``tcp_server._Conn``) dialled in the other direction: it serves the stream with the
same handler loop (Ack, Out per item, End, typed Err, backpressure), maps Ctl frames
to the stream's context and kills every stream it carries when the connection drops.

Trust: stream ids are random 63-bit numbers drawn by the call-home server, and a
stream is bound to the call-home connection whose ``Ack`` claimed it first; ``Out``,
``End`` and ``Err`` frames for it from any other connection are dropped and counted
(``CallHomeServer.foreign_frames``). With a cluster secret (:mod:`kvmesh.runtime.auth`)
every request message carries an HMAC over its subject, stream id, call-home address
and payload, which the worker checks before it dials anything, and the call-home
connection starts with the mutual handshake (channel ``callhome``).

Failures come out of :meth:`NatsRequestClient.stream` typed like the TCP plane's:
``CannotConnect`` (no responders, NATS unreachable), ``ConnectionTimeout`` (no reply
to the NATS request in time), ``ResponseTimeout`` (the worker accepted but never
called home, or sent no first item within ``response_timeout``), ``Disconnected``
(the call-home connection dropped mid-stream), and the worker's own typed errors.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import ssl
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.errors import (
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    InvalidArgument,
    KvmeshError,
    ResponseTimeout,
    from_wire,
)
from kvmesh.runtime import auth
from kvmesh.runtime.auth import HANDSHAKE_TIMEOUT_S, AuthError, ClusterSecret, Handshake, ProtocolHandshake, TlsContexts
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import (
    KILL,
    MAX_FRAME_BYTES,
    MAX_REQUEST_FRAME,
    MAX_STREAMS,
    STOP,
    Ack,
    Ctl,
    End,
    Err,
    FrameReader,
    FrameWriter,
    Out,
    Req,
)

# NOTE: the call-home stream reuses the TCP plane's worker-side connection protocol and
# caller-side mailbox rather than duplicating them (see the module docstring).
from kvmesh.runtime.sockets import tune_stream_socket
from kvmesh.runtime.tcp_client import _END, _Mailbox
from kvmesh.runtime.tcp_server import Handler, _Conn

__all__ = [
    "NatsRequest",
    "NatsReply",
    "NatsRequestServer",
    "NatsRequestClient",
    "CallHomeServer",
    "connect_nats",
    "sync_with_server",
    "request_subject",
    "plane_settling",
    "PLANE_WAIT_S",
    "request_mac",
    "reply_mac",
    "nats_tls_context",
]

log = logging.getLogger(__name__)

_BAD_TOKEN_CHARS = frozenset(" \t\r\n.*>")

# How long a request waits for the NATS plane to come back before its error goes to
# the caller (NatsRequestClient); override per client with ``plane_wait_s``.
PLANE_WAIT_S = 15.0


class NatsRequest(msgspec.Struct, array_like=True):
    """The NATS message that opens a stream: ``payload`` is the endpoint's own msgpack."""

    sid: int
    callhome: str
    payload: msgspec.Raw
    mac: bytes = b""  # HMAC of the cluster secret (see request_mac); empty without one


def request_mac(secret: ClusterSecret, subject: str, sid: int, callhome: str, payload: bytes) -> bytes:
    sid_bytes = sid.to_bytes(9, "little", signed=True)  # any msgpack integer fits
    return secret.sign("nats-request", subject.encode(), sid_bytes, callhome.encode(), bytes(payload))


class NatsReply(msgspec.Struct, array_like=True, omit_defaults=True):
    """The worker's immediate answer: empty ``kind`` = accepted, else a typed error."""

    kind: str = ""
    message: str = ""
    mac: bytes = b""  # with a cluster secret: reply_mac, bound to the request's reply inbox


def reply_mac(secret: ClusterSecret, inbox: str, kind: str, message: str) -> bytes:
    """A reply's MAC: a caller with a secret ignores a reply without a valid one (a
    forged error cannot end a stream; the stream's own timeouts still bound it)."""
    return secret.sign("nats-reply", inbox.encode(), kind.encode(), message.encode())


_ACCEPTED = msgspec.msgpack.encode(NatsReply())


def _check_token(what: str, value: str) -> None:
    if not value or any(c in _BAD_TOKEN_CHARS for c in value):
        raise ValueError(f"{what} {value!r} must be a non-empty NATS subject token (no spaces, '.', '*' or '>')")


def request_subject(namespace: str, component: str, endpoint: str, lease_id: int) -> str:
    """``{namespace}.{component}.{endpoint}-{lease_id:x}``; ValueError for a bad name."""
    for what, value in (("namespace", namespace), ("component", component), ("endpoint", endpoint)):
        _check_token(what, value)
    return f"{namespace}.{component}.{endpoint}-{lease_id:x}"


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"call-home address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def nats_tls_context(ca_file: str = "", cert_file: str = "", key_file: str = "") -> ssl.SSLContext | None:
    """A client TLS context for NATS from PEM files; None when none is given (a
    ``tls://`` server URL then uses nats-py's default context)."""
    if not (ca_file or cert_file or key_file):
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("a NATS client certificate needs both --nats-cert and --nats-key")
    ctx = ssl.create_default_context(cafile=ca_file or None)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def _redact(servers: str | list[str]) -> str:
    """Server URLs without their user:password (never echoed in a message)."""
    urls = [servers] if isinstance(servers, str) else servers
    return ",".join(re.sub(r"//[^/@]*@", "//***@", u) for u in urls)


async def connect_nats(
    servers: str | list[str],
    *,
    name: str | None = None,
    connect_timeout: float = 2.0,
    first_connect_attempts: int = 3,
    user_credentials: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> NatsClient:
    """Connect to NATS; once connected, reconnect forever (every 0.5 s) after a loss.

    Raises :class:`CannotConnect` when no server answers within about
    ``first_connect_attempts`` × (``connect_timeout`` + 0.5 s). ``user_credentials``
    (a NATS ``.creds`` file) and ``tls`` go to nats-py as they are; a password in a URL
    is never echoed in a message.
    """

    client: list[NatsClient] = []  # set once connected; the callbacks only log
    errors: list[str] = []  # what went wrong while connecting, for the message

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc) or type(exc).__name__)
        log.warning("NATS: %s", exc or type(exc).__name__)

    async def on_disconnected() -> None:
        if client and not client[0].is_closed:
            log.warning("NATS: disconnected; reconnecting")

    async def on_reconnected() -> None:
        log.info("NATS: reconnected")
        if client:
            _reconnected_at[client[0]] = asyncio.get_running_loop().time()

    nc = NatsClient()
    # NOTE: nats-py retries some failures (a TLS certificate it cannot verify) without
    # end on the first connect; bound it so a misconfiguration is an error, not a hang.
    bound = first_connect_attempts * (connect_timeout + 0.5) + 2.0
    try:
        await asyncio.wait_for(nc.connect(
            servers,
            name=name,
            connect_timeout=connect_timeout,
            reconnect_time_wait=0.5,
            # nats-py applies this limit to the first connect too, where a negative value
            # would retry a dead URL forever; it is lifted below once connected.
            max_reconnect_attempts=max(1, first_connect_attempts - 1),
            ping_interval=10,
            max_outstanding_pings=3,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **({"user_credentials": user_credentials} if user_credentials else {}),
            **({"tls": tls} if tls is not None else {}),
        ), bound)  # fmt: skip
    except TimeoutError:
        await nc.close()
        last = errors[-1] if errors else f"no answer within {bound:.0f} s"
        raise CannotConnect(f"cannot connect to NATS at {_redact(servers)}: {last}") from None
    except (OSError, nats.errors.Error) as exc:
        raise CannotConnect(f"cannot connect to NATS at {_redact(servers)}: {exc or type(exc).__name__}") from None
    nc.options["max_reconnect_attempts"] = -1
    client.append(nc)
    return nc


# when each client last reconnected (loop time), for plane_settling()
_reconnected_at: weakref.WeakKeyDictionary[NatsClient, float] = weakref.WeakKeyDictionary()


def plane_settling(nc: NatsClient, within_s: float) -> bool:
    """True while the NATS plane is down for ``nc`` (disconnected, reconnecting) or came
    back less than ``within_s`` ago (other clients may not have re-subscribed yet)."""
    if not nc.is_connected:
        return True
    since = _reconnected_at.get(nc)
    return since is not None and asyncio.get_running_loop().time() - since < within_s


async def sync_with_server(nc: NatsClient, timeout: float = 2.0) -> None:
    """Return once the server has processed everything this client sent before the call
    (e.g. subscriptions: requests from other clients then reach them).

    NOTE: nats-py writes a flush's PING straight to the socket while earlier commands may
    still wait in its pending buffer, so one PING/PONG can overtake a SUB. The first
    round trip lets its flusher task write the buffer; the second PING then follows it.
    """
    await nc.flush(timeout=timeout)
    await nc.flush(timeout=timeout)


# ------------------------------------------------------------------------ worker side


class NatsRequestServer:
    """Serves registered endpoints on NATS subjects of one instance (``lease_id``).

    Same surface as :class:`~kvmesh.runtime.tcp_server.TcpServer`. Lifecycle:

    1. ``register(endpoint, handler)``; ``start()`` subscribes every registered
       endpoint (one subject each, no queue group: each instance has its own
       subjects) and returns once the server has the subscriptions;
    2. ``register`` after ``start`` subscribes in the background (an owned task);
       ``await ready()`` returns once every registered endpoint is subscribed;
    3. ``stop_accepting()`` unsubscribes: new requests get "no responders" and go
       elsewhere, open streams continue; ``wait_idle`` waits for them;
    4. ``close()`` cancels whatever is still running.
    """

    def __init__(
        self,
        nc: NatsClient,
        namespace: str,
        component: str,
        lease_id: int,
        connect_timeout: float = 5.0,
        max_frame_bytes: int = MAX_REQUEST_FRAME,
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
        max_streams: int = MAX_STREAMS,
        tls: TlsContexts | None | auth._FromEnv = auth.FROM_ENV,
    ) -> None:
        request_subject(namespace, component, "x", lease_id)  # validates the names
        self.tls = auth.resolve_tls(tls)
        self.nc = nc
        self.namespace = namespace
        self.component = component
        self.lease_id = lease_id
        self.connect_timeout = connect_timeout
        self.max_frame_bytes = max_frame_bytes
        # read by the shared _Conn
        self.secret = auth.resolve(secret)
        self.channel = "callhome"
        self.handshake_timeout_s = HANDSHAKE_TIMEOUT_S
        self.max_streams = max_streams
        self.foreign_frames = 0
        self.unsigned = 0  # requests refused: no valid MAC
        self.endpoints: dict[str, Handler] = {}
        self._subs: dict[str, Subscription] = {}
        self._by_subject: dict[str, str] = {}
        self._state = "new"  # -> "serving" (start) -> "stopped" (stop_accepting)
        self.draining = False  # read by the shared _Conn; requests that got through still run
        self._subscribing: set[asyncio.Task[None]] = set()
        self._decode_request = msgspec.msgpack.Decoder(NatsRequest).decode
        # call-home connections by caller address; ``_conns`` is maintained by _Conn
        self._homes: dict[str, _Conn] = {}
        self._dialing: dict[str, asyncio.Task[_Conn]] = {}
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def subject(self, endpoint: str) -> str:
        return request_subject(self.namespace, self.component, endpoint, self.lease_id)

    @property
    def transport(self) -> str:
        """What discovery records: ``nats:`` + the subject, ``{endpoint}`` left as a placeholder."""
        return f"nats:{self.namespace}.{self.component}.{{endpoint}}-{self.lease_id:x}"

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def register(self, endpoint: str, handler: Handler) -> None:
        """Serve ``endpoint``; ValueError for a name NATS cannot carry. After :meth:`start`
        the subscription is made in the background: ``await ready()`` to wait for it."""
        self.subject(endpoint)
        self.endpoints[endpoint] = handler
        if self._state == "serving" and endpoint not in self._subs:
            task = asyncio.ensure_future(self._subscribe_late(endpoint))
            self._subscribing.add(task)
            task.add_done_callback(self._subscribing.discard)

    async def start(self) -> None:
        self._state = "serving"
        for endpoint in self.endpoints:
            await self._subscribe(endpoint)
        await sync_with_server(self.nc, self.connect_timeout)

    async def ready(self) -> None:
        """Return once every endpoint registered so far is subscribed on the server."""
        if self._subscribing:
            await asyncio.gather(*self._subscribing)
        await sync_with_server(self.nc, self.connect_timeout)

    async def _subscribe_late(self, endpoint: str) -> None:
        try:
            await self._subscribe(endpoint)
        except nats.errors.Error as exc:
            log.error("cannot serve %s: %s", self.subject(endpoint), exc or type(exc).__name__)

    async def _subscribe(self, endpoint: str) -> None:
        if self._state != "serving" or endpoint in self._subs:
            return
        subject = self.subject(endpoint)
        self._by_subject[subject] = endpoint
        self._subs[endpoint] = await self.nc.subscribe(subject, cb=self._on_request)

    # -- requests
    async def _on_request(self, msg: Msg) -> None:
        # Runs in the subscription's own task, one message at a time: answer and hand
        # the stream to a task of ours, never wait here.
        if not msg.reply:
            log.warning("dropping a request on %s without a reply subject", msg.subject)
            return
        endpoint = self._by_subject.get(msg.subject)
        if endpoint is None:
            return
        try:
            req = self._decode_request(msg.data)
            self._check_mac(msg.subject, req)
            _split_address(req.callhome)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            await self._reply(msg, NatsReply(InvalidArgument.kind, f"malformed request on {msg.subject}: {exc}"))
            return
        except InvalidArgument as exc:
            await self._reply(msg, NatsReply(exc.kind, exc.message))
            return
        if not await self._reply(msg, None):
            return
        conn = self._live_home(req.callhome)
        if conn is not None:
            conn._open(Req(req.sid, endpoint, req.payload))  # Ack, then the handler loop in a task
        else:
            self._spawn(self._call_home(Req(req.sid, endpoint, req.payload), req.callhome))

    def _check_mac(self, subject: str, req: NatsRequest) -> None:
        secret = self.secret
        if secret is None:
            return
        if not hmac.compare_digest(req.mac, request_mac(secret, subject, req.sid, req.callhome, req.payload)):
            self.unsigned += 1
            log.warning("refusing a request on %s: not signed with this fleet's cluster secret", subject)
            raise AuthError(f"request on {subject} refused: not signed with the cluster secret")

    async def _reply(self, msg: Msg, reply: NatsReply | None) -> bool:
        try:
            if self.secret is not None:
                reply = reply or NatsReply()
                reply.mac = reply_mac(self.secret, msg.reply, reply.kind, reply.message)
            await msg.respond(_ACCEPTED if reply is None else msgspec.msgpack.encode(reply))
        except nats.errors.Error as exc:
            log.warning("cannot answer a request on %s: %s", msg.subject, exc or type(exc).__name__)
            return False
        return True

    async def _call_home(self, req: Req, address: str) -> None:
        try:
            conn = await self._home(address)
        except KvmeshError as exc:
            # The caller sees no Ack and gives up with ResponseTimeout.
            log.warning("stream %d not served: %s", req.sid, exc.message)
            return
        conn._open(req)

    def _live_home(self, address: str) -> _Conn | None:
        conn = self._homes.get(address)
        if conn is not None and conn._transport is not None and not conn._transport.is_closing():
            return conn
        return None

    async def _home(self, address: str) -> _Conn:
        conn = self._live_home(address)
        if conn is not None:
            return conn
        dial = self._dialing.get(address)
        if dial is None:
            dial = asyncio.ensure_future(self._dial(address))
            self._dialing[address] = dial
            dial.add_done_callback(lambda t: self._dial_done(address, t))
        return await asyncio.shield(dial)

    async def _dial(self, address: str) -> _Conn:
        host, port = _split_address(address)
        tls = {} if self.tls is None else {"ssl": self.tls.client, "server_hostname": host, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
        connecting = asyncio.get_running_loop().create_connection(lambda: _Conn(self, client=True), host, port, **tls)  # type: ignore[arg-type]
        try:
            _, conn = await asyncio.wait_for(connecting, self.connect_timeout)
        except TimeoutError:
            raise ConnectionTimeout(f"calling home to {address} took over {self.connect_timeout} s") from None
        except OSError as exc:
            raise CannotConnect(f"cannot call home to {address}: {exc.strerror or exc}") from None
        try:
            if conn.gate is not None:
                await asyncio.wait_for(asyncio.shield(conn.gate.ready), self.connect_timeout)
        except TimeoutError:
            conn.close()
            raise ConnectionTimeout(f"calling home to {address} took over {self.connect_timeout} s") from None
        except AuthError as exc:
            raise CannotConnect(f"cannot call home to {address}: {exc.message}") from None
        except OSError as exc:
            raise CannotConnect(f"cannot call home to {address}: {exc.strerror or exc}") from None
        # forget connections to callers that went away
        for addr, old in list(self._homes.items()):
            if old._transport is None:
                del self._homes[addr]
        self._homes[address] = conn
        return conn

    def _dial_done(self, address: str, task: asyncio.Task[_Conn]) -> None:
        if self._dialing.get(address) is task:
            del self._dialing[address]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter has seen it already

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- lifecycle (as TcpServer)
    async def stop_accepting(self) -> None:
        """Unsubscribe: requests already delivered are served, new ones get no responders."""
        self._state = "stopped"
        for task in list(self._subscribing):
            task.cancel()
        await asyncio.gather(*self._subscribing, return_exceptions=True)
        subs, self._subs = self._subs, {}
        for sub in subs.values():
            try:
                if self.nc.is_connected:
                    await asyncio.wait_for(sub.drain(), self.connect_timeout)
                else:
                    await sub.unsubscribe()  # reconnecting: the subscription is not renewed
            except (nats.errors.Error, TimeoutError) as exc:
                # closed: nothing is subscribed any more; timed out: UNSUB was sent already
                log.debug("unsubscribing from %s: %s", sub.subject, exc or type(exc).__name__)

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

    async def close(self) -> None:
        await self.stop_accepting()
        pending = [*self._tasks, *self._dialing.values()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for conn in list(self._conns):
            conn.close()
        self._homes.clear()


# ------------------------------------------------------------------------ caller side


class _Stream:
    """One stream as the call-home server sees it; ``conn`` is set by the worker's Ack."""

    __slots__ = ("sid", "box", "conn", "pending", "ack_timer")

    def __init__(self, sid: int, box: _Mailbox) -> None:
        self.sid = sid
        self.box = box
        self.conn: _HomeConn | None = None
        self.pending = 0  # a STOP/KILL asked for before the worker called home
        self.ack_timer: asyncio.TimerHandle | None = None


class _HomeConn(asyncio.Protocol):
    """One worker's call-home connection: routes its frames to the streams it carries."""

    def __init__(self, home: CallHomeServer) -> None:
        self._home = home
        self._reader = FrameReader(home.max_frame_bytes)
        self._writer = FrameWriter()
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.sids: set[int] = set()
        self.auth: ProtocolHandshake | None = None  # set while the handshake runs

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._writer.transport = transport  # type: ignore[assignment]
        tune_stream_socket(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        self._home._conns.add(self)
        if self._home.secret is not None:
            hs = Handshake(self._home.secret, "callhome", client=False, peer=f"worker {self.peer}")
            self.auth = ProtocolHandshake(hs, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.auth is not None:
            self.auth.lost()
        self._home._conns.discard(self)
        self.transport = None
        self._writer.transport = None
        sids, self.sids = self.sids, set()
        for sid in sids:
            self._home._end(sid, Disconnected(f"call-home connection from worker {self.peer} lost"))

    def data_received(self, data: bytes) -> None:
        if self.auth is not None:
            data, self.auth = self.auth.admit(data)
            if not data:
                return
        try:
            frames = self._reader.feed(data)
        except InvalidArgument as exc:
            log.warning("closing call-home connection from %s: %s", self.peer, exc.message)
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
        self.streams: dict[int, _Stream] = {}
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
        tls = {} if self.tls is None else {"ssl": self.tls.server, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
        server = await loop.create_server(lambda: _HomeConn(self), self.host, self.port, **tls)  # type: ignore[arg-type]
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
    def _open(self, box: _Mailbox) -> _Stream:
        # Random, so that nobody can guess the ids of other callers' streams.
        sid = secrets.randbits(63)
        while sid == 0 or sid in self.streams:
            sid = secrets.randbits(63)
        stream = _Stream(sid, box)
        self.streams[stream.sid] = stream
        return stream

    def _rekey(self, stream: _Stream) -> None:
        """Give an unanswered stream a new id before its request is sent again: a late
        Ack for the old id finds no stream and is killed (see _bind), so a request
        sent twice is served once."""
        self.streams.pop(stream.sid, None)
        fresh = self._open(stream.box)
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

    def _control(self, stream: _Stream, action: int) -> None:
        if stream.box.ended:
            return
        if stream.conn is not None:
            stream.conn.control(stream.sid, action)
        else:
            stream.pending = max(stream.pending, action)

    def _abandon(self, stream: _Stream, error: BaseException | None = None) -> None:
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
    def _disarm(stream: _Stream) -> None:
        if stream.ack_timer is not None:
            stream.ack_timer.cancel()
            stream.ack_timer = None

    async def close(self) -> None:
        """Stop listening and drop every connection; open streams end as Disconnected."""
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
            self._starting = None
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


class NatsRequestClient:
    """Streams requests to one worker instance (``lease_id``) over NATS + call-home TCP.

    Same ``stream``/``close`` surface as :class:`~kvmesh.runtime.tcp_client.TcpClient`.
    ``connect_timeout`` bounds the NATS request/reply and the wait for the worker to
    call home; ``response_timeout`` (if set) the wait for the first response item.

    A request whose NATS hop fails because the plane itself is down (this process is
    disconnected from NATS, or reconnected less than ``plane_wait_s`` ago, when the
    worker may not have re-subscribed yet) is not failed at once: it waits for the
    plane and is sent again, under a new stream id, until ``plane_wait_s``
    (:data:`PLANE_WAIT_S`, 15 s by default) after the first failure; then the error
    goes to the caller (the frontend migrates the request). Only requests no worker
    has called home for are sent again, and a late answer to an earlier send is
    killed, so a request is never served twice.
    """

    def __init__(
        self,
        nc: NatsClient,
        callhome: CallHomeServer,
        namespace: str,
        component: str,
        lease_id: int,
        connect_timeout: float = 5.0,
        response_timeout: float | None = None,
        plane_wait_s: float | None = None,
    ) -> None:
        request_subject(namespace, component, "x", lease_id)  # validates the names
        self.nc = nc
        self.callhome = callhome
        self.plane_wait_s = PLANE_WAIT_S if plane_wait_s is None else plane_wait_s
        self.namespace = namespace
        self.component = component
        self.lease_id = lease_id
        self.connect_timeout = connect_timeout
        self.response_timeout = response_timeout
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_reply = msgspec.msgpack.Decoder(NatsReply).decode

    def subject(self, endpoint: str) -> str:
        return request_subject(self.namespace, self.component, endpoint, self.lease_id)

    async def stream(
        self,
        endpoint: str,
        payload: bytes,
        ctx: Context,
        decode: Callable[[Any], Any] | None = None,
        merge: Callable[[Any, Any], Any] | None = None,
    ) -> AsyncIterator[Any]:
        """Send one request; yield the decoded response items until the stream ends.

        Stopping ``ctx`` sends STOP (or KILL) to the worker; the stream then ends with
        whatever the worker sends last. Leaving the iteration early kills the stream.
        """
        try:
            subject = self.subject(endpoint)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        home = self.callhome
        await home.start()
        stream = home._open(_Mailbox(decode, merge))
        box = stream.box
        loop = asyncio.get_running_loop()
        if self.response_timeout is not None:
            box.timer = loop.call_later(self.response_timeout, self._timed_out, stream, subject)
        # The NATS reply and the worker's call-home frames race; the stream does not wait
        # for the reply, which only matters when it is an error (see _replied).
        request = asyncio.ensure_future(self._request(subject, stream, payload))
        request.add_done_callback(lambda task: self._replied(task, stream, subject))
        try:
            ctx.on_stop(lambda c: home._control(stream, KILL if c.is_killed() else STOP))
            while True:
                item = await box.next()
                if item is _END:
                    return
                yield item
        finally:
            if not request.done():
                request.cancel()
            if not box.ended:
                home._abandon(stream)

    def _replied(self, request: asyncio.Task[str | None], stream: _Stream, subject: str) -> None:
        if request.cancelled():
            return
        error = request.exception()  # retrieved in every case
        if stream.box.ended or stream.conn is not None:
            return  # the worker called home: the stream is under way whatever the reply said
        if error is not None:
            self.callhome._abandon(stream, error)
        else:
            loop = asyncio.get_running_loop()
            stream.ack_timer = loop.call_later(self.connect_timeout, self._no_call_home, stream, subject, request.result())

    async def _request(self, subject: str, stream: _Stream, payload: bytes) -> str | None:
        """The NATS hop, sent again while the plane itself is down or settling (see the
        class docstring); any other failure, or one past ``plane_wait_s``, is raised."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        delay = 0.05
        while True:
            try:
                return await self._request_once(subject, stream, payload)
            except (CannotConnect, ConnectionTimeout) as exc:
                if not plane_settling(self.nc, self.plane_wait_s):
                    raise
                deadline = deadline or loop.time() + self.plane_wait_s
                if loop.time() >= deadline or stream.conn is not None or stream.box.ended:
                    raise
                log.info("NATS plane down or settling (%s); sending %s again", exc.message, subject)
            await self._plane_back(deadline)
            await asyncio.sleep(delay)  # let the worker's subscription come back too
            delay = min(delay * 2, 0.5)
            if stream.conn is not None or stream.box.ended:
                return None  # answered after all (a late reply), or abandoned meanwhile
            self.callhome._rekey(stream)

    async def _plane_back(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not self.nc.is_connected and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def _request_once(self, subject: str, stream: _Stream, payload: bytes) -> str | None:
        """Send the request; raise the worker's typed error. Returns None, or with a
        cluster secret the text of a reply that was ignored for want of a valid MAC."""
        home = self.callhome.address
        secret = self.callhome.secret
        mac = request_mac(secret, subject, stream.sid, home, payload) if secret is not None else b""
        data = self._encode(NatsRequest(stream.sid, home, msgspec.Raw(payload), mac))
        try:
            msg = await self.nc.request(subject, data, timeout=self.connect_timeout)
        except nats.errors.NoRespondersError:
            raise CannotConnect(f"nobody serves {subject}") from None
        except TimeoutError:  # nats.errors.TimeoutError included
            raise ConnectionTimeout(f"no answer on {subject} within {self.connect_timeout} s") from None
        except nats.errors.Error as exc:
            raise CannotConnect(f"NATS request on {subject} failed: {exc or type(exc).__name__}") from None
        try:
            reply = self._decode_reply(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Disconnected(f"malformed reply on {subject}: {exc}") from None
        if secret is not None and not hmac.compare_digest(reply.mac, reply_mac(secret, msg.subject, reply.kind, reply.message)):
            log.warning("ignoring a reply on %s not signed with this fleet's cluster secret", subject)
            # no verdict: the stream waits for the worker's call-home, within its timeouts
            return f"a reply not signed with this fleet's cluster secret was ignored ({reply.kind or 'accepted'}: {reply.message})"
        if reply.kind:
            raise from_wire(reply.kind, reply.message)
        return None

    def _timed_out(self, stream: _Stream, subject: str) -> None:
        stream.box.timer = None
        if stream.box.answered or stream.box.ended:
            return
        message = f"the worker on {subject} sent no response within {self.response_timeout} s"
        self.callhome._abandon(stream, ResponseTimeout(message))

    def _no_call_home(self, stream: _Stream, subject: str, note: str | None = None) -> None:
        stream.ack_timer = None
        if stream.conn is None:
            message = f"the worker on {subject} accepted but did not call home within {self.connect_timeout} s"
            if note is not None:
                message = f"no worker on {subject} called home within {self.connect_timeout} s; {note}"
            self.callhome._abandon(stream, ResponseTimeout(message))

    async def close(self) -> None:
        """Nothing to release: the NATS client and the call-home server are shared."""
