"""The in-process event plane, and the bounded inbox every backend's subscriptions use.

Several :class:`MemoryEventPlane` objects may share one :class:`MemoryHub` (e.g. a
"worker" plane and a "router" plane in one test); publishers and subscribers of one
topic meet there. Delivery is synchronous into each subscriber's inbox: publishing
costs one append per subscriber and never waits for a reader.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from kvmesh.runtime.event_plane.base import Envelope, EventPlane, Publisher, Subscription

__all__ = ["Inbox", "MemoryHub", "MemoryEventPlane", "MemoryPublisher", "MemorySubscription", "check_topic"]

DEFAULT_INBOX = 10_000


def check_topic(topic: str) -> None:
    """ValueError unless ``topic`` can be a NATS subject suffix (the strictest backend)."""
    if not isinstance(topic, str) or not topic or any(c in " \t\r\n*>" for c in topic) or ".." in topic:
        raise ValueError(f"topic {topic!r} must be a non-empty string without spaces, '*', '>' or empty tokens")
    if topic.startswith(".") or topic.endswith("."):
        raise ValueError(f"topic {topic!r} must not start or end with '.'")


class Inbox:
    """A bounded FIFO of envelopes with one reader.

    ``put`` never blocks: when ``capacity`` envelopes are waiting, the new one is
    dropped (counted in ``dropped``) and the reader later sees a sequence gap.
    After ``close`` the reader gets what is left, then the iteration ends.

    The reader is either a task iterating the inbox, or (``serve``) a synchronous
    consumer called by ``put`` itself: no task, future or wake-up per envelope. A
    served inbox hands over at most ``per_turn`` envelopes per turn of the event loop
    as they are put; the ones after wait here (the same bound and drops) and are
    handed over, in order, ``per_turn`` per later turn.
    """

    __slots__ = ("_items", "_capacity", "_waiter", "closed", "dropped", "_consume", "_per_turn", "_budget",
                 "_loop", "_handing")  # fmt: skip

    def __init__(self, capacity: int = DEFAULT_INBOX) -> None:
        if capacity < 1:
            raise ValueError(f"inbox capacity must be at least 1, not {capacity}")
        self._items: deque[Envelope] = deque()
        self._capacity = capacity
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.dropped = 0
        self._consume: Callable[[Envelope], object] | None = None
        self._per_turn = self._budget = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handing = False  # a hand-over of waiting envelopes is scheduled

    def serve(self, consume: Callable[[Envelope], object], per_turn: int) -> None:
        """From now on ``put`` hands envelopes to ``consume`` (see the class docstring);
        called on the event loop, before anything is put. Do not iterate a served inbox."""
        if per_turn < 1:
            raise ValueError(f"per_turn must be at least 1, not {per_turn}")
        self._consume, self._per_turn, self._budget = consume, per_turn, per_turn
        self._loop = asyncio.get_running_loop()

    def put(self, envelope: Envelope) -> None:
        if self.closed:
            return
        consume = self._consume
        if consume is not None and self._budget and not self._items:
            self._budget -= 1
            if self._budget == self._per_turn - 1:  # the first of this turn: the budget is back next turn
                assert self._loop is not None
                self._loop.call_soon(self._new_turn)
            consume(envelope)
            return
        if len(self._items) >= self._capacity:
            self.dropped += 1
            return
        self._items.append(envelope)
        if consume is None:
            self._wake()
        elif not self._handing:
            self._handing = True
            assert self._loop is not None
            self._loop.call_soon(self._hand_over)

    def _new_turn(self) -> None:
        self._budget = self._per_turn

    def _hand_over(self) -> None:
        """``per_turn`` waiting envelopes to the consumer; the next ones next turn."""
        self._handing = False
        items, consume = self._items, self._consume
        assert consume is not None
        for _ in range(self._per_turn):
            if not items or self.closed:
                return
            consume(items.popleft())
        if items:
            self._handing = True
            assert self._loop is not None
            self._loop.call_soon(self._hand_over)

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __len__(self) -> int:
        return len(self._items)

    async def __aiter__(self) -> AsyncIterator[Envelope]:
        items = self._items
        while True:
            while items:
                yield items.popleft()
            if self.closed:
                return
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class MemoryHub:
    """Where the publishers and subscriptions of one process meet, by topic."""

    def __init__(self) -> None:
        self.topics: dict[str, set[MemorySubscription]] = {}

    def deliver(self, envelope: Envelope) -> None:
        for sub in self.topics.get(envelope.topic, ()):
            sub.inbox.put(envelope)


class MemoryPublisher(Publisher):
    """``seq`` is the sequence number of the last envelope published (0 before any)."""

    def __init__(self, hub: MemoryHub, topic: str, publisher_id: int) -> None:
        self._hub: MemoryHub | None = hub
        self.topic = topic
        self.publisher_id = publisher_id
        self.seq = 0

    def publish(self, payload: bytes) -> None:
        if self._hub is None:
            return
        self.seq += 1
        self._hub.deliver(Envelope(self.publisher_id, self.seq, self.topic, bytes(payload)))

    async def close(self) -> None:
        self._hub = None


class MemorySubscription(Subscription):
    def __init__(self, hub: MemoryHub, topic: str, capacity: int) -> None:
        self._hub = hub
        self.topic = topic
        self.inbox = Inbox(capacity)
        hub.topics.setdefault(topic, set()).add(self)

    def __aiter__(self) -> AsyncIterator[Envelope]:
        return self.inbox.__aiter__()

    async def close(self) -> None:
        subs = self._hub.topics.get(self.topic)
        if subs is not None:
            subs.discard(self)
            if not subs:
                del self._hub.topics[self.topic]
        self.inbox.close()


class MemoryEventPlane(EventPlane):
    """The event plane inside one process; pass one ``hub`` to several planes to connect them."""

    name = "memory"

    def __init__(self, hub: MemoryHub | None = None, inbox_capacity: int = DEFAULT_INBOX) -> None:
        super().__init__()
        self.hub = hub if hub is not None else MemoryHub()
        self.inbox_capacity = inbox_capacity

    async def publisher(self, topic: str, publisher_id: int) -> MemoryPublisher:
        self._check_open()
        check_topic(topic)
        pub = MemoryPublisher(self.hub, topic, publisher_id)
        self._publishers.append(pub)
        return pub

    async def subscribe(self, topic: str) -> MemorySubscription:
        self._check_open()
        check_topic(topic)
        sub = MemorySubscription(self.hub, topic, self.inbox_capacity)
        self._subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        await self._close_owned()
