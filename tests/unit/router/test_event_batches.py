"""KV events in batches: a worker's events of one engine step travel in one
:class:`~kvmesh.kv.events.KvEventBatch` envelope; the router applies a batch with one
decode and per-event ids (stale events skipped, a gap repaired with the rest of the
batch held), and a hostile publisher cannot make it allocate without bound."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.kv.events import (
    MAX_BATCH_BLOCKS,
    MAX_BATCH_EVENTS,
    MAX_EVENT_BLOCKS,
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDump,
    KvEvent,
    KvEventBatch,
    KvEventBatchView,
    KvEventsSince,
    StoredHashes,
    decode_kv_payload,
    decode_kv_view,
)
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.router.core import RouterSettings
from kvmesh.router.service import KvRouterService
from kvmesh.runtime.event_plane.memory import MemoryEventPlane, MemoryPublisher
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import KV_DUMP, KV_EVENTS, KV_EVENTS_TOPIC

pytestmark = pytest.mark.timeout(60)

W = 7
enc = msgspec.msgpack.encode


class FakeWorker:
    """A request-plane client for the router's repair calls: answers ``kv_dump`` and
    ``kv_events`` from what the test says the worker holds."""

    def __init__(self) -> None:
        self.dump = KvDump(W, -1, [])
        self.ring: list[KvEvent] = []
        self.complete = True  # whether the ring reaches back to any id asked for
        self.calls: list[str] = []

    async def _one(self, item: Any, decode: Callable[[msgspec.Raw], Any] | None) -> AsyncIterator[Any]:
        raw = msgspec.Raw(enc(item))
        yield raw if decode is None else decode(raw)

    def stream(self, endpoint: str, payload: bytes, ctx: Any, decode: Any = None) -> AsyncIterator[Any]:
        self.calls.append(endpoint)
        if endpoint == KV_DUMP:
            return self._one(self.dump, decode)
        assert endpoint == KV_EVENTS
        since = msgspec.msgpack.decode(payload, type=int)
        return self._one(KvEventsSince([e for e in self.ring if e.event_id > since], self.complete), decode)

    async def close(self) -> None:
        pass


class Stack:
    def __init__(self) -> None:
        self.plane = MemoryEventPlane()
        self.metrics = FrontendMetrics()
        self.worker = FakeWorker()

    async def start(self) -> None:
        sub = await self.plane.subscribe(KV_EVENTS_TOPIC)
        self.pub: MemoryPublisher = await self.plane.publisher(KV_EVENTS_TOPIC, W)
        self.router = KvRouterService(RouterSettings(block_size=16), sub, self.metrics.model("m").router)
        self.router.start()
        engine = EngineConfig("mocker", "m", 2048, 16, 1024, 8, 1024)
        self.router.add_worker(Instance(InstanceInfo(W, "127.0.0.1:1", engine), self.worker))  # type: ignore[arg-type]
        await until(lambda: not self.router._repairing)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, {"model": "m", **labels}) or 0.0

    def applied(self) -> float:
        return self.sample("kvmesh_router_kv_events_applied_total")

    def rejected(self, reason: str) -> float:
        return self.sample("kvmesh_router_kv_events_rejected_total", reason=reason)

    def blocks(self) -> set[int]:
        indexer = self.router.core.indexer
        assert indexer is not None
        return indexer.blocks_of(W)

    async def close(self) -> None:
        await self.router.close()
        await self.plane.close()


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    s = Stack()
    await s.start()
    try:
        yield s
    finally:
        await s.close()


def _batch_of(n_events: int, hashes_each: int, base: int = 1000) -> bytes:
    events = [BlockStored([base + i * hashes_each + j for j in range(hashes_each)]) for i in range(n_events)]
    return enc(KvEventBatch(W, 0, events))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- attacks


async def test_a_hostile_publisher_cannot_make_the_router_allocate_without_bound(stack: Stack) -> None:
    """Each payload would cost the router tens to hundreds of MiB if it were decoded
    whole before being checked; bounded, the router refuses each with a reason and
    its peak allocation stays a small multiple of MAX_PAYLOAD_BYTES."""
    hostile = [
        # 15 MiB (under zmq's message bound), one event of 3 Mi hashes (the older single-event form)
        ("too_large", enc(KvEvent(W, 0, BlockStored(list(range(1000, 1000 + (3 << 20))))))),
        # under the byte bound, one event of 600 Ki hashes: refused from the list header
        ("too_many_blocks", enc(KvEventBatch(W, 0, [BlockStored([1000 + i % 60_000 for i in range(600_000)])]))),
        # 140 Ki tiny events: refused from the list header
        ("too_many_events", enc(KvEventBatch(W, 0, [AllBlocksCleared()] * 140_000))),
        # negative ids and hashes
        ("malformed", b"\x93\x07\xff\x90"),  # [7, -1, []]
        ("bad_hash", enc(KvEventBatch(W, 0, [BlockStored([5, -3])]))),
    ]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for _, payload in hostile:
            stack.pub.publish(payload)
        want: dict[str, int] = {}
        for reason, _ in hostile:
            want[reason] = want.get(reason, 0) + 1
        await until(lambda: all(stack.rejected(r) >= n for r, n in want.items()))
        assert stack.router.rejected_events == len(hostile)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 16 * MAX_PAYLOAD_BYTES, f"peak {peak / 2**20:.0f} MiB"
    assert stack.applied() == 0 and stack.blocks() == set()
    # the reader goes on: the next honest batch is applied
    stack.pub.publish(enc(KvEventBatch(W, 0, [BlockStored([11, 12]), BlockStored([13])])))
    await until(lambda: stack.blocks() == {11, 12, 13})
    assert not stack.router._reader.done()  # type: ignore[union-attr]


def test_decode_bounds_are_checked_before_allocating() -> None:
    assert len(_batch_of(MAX_BATCH_EVENTS, MAX_BATCH_BLOCKS // MAX_BATCH_EVENTS)) < MAX_PAYLOAD_BYTES
    batch = decode_kv_payload(_batch_of(MAX_BATCH_EVENTS, MAX_BATCH_BLOCKS // MAX_BATCH_EVENTS))
    assert len(batch.events) == MAX_BATCH_EVENTS
    one = decode_kv_payload(enc(KvEvent(W, 5, BlockRemoved([1, 2]))))  # the older form: a batch of one
    assert one == KvEventBatch(W, 5, [BlockRemoved([1, 2])])
    big = enc(KvEventBatch(W, 0, [BlockStored(list(range(MAX_EVENT_BLOCKS + 1)))]))
    tracemalloc.start()
    try:
        with pytest.raises(msgspec.ValidationError):
            decode_kv_payload(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


# ---------------------------------------------------------------------------- the publisher


class Ticks:
    """The loop's call_soon, by hand: ``run()`` ends the current turn."""

    def __init__(self) -> None:
        self.calls: list[Callable[[], None]] = []

    def schedule(self, fn: Callable[[], None]) -> None:
        self.calls.append(fn)

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn in calls:
            fn()


def _publisher(**bounds: int) -> tuple[Any, list[KvEventBatch], Ticks]:
    from kvmesh.runtime.events import BatchingPublisher

    sent: list[KvEventBatch] = []
    ticks = Ticks()
    pub = BatchingPublisher(lambda b: sent.append(decode_kv_payload(b)), lambda b: None, ticks.schedule, **bounds)
    return pub, sent, ticks


def test_one_turn_of_the_loop_is_one_batch() -> None:
    pub, sent, ticks = _publisher()
    for i in range(5):
        pub.publish_kv(KvEvent(W, i, BlockStored([100 + i])))
    assert sent == [] and len(ticks.calls) == 1  # scheduled once, nothing sent inside the turn
    ticks.run()
    assert sent == [KvEventBatch(W, 0, [BlockStored([100 + i]) for i in range(5)])]
    pub.publish_kv(KvEvent(W, 5, AllBlocksCleared()))
    ticks.run()
    assert sent[1] == KvEventBatch(W, 5, [AllBlocksCleared()])
    ticks.run()
    assert len(sent) == 2 and (pub.batches, pub.events) == (2, 6)


def test_a_batch_is_cut_at_its_bounds_and_where_ids_do_not_follow() -> None:
    pub, sent, ticks = _publisher(max_events=3, max_blocks=4)
    events = [
        KvEvent(W, 0, BlockStored([1])),
        KvEvent(W, 1, BlockStored([2])),
        KvEvent(W, 2, BlockRemoved([1])),
        KvEvent(W, 3, BlockStored([3])),  # a 4th event: a new batch
        KvEvent(W, 4, BlockStored([4, 5, 6, 7])),  # 1 + 4 blocks > 4: a new batch
        KvEvent(W, 5, BlockStored(list(range(10, 20)))),  # over max_blocks alone: alone
        KvEvent(W, 9, BlockStored([8])),  # not the next id: a new batch
        KvEvent(W + 1, 10, BlockStored([9])),  # another worker: a new batch
    ]
    for e in events:
        pub.publish_kv(e)
    ticks.run()
    assert [(b.worker_id, b.first_event_id, len(b.events)) for b in sent] == [
        (W, 0, 3), (W, 3, 1), (W, 4, 1), (W, 5, 1), (W, 9, 1), (W + 1, 10, 1)
    ]  # fmt: skip
    flat = [KvEvent(b.worker_id, b.first_event_id + i, d) for b in sent for i, d in enumerate(b.events)]
    assert flat == events


def test_every_full_batch_fits_the_receivers_byte_bound() -> None:
    pub, sent, ticks = _publisher()
    raw: list[bytes] = []
    pub._send_kv = raw.append  # type: ignore[attr-defined]
    big = (1 << 64) - 1  # 9 bytes each in msgpack: the largest encoding
    for i in range(3 * MAX_BATCH_EVENTS):
        n = MAX_BATCH_BLOCKS // MAX_BATCH_EVENTS
        pub.publish_kv(KvEvent(W, i, BlockStored([big - j for j in range(n)], [big - j for j in range(n)], big)))
    ticks.run()
    assert len(raw) == 3
    assert max(map(len, raw)) < MAX_PAYLOAD_BYTES
    assert all(len(decode_kv_payload(r).events) == MAX_BATCH_EVENTS for r in raw)


# ---------------------------------------------------------------------------- the core


def test_apply_batch_skips_stale_events_and_stops_at_a_gap() -> None:
    from kvmesh.router.core import KvRouterCore

    core = KvRouterCore(RouterSettings(block_size=16))
    core.add_worker(W)
    assert core.apply_batch(W, 0, [BlockStored([1]), BlockStored([2])]) == (2, 2)
    assert core.apply_batch(W, 2, [BlockStored([3]), BlockRemoved([1])]) == (2, 2)  # the fast path
    assert core.apply_batch(W, 3, [BlockStored([30]), BlockStored([4]), BlockStored([5])]) == (2, 3)  # 3 is stale
    assert core.apply_batch(W, 7, [BlockStored([7])]) == (0, 0)  # 6 is missing
    assert core.last_event_id(W) == 5
    indexer = core.indexer
    assert indexer is not None and indexer.blocks_of(W) == {2, 3, 4, 5}
    # a restart: event 0 again, after higher ids (the engine's clear)
    assert core.apply_batch(W, 0, [AllBlocksCleared(), BlockStored([9])]) == (2, 2)
    assert indexer.blocks_of(W) == {9}


def test_apply_many_is_apply_in_order() -> None:
    from kvmesh.router.indexer import KvIndexer

    events = [BlockStored([1, 2]), BlockStored([3]), BlockRemoved([2]), BlockStored([2, 4]), AllBlocksCleared(), BlockStored([5])]
    for cut in range(len(events) + 1):
        one, many = KvIndexer(), KvIndexer()
        for data in events[:cut]:
            one.apply(W, data)
        many.apply_many(W, events[:cut])
        assert one.blocks_of(W) == many.blocks_of(W)
        assert one.worker_block_count(W) == many.worker_block_count(W)


# ---------------------------------------------------------------------------- the service


async def test_batches_are_applied_and_a_gap_inside_one_is_repaired(stack: Stack) -> None:
    stack.pub.publish(enc(KvEventBatch(W, 0, [BlockStored([1]), BlockStored([2])])))
    await until(lambda: stack.applied() == 2)
    # events 2..3 are lost; the worker's ring has them
    stack.worker.ring = [KvEvent(W, 2, BlockStored([3])), KvEvent(W, 3, BlockRemoved([1]))]
    # the next batch (ids 4, 5) comes after the loss: held while the ring is read, then applied
    stack.pub.publish(enc(KvEventBatch(W, 4, [BlockStored([5]), BlockStored([6])])))
    await until(lambda: stack.blocks() == {2, 3, 5, 6})
    assert stack.worker.calls.count(KV_EVENTS) == 1
    assert stack.sample("kvmesh_router_kv_event_gaps_total") == 1
    assert stack.router.core.last_event_id(W) == 5
    stack.pub.publish(enc(KvEvent(W, 6, BlockStored([7]))))  # the older single-event form
    await until(lambda: 7 in stack.blocks())
    assert stack.router.rejected_events == 0


def test_apply_many_matches_apply_on_random_batches() -> None:
    import random

    from kvmesh.router.indexer import KvIndexer

    rng = random.Random(5)
    one, many = KvIndexer(), KvIndexer()
    for _ in range(300):
        batch: list[Any] = []
        for _ in range(rng.randrange(1, 12)):
            r = rng.random()
            hashes = [rng.randrange(40) for _ in range(rng.randrange(0, 4))]
            batch.append(AllBlocksCleared() if r < 0.03 else BlockRemoved(hashes) if r < 0.45 else BlockStored(hashes))
        worker = rng.choice((W, W + 1))
        for data in batch:
            one.apply(worker, data)
        many.apply_many(worker, batch)
        for w in (W, W + 1):
            assert many.blocks_of(w) == one.blocks_of(w)
            assert many.worker_block_count(w) == len(many.blocks_of(w))
    assert many.num_blocks == one.num_blocks


def test_apply_many_keeps_the_cap_and_refuses_what_is_not_a_payload() -> None:
    from kvmesh.router.indexer import KvIndexer

    index = KvIndexer(max_blocks_per_worker=8)
    index.apply_many(W, [BlockStored([h]) for h in range(20)])
    assert index.worker_block_count(W) <= 8
    assert index.blocks_of(W) == set(range(20 - index.worker_block_count(W), 20))  # the newest kept
    with pytest.raises(TypeError):
        index.apply_many(W, [object()])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        index.apply_many(W, [BlockStored([-1])])


async def test_events_held_during_a_repair_are_bounded_and_the_loss_is_repaired(stack: Stack) -> None:
    from kvmesh.router.service import MAX_HELD_EVENTS

    release = asyncio.Event()
    answered: list[bytes] = []
    worker = stack.worker
    plain = worker.stream

    async def slow(item: Any, decode: Any) -> AsyncIterator[Any]:  # the repair waits until released
        await release.wait()
        raw = msgspec.Raw(enc(item))
        answered.append(bytes(raw))
        yield decode(raw)

    stack.pub.publish(enc(KvEventBatch(W, 0, [BlockStored([1])])))
    await until(lambda: stack.applied() == 1)
    n = MAX_HELD_EVENTS + 10
    worker.ring = [KvEvent(W, i, BlockStored([1000 + i])) for i in range(1, n + 2)]
    worker.stream = lambda e, p, c, decode=None: slow(  # type: ignore[method-assign]
        KvEventsSince([e for e in worker.ring if e.event_id > msgspec.msgpack.decode(p, type=int)][:1], True), decode
    ) if e == KV_EVENTS else plain(e, p, c, decode)
    stack.pub.publish(enc(KvEventBatch(W, 2, [BlockStored([1002])])))  # event 1 lost: a repair starts
    await until(lambda: W in stack.router._repairing)
    for first in range(3, n + 2, 1000):  # more than MAX_HELD_EVENTS arrive meanwhile
        stack.pub.publish(enc(KvEventBatch(W, first, [BlockStored([1000 + i]) for i in range(first, min(first + 1000, n + 2))])))
    await until(lambda: stack.router.subscription.inbox.__len__() == 0)  # type: ignore[union-attr]
    assert len(stack.router._repairing[W]) <= MAX_HELD_EVENTS
    worker.stream = plain  # type: ignore[method-assign]
    release.set()
    stack.pub.publish(enc(KvEventBatch(W, n + 2, [BlockStored([5])])))  # after the dropped ones: a gap, repaired
    await until(lambda: stack.router.core.last_event_id(W) == n + 2)
    assert stack.blocks() >= {1000 + i for i in range(1, n + 2)} | {5}


async def test_a_failing_repair_is_not_retried_for_every_event(stack: Stack) -> None:
    from kvmesh.errors import CannotConnect

    worker = stack.worker
    plain = worker.stream

    def failing(endpoint: str, payload: bytes, ctx: Any, decode: Any = None) -> AsyncIterator[Any]:
        worker.calls.append(endpoint)
        raise CannotConnect("the worker is gone")

    stack.pub.publish(enc(KvEventBatch(W, 0, [BlockStored([1])])))
    await until(lambda: stack.applied() == 1)
    worker.stream = failing  # type: ignore[method-assign]
    stack.router.repair_backoff_s = 3600.0
    before = len(worker.calls)
    for first in range(5, 105):  # every one of these is after the gap
        stack.pub.publish(enc(KvEventBatch(W, first, [BlockStored([first])])))
    await until(lambda: len(stack.router.subscription.inbox) == 0 and not stack.router._repairing)  # type: ignore[union-attr]
    assert len(worker.calls) - before == 1  # one failed attempt, not one per event
    # once the back-off is over, the next event repairs the worker
    worker.stream = plain  # type: ignore[method-assign]
    worker.complete = False  # its buffer no longer reaches back: a dump
    worker.dump = KvDump(W, 299, [7, 8])
    stack.router.repair_backoff_s = 0.0
    stack.pub.publish(enc(KvEventBatch(W, 300, [BlockStored([9])])))
    await until(lambda: stack.blocks() == {7, 8, 9})
    assert stack.router.core.last_event_id(W) == 300


async def test_a_repair_that_leaves_the_gap_open_is_not_repeated_at_once(stack: Stack) -> None:
    """A worker whose answers never close the gap (its buffer says complete but lacks the
    events; its dump is older than its events) costs one repair per back-off, not a loop."""
    stack.pub.publish(enc(KvEventBatch(W, 0, [BlockStored([1])])))
    await until(lambda: stack.applied() == 1)
    stack.router.repair_backoff_s = 3600.0
    before = len(stack.worker.calls)
    stack.pub.publish(enc(KvEventBatch(W, 50, [BlockStored([2])])))  # ids 1..49 missing, the ring is empty
    await until(lambda: len(stack.router.subscription.inbox) == 0 and not stack.router._repairing)  # type: ignore[union-attr]
    for first in range(51, 60):
        stack.pub.publish(enc(KvEventBatch(W, first, [BlockStored([first])])))
    await until(lambda: len(stack.router.subscription.inbox) == 0 and not stack.router._repairing)  # type: ignore[union-attr]
    assert len(stack.worker.calls) - before == 1


_payload = st.one_of(
    st.builds(BlockStored, st.lists(st.integers(0, 30), max_size=6)),
    st.builds(BlockRemoved, st.lists(st.integers(0, 30), max_size=6)),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(0, 3), st.lists(_payload, max_size=8)), max_size=25))
def test_apply_many_is_apply_with_shared_and_repeated_hashes(batches: list[tuple[int, list[Any]]]) -> None:
    """Runs of one kind of event, one probe per hash: blocks shared by several workers,
    repeated within a run, stored twice or removed when not held, end as ``apply``
    leaves them; the log (which may hold repeats) still drops exactly a worker's blocks."""
    from kvmesh.router.indexer import KvIndexer

    one, many = KvIndexer(), KvIndexer()
    for worker, batch in batches:
        for data in batch:
            one.apply(worker, data)
        many.apply_many(worker, batch)
        for w in range(4):
            assert many.blocks_of(w) == one.blocks_of(w)
            assert many.worker_block_count(w) == one.worker_block_count(w)
        assert many.num_blocks == one.num_blocks
        assert all(many.find_matches([h]) == one.find_matches([h]) for h in range(31))
    for w in range(4):
        many.remove_worker(w)
        one.remove_worker(w)
        assert many.num_blocks == one.num_blocks
    assert many.num_blocks == 0


def test_the_routers_view_of_a_batch_skips_what_it_does_not_use() -> None:
    """decode_kv_view reads the same wire bytes as decode_kv_payload: stored events keep
    their block hashes (checked), their token hashes and parent hash are skipped (not
    built, not checked); the older single-event form and the bounds are the same."""
    full = [BlockStored([1, 2], [3, 4], 9), BlockRemoved([1]), AllBlocksCleared(), BlockStored([5])]
    view = decode_kv_view(enc(KvEventBatch(W, 3, full)))  # type: ignore[arg-type]
    assert view == KvEventBatchView(W, 3, [StoredHashes([1, 2]), BlockRemoved([1]), AllBlocksCleared(), StoredHashes([5])])
    assert decode_kv_payload(enc(KvEventBatch(W, 3, full))).events == full  # type: ignore[arg-type]
    assert decode_kv_view(enc(KvEventBatch(W, 0, [BlockStored([7], [-1])]))).events == [StoredHashes([7])]
    one = decode_kv_view(enc(KvEvent(W, 5, BlockStored([1, 2], [3, 4]))))
    assert (one.worker_id, one.first_event_id, [e.block_hashes for e in one.events]) == (W, 5, [[1, 2]])  # type: ignore[union-attr]
    with pytest.raises(msgspec.ValidationError):
        decode_kv_view(enc(KvEventBatch(W, 0, [BlockStored([5, -3])])))
    with pytest.raises(msgspec.ValidationError):
        decode_kv_view(enc(KvEventBatch(W, 0, [BlockStored(list(range(MAX_EVENT_BLOCKS + 1)))])))
    with pytest.raises(ValueError):
        decode_kv_view(b"\x93" + b"\x00" * (MAX_PAYLOAD_BYTES + 1))
