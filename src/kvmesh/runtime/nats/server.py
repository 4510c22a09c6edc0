"""The NATS request plane, worker side: endpoints on subjects, responses over call-home TCP.

A call-home connection is the TCP plane's own worker-side connection
(:class:`~kvmesh.runtime.tcp_server.ServerConnection`) dialled out to the caller: it
serves each stream with the same handler loop, maps Ctl frames to the stream's
context and kills every stream it carries when it drops.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.errors import CannotConnect, ConnectionTimeout, InvalidArgument, KvmeshError
from kvmesh.runtime import auth
from kvmesh.runtime.auth import HANDSHAKE_TIMEOUT_S, AuthError, ClusterSecret, TlsContexts
from kvmesh.runtime.frames import MAX_REQUEST_FRAME, Req
from kvmesh.runtime.nats.connect import sync_with_server
from kvmesh.runtime.nats.wire import (
    ACCEPTED, NatsReply, NatsRequest, reply_mac, request_seal, request_subject, split_address,
)  # fmt: skip
from kvmesh.runtime.seal import SealRefused
from kvmesh.runtime.stream import Handler, StreamServer
from kvmesh.runtime.tcp_server import ServerConnection

__all__ = ["NatsRequestServer"]

log = logging.getLogger("kvmesh.runtime.nats")


class NatsRequestServer(StreamServer):
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
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
        tls: TlsContexts | None | auth._FromEnv = auth.FROM_ENV,
    ) -> None:
        request_subject(namespace, component, "x", lease_id)  # validates the names
        super().__init__(secret, tls)
        self.nc = nc
        self.namespace = namespace
        self.component = component
        self.lease_id = lease_id
        self.connect_timeout = connect_timeout
        self.channel = "callhome"  # read by ServerConnection (a StreamHost)
        self.unsigned = 0  # requests refused: not sealed with the secret, replayed, or too old
        self._seal = request_seal(self.secret) if self.secret is not None else None
        self._subs: dict[str, Subscription] = {}
        self._by_subject: dict[str, str] = {}
        self._state = "new"  # -> "serving" (start) -> "stopped" (stop_accepting)
        self._subscribing: set[asyncio.Task[None]] = set()
        self._decode_request = msgspec.msgpack.Decoder(NatsRequest).decode
        # call-home connections by caller address; ``_conns`` is maintained by ServerConnection
        self._homes: dict[str, ServerConnection] = {}
        self._dialing: dict[str, asyncio.Task[ServerConnection]] = {}
        self._conns: set[ServerConnection] = set()

    def subject(self, endpoint: str) -> str:
        return request_subject(self.namespace, self.component, endpoint, self.lease_id)

    @property
    def transport(self) -> str:
        """What discovery records: ``nats:`` + the subject, ``{endpoint}`` left as a placeholder."""
        return f"nats:{self.namespace}.{self.component}.{{endpoint}}-{self.lease_id:x}"

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
            req = self._decode_request(self._open(msg))
            split_address(req.callhome)
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
            conn.serve(Req(req.sid, endpoint, req.payload))  # Ack, then the handler loop in a task
        else:
            self.tasks.spawn(self._call_home(Req(req.sid, endpoint, req.payload), req.callhome))

    def _open(self, msg: Msg) -> bytes:
        """The request's msgpack: ``msg.data`` itself, or with a cluster secret what it
        seals (refused: forged, tampered, moved from another subject, replayed, too old)."""
        data = msg.data
        if self._seal is None:
            if len(data) > MAX_REQUEST_FRAME:
                raise InvalidArgument(f"request on {msg.subject} refused: {len(data)} bytes, over {MAX_REQUEST_FRAME}")
            return data
        try:
            return self._seal.open(data, msg.subject.encode(), time.time())
        except SealRefused as exc:
            self.unsigned += 1
            log.warning("refusing a request on %s: %s", msg.subject, exc.message)
            raise AuthError(f"request on {msg.subject} refused: {exc.message}") from None

    async def _reply(self, msg: Msg, reply: NatsReply | None) -> bool:
        try:
            if self.secret is not None:
                reply = reply or NatsReply()
                reply.mac = reply_mac(self.secret, msg.reply, reply.kind, reply.message)
            await msg.respond(ACCEPTED if reply is None else msgspec.msgpack.encode(reply))
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
        conn.serve(req)

    def _live_home(self, address: str) -> ServerConnection | None:
        conn = self._homes.get(address)
        if conn is not None and conn.alive:
            return conn
        return None

    async def _home(self, address: str) -> ServerConnection:
        conn = self._live_home(address)
        if conn is not None:
            return conn
        dial = self._dialing.get(address)
        if dial is None:
            dial = asyncio.ensure_future(self._dial(address))
            self._dialing[address] = dial
            dial.add_done_callback(lambda t: self._dial_done(address, t))
        return await asyncio.shield(dial)

    async def _dial(self, address: str) -> ServerConnection:
        host, port = split_address(address)
        tls = self.tls.client if self.tls is not None else None
        connecting = asyncio.get_running_loop().create_connection(
            lambda: ServerConnection(self, client=True), host, port, ssl=tls,
            server_hostname=host if tls else None, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls else None,
        )
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
            if old.gone:
                del self._homes[addr]
        self._homes[address] = conn
        return conn

    def _dial_done(self, address: str, task: asyncio.Task[ServerConnection]) -> None:
        if self._dialing.get(address) is task:
            del self._dialing[address]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter has seen it already

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

    async def close(self) -> None:
        await self.stop_accepting()
        dialing = list(self._dialing.values())
        for task in dialing:
            task.cancel()
        await self.tasks.cancel_all()
        await asyncio.gather(*dialing, return_exceptions=True)
        for conn in list(self._conns):
            conn.close()
        self._homes.clear()
