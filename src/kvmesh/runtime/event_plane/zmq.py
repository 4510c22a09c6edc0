"""The ZeroMQ event plane: each publisher binds its own PUB socket, subscribers connect
SUB sockets to the publishers they are told about (by discovery or the supervisor).

One envelope is one zmq frame of msgpack. A PUB socket serves one (publisher, topic),
so subscribers take everything (empty zmq subscription) and only check the topic.

With a cluster secret, every PUB and SUB socket speaks zmq's CURVE security: the
publishers' key pair and the subscribers' key pair are derived from the secret, so a
subscriber completes the CURVE handshake only with a publisher that knows the secret,
and a publisher only with such a subscriber (nothing is read from, or sent to, a peer
without it): the plane's ZAP handler (:class:`_FleetSubscribersOnly`, one per plane, on
the plane's event loop) admits the fleet's subscriber key and no other, so knowing the
publishers' *public* key and bringing a key pair of one's own is not enough. CURVE authenticates (and encrypts) every message on such a connection with
keys only holders of the secret have, which is all an envelope's MAC would prove (see
:mod:`~kvmesh.runtime.event_plane.base`): the planes where a broker relays envelopes
(NATS) seal them; this one does not spend a MAC per envelope on top of CURVE.

Publishing never blocks: the PUB socket sends with ``NOBLOCK`` and zmq drops a message
for a subscriber whose queue is at the high-water mark (``hwm``); a dropped message
shows up as a sequence gap. Each subscription reads its SUB socket from a callback on
the socket's descriptor (registered with the event loop; removed on close) and moves
envelopes into a bounded :class:`Inbox`: each call takes what is queued without waiting
(up to 64), then lets other callbacks and tasks run before the next (a flood of events
must not stall the process that reads them).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec
import zmq
import zmq.asyncio
import zmq.utils.z85

from kvmesh.runtime import auth
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.event_plane.base import (
    MAX_EVENT_BYTES,
    CheckedSubscription,
    Envelope,
    EventPlane,
    Opener,
    Publisher,
    seal,
)
from kvmesh.runtime.event_plane.memory import DEFAULT_INBOX, Inbox, check_topic

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

__all__ = ["ZmqEventPlane", "ZmqPublisher", "ZmqSubscription"]

log = logging.getLogger(__name__)

DEFAULT_HWM = 10_000
_BATCH = 64  # the subscription's reader takes up to this many queued messages, then lets other tasks run
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class CurveKeys:
    """The fleet's CURVE key pairs (z85), derived from the cluster secret."""

    def __init__(self, secret: ClusterSecret) -> None:
        if not zmq.has("curve"):
            raise ValueError("this libzmq has no CURVE security; the event plane cannot use the cluster secret")
        self.server_secret = zmq.utils.z85.encode(secret.derive("zmq-curve-publisher"))
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = zmq.utils.z85.encode(secret.derive("zmq-curve-subscriber"))
        self.client_public = zmq.curve_public(self.client_secret)

    def publisher(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def subscriber(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public


class _FleetSubscribersOnly:
    """ZAP credentials check for the publishers' CURVE handshakes: the fleet's subscriber
    public key (z85) and nothing else."""

    def __init__(self, keys: CurveKeys) -> None:
        self.allowed = keys.client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self.allowed)


class ZmqPublisher(Publisher):
    """Bound at ``address`` (``tcp://host:port``). ``seq`` is the last sequence number
    used; ``dropped`` counts the envelopes zmq refused to queue."""

    def __init__(self, sock: zmq.Socket[bytes], topic: str, publisher_id: int, secret: ClusterSecret | None = None) -> None:
        self._sock: zmq.Socket[bytes] | None = sock
        self._secret = secret
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.publisher_id = publisher_id
        self.seq = 0
        self.dropped = 0
        self._encode = msgspec.msgpack.Encoder().encode

    def publish(self, payload: bytes) -> None:
        sock = self._sock
        if sock is None:
            return
        self.seq += 1
        data = self._encode(seal(self._secret, Envelope(self.publisher_id, self.seq, self.topic, bytes(payload))))
        try:
            sock.send(data, zmq.NOBLOCK, copy=len(data) < 64 * 1024)
        except zmq.ZMQError:  # EAGAIN at the high-water mark, or a socket being torn down
            self.dropped += 1

    async def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=0)


class ZmqSubscription(CheckedSubscription):
    def __init__(self, sock: zmq.asyncio.Socket, topic: str, capacity: int, secret: ClusterSecret | None = None) -> None:
        self._sock = sock
        self.topic = topic
        self.inbox = Inbox(capacity)
        self._opener = Opener(secret)
        self._addresses: set[str] = set()
        # The same zmq socket, synchronous, read from a callback on its file descriptor:
        # no future, task step, enum flags or ``zmq.Again`` per message (zmq.asyncio's
        # machinery cost several times what decoding and applying an event batch costs).
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._recv = plain.recv
        self._events = cast("Callable[[int], int]", plain.get)  # EVENTS is an int option
        self._loop = asyncio.get_running_loop()
        self._fd: int | None = plain.FD
        self._next: asyncio.Handle | None = self._loop.call_soon(self._drain)  # what came before the reader
        self._loop.add_reader(self._fd, self._drain)

    @property
    def addresses(self) -> frozenset[str]:
        return frozenset(self._addresses)

    def connect(self, address: str) -> None:
        """Receive from the publisher bound at ``address``; connecting twice is a no-op."""
        if address in self._addresses or self.inbox.closed:
            return
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect to publisher {address!r}: {exc}") from None
        self._addresses.add(address)

    def disconnect(self, address: str) -> None:
        if address not in self._addresses:
            return
        self._addresses.discard(address)
        try:
            self._sock.disconnect(address)
        except zmq.ZMQError:
            pass  # zmq already forgot it (e.g. the publisher's endpoint went away)

    def _drain(self) -> None:
        """Move what is queued on the socket into the inbox, ``_BATCH`` messages at most
        per call. zmq's descriptor signals edges, not levels: it is readable again only
        after ``EVENTS`` has said there is nothing left, so a call ends either there or
        by scheduling the next call (a flood must not hold the event loop: the inbox's
        reader, and the rest of the process, run between two calls)."""
        self._next = None
        if self._fd is None:
            return
        events, recv, open_, put, topic = self._events, self._recv, self._opener.open, self.inbox.put, self.topic
        try:
            for _ in range(_BATCH):
                if not events(_EVENTS) & _POLLIN:
                    return
                envelope = open_(recv(_NOBLOCK))
                if envelope is not None and envelope.topic == topic:
                    put(envelope)
        except zmq.Again:
            return  # (EVENTS said a message was there; nothing came after all)
        except zmq.ZMQError as exc:
            log.warning("zmq subscription to %s ended: %s", self.topic, exc)
            self._stop_reading()
            return
        except Exception:  # a served consumer's bug (Inbox.serve): logged once per call, reading goes on
            log.exception("zmq subscription to %s: an envelope's consumer failed", self.topic)
        self._next = self._loop.call_soon(self._drain)

    def _stop_reading(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self._loop.remove_reader(fd)
        if self._next is not None:
            self._next.cancel()
            self._next = None

    def __aiter__(self) -> AsyncIterator[Envelope]:
        return self.inbox.__aiter__()

    def serve(self, consume: Callable[[Envelope], object], per_turn: int) -> None:
        """Hand envelopes to ``consume`` as they are read, instead of being iterated
        (:meth:`Inbox.serve`: no task or wake-up per envelope)."""
        self.inbox.serve(consume, per_turn)

    async def close(self) -> None:
        if self.inbox.closed:
            return
        self.inbox.close()
        self._stop_reading()
        self._addresses.clear()
        self._sock.close(linger=0)


class ZmqEventPlane(EventPlane):
    """Publishers bind ``tcp://{host}:{random port}``; ``hwm`` bounds each socket's queue."""

    name = "zmq"

    def __init__(
        self,
        host: str = "127.0.0.1",
        hwm: int = DEFAULT_HWM,
        inbox_capacity: int = DEFAULT_INBOX,
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
        max_message_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        if not host:
            raise ValueError("the zmq event plane needs a host to bind publishers on")
        if hwm < 1:
            raise ValueError(f"hwm must be at least 1, not {hwm}")
        super().__init__()
        self.host = host
        self.hwm = hwm
        self.inbox_capacity = inbox_capacity
        self.secret = auth.resolve(secret)
        self._curve = CurveKeys(self.secret) if self.secret is not None else None
        self._zap: AsyncioAuthenticator | None = None  # started with the first publisher (CURVE only)
        self.max_message_bytes = max_message_bytes
        self._ctx: zmq.asyncio.Context | None = zmq.asyncio.Context()
        # zmq's default is 1,024 sockets per context: the workers of one process (--replicas)
        # share this plane, two publishers each; the process's file limit is the real bound
        self._ctx.set(zmq.MAX_SOCKETS, self._ctx.get(zmq.SOCKET_LIMIT))

    def _context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            raise RuntimeError("the zmq event plane is closed")
        return self._ctx

    async def publisher(self, topic: str, publisher_id: int) -> ZmqPublisher:
        check_topic(topic)
        # A plain (not asyncio) socket: publish() is synchronous and never waits.
        sock = zmq.Socket(self._context(), zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._admit_fleet_subscribers_only(self._curve)
            self._curve.publisher(sock)
        try:
            sock.bind(f"tcp://{self.host}:*")
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot bind a publisher on {self.host!r}: {exc}") from None
        pub = ZmqPublisher(sock, topic, publisher_id, None)  # CURVE authenticates: no MAC (module docstring)
        self._publishers.append(pub)
        return pub

    def _admit_fleet_subscribers_only(self, keys: CurveKeys) -> None:
        """The context's ZAP handler, before the first CURVE server socket binds."""
        if self._zap is None:
            from zmq.auth.asyncio import AsyncioAuthenticator  # only a fleet with a secret runs one

            zap = AsyncioAuthenticator(self._context(), log=log)
            zap.start()
            zap.configure_curve_callback("*", credentials_provider=_FleetSubscribersOnly(keys))
            self._zap = zap

    async def subscribe(self, topic: str) -> ZmqSubscription:
        check_topic(topic)
        sock = self._context().socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # zmq drops the connection of a peer that sends a bigger message, before buffering it
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self._curve is not None:
            self._curve.subscriber(sock)
        sub = ZmqSubscription(sock, topic, self.inbox_capacity, None)  # CURVE authenticates (module docstring)
        self._subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        await self._close_owned()
        zap, self._zap = self._zap, None
        if zap is not None:
            zap.stop()
        ctx.term()  # every socket is closed with linger 0: returns at once
