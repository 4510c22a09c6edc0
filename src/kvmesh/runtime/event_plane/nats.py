"""The NATS event plane: envelopes on subject ``{namespace}.events.{topic}``.

Every subscriber of a topic hears every publisher of it through the NATS server, so
``connect``/``disconnect`` are no-ops. nats-py's publish is a coroutine, and
:meth:`Publisher.publish` must stay synchronous and non-blocking, so each publisher
queues encoded envelopes (at most ``queue_limit``; beyond that they are dropped) and
one sender task it owns hands them to the client. While NATS is unreachable the
client buffers up to its own pending limit and then refuses; refused envelopes are
dropped and show up as sequence gaps.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from kvmesh.runtime import auth
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.event_plane.base import CheckedSubscription, Envelope, EventPlane, Opener, Publisher, seal
from kvmesh.runtime.event_plane.memory import DEFAULT_INBOX, Inbox, check_topic
from kvmesh.runtime.nats import sync_with_server

__all__ = ["NatsEventPlane", "NatsPublisher", "NatsEventSubscription"]

log = logging.getLogger(__name__)

DEFAULT_QUEUE_LIMIT = 10_000


class NatsPublisher(Publisher):
    """``seq`` is the last sequence number used; ``dropped`` counts envelopes lost here."""

    def __init__(
        self, nc: NatsClient, subject: str, topic: str, publisher_id: int, queue_limit: int, secret: ClusterSecret | None = None
    ) -> None:
        self._nc = nc
        self._secret = secret
        self.subject = subject
        self.topic = topic
        self.publisher_id = publisher_id
        self.seq = 0
        self.dropped = 0
        self._limit = queue_limit
        self._queue: deque[bytes] = deque()
        self._wakeup = asyncio.Event()
        self._closed = False
        self._encode = msgspec.msgpack.Encoder().encode
        self._sender = asyncio.ensure_future(self._send())

    def publish(self, payload: bytes) -> None:
        if self._closed:
            return
        self.seq += 1
        if len(self._queue) >= self._limit:
            self.dropped += 1
            return
        self._queue.append(self._encode(seal(self._secret, Envelope(self.publisher_id, self.seq, self.topic, bytes(payload)))))
        self._wakeup.set()

    async def _send(self) -> None:
        queue = self._queue
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while queue:
                data = queue.popleft()
                try:
                    await self._nc.publish(self.subject, data)
                except nats.errors.Error as exc:
                    # closed, reconnecting with a full buffer, over max payload: drop it
                    self.dropped += 1
                    log.debug("dropping an event on %s: %s", self.subject, exc or type(exc).__name__)

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until every queued envelope reached the NATS server (tests, shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queue and loop.time() < deadline:
            await asyncio.sleep(0.001)
        await sync_with_server(self._nc, timeout=max(0.1, deadline - loop.time()))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender.cancel()
        try:
            await self._sender
        except asyncio.CancelledError:
            pass
        self._queue.clear()


class NatsEventSubscription(CheckedSubscription):
    def __init__(self, topic: str, capacity: int, secret: ClusterSecret | None = None) -> None:
        self.topic = topic
        self.inbox = Inbox(capacity)
        self._sub: NatsSubscription | None = None
        self._opener = Opener(secret)

    async def _on_msg(self, msg: Msg) -> None:
        envelope = self._opener.open(msg.data)
        if envelope is not None and envelope.topic == self.topic:
            self.inbox.put(envelope)

    def __aiter__(self) -> AsyncIterator[Envelope]:
        return self.inbox.__aiter__()

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        self.inbox.close()
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # the client is closed: the subscription is gone with it


class NatsEventPlane(EventPlane):
    """Topics live under ``{namespace}.events.``; ``nc`` is shared and not closed here."""

    name = "nats"

    def __init__(
        self,
        nc: NatsClient,
        namespace: str = "kvmesh",
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        inbox_capacity: int = DEFAULT_INBOX,
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
    ) -> None:
        if not namespace or any(c in " \t\r\n.*>" for c in namespace):
            raise ValueError(f"namespace {namespace!r} must be one NATS subject token (no spaces, '.', '*' or '>')")
        super().__init__()
        self.nc = nc
        self.namespace = namespace
        self.queue_limit = queue_limit
        self.inbox_capacity = inbox_capacity
        self.secret = auth.resolve(secret)

    def subject(self, topic: str) -> str:
        check_topic(topic)
        return f"{self.namespace}.events.{topic}"

    async def publisher(self, topic: str, publisher_id: int) -> NatsPublisher:
        self._check_open()
        pub = NatsPublisher(self.nc, self.subject(topic), topic, publisher_id, self.queue_limit, self.secret)
        self._publishers.append(pub)
        return pub

    async def subscribe(self, topic: str) -> NatsEventSubscription:
        """The subscription is registered on the server when this returns (one round trip)."""
        self._check_open()
        subject = self.subject(topic)
        sub = NatsEventSubscription(topic, self.inbox_capacity, self.secret)
        sub._sub = await self.nc.subscribe(subject, cb=sub._on_msg, pending_msgs_limit=self.inbox_capacity)
        self._subscriptions.append(sub)
        try:
            await sync_with_server(self.nc)
        except (nats.errors.Error, TimeoutError) as exc:
            # still subscribed: nats-py re-sends the subscription when it reconnects
            log.warning("subscribed to %s without confirmation: %s", subject, exc or type(exc).__name__)
        return sub

    async def close(self) -> None:
        await self._close_owned()
