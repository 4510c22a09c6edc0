"""The zmq and nats event planes over loopback (nats against a real nats-server):
typed payloads, per-publisher sequence numbers, gaps seen by GapTracker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest

from kvmesh.protocol import LoadReport
from kvmesh.runtime.event_plane import Envelope, GapTracker, NatsEventPlane, ZmqEventPlane, make_event_plane
from kvmesh.runtime.nats import connect_nats

PROBE = b"probe"


def _report(i: int) -> bytes:
    return msgspec.msgpack.encode(LoadReport(worker_id=3, active_blocks=i, total_blocks=128, num_waiting=i % 2, num_running=1))


class Collector:
    """Reads a subscription in a task of its own; tests wait on what it has seen."""

    def __init__(self, sub) -> None:
        self.envelopes: list[Envelope] = []
        self._task = asyncio.ensure_future(self._run(sub))

    async def _run(self, sub) -> None:
        async for env in sub:
            self.envelopes.append(env)

    def payloads(self) -> list[bytes]:
        return [e.payload for e in self.envelopes if e.payload != PROBE]

    async def wait(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not seen within {timeout} s; got {len(self.envelopes)} envelopes")
            await asyncio.sleep(0.005)

    async def quiet(self, for_s: float = 0.3, timeout: float = 10.0) -> None:
        """Wait until nothing new arrived for ``for_s``."""
        deadline = time.monotonic() + timeout
        seen = -1
        while seen != len(self.envelopes) and time.monotonic() < deadline:
            seen = len(self.envelopes)
            await asyncio.sleep(for_s)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def _join(pub, sub, collector: Collector) -> None:
    """Connect ``sub`` to ``pub`` and publish probes until one arrives (zmq subscriptions
    are live only after the connection handshake; nats ones when ``subscribe`` returns)."""
    sub.connect(pub.address)
    start = len(collector.envelopes)
    deadline = time.monotonic() + 30
    while not any(e.payload == PROBE and e.publisher_id == pub.publisher_id for e in collector.envelopes[start:]):
        if time.monotonic() > deadline:
            raise AssertionError("the subscription never joined")
        pub.publish(PROBE)
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _planes(kind: str, nats_url: str | None = None, **options) -> AsyncIterator[tuple]:
    """(publishing plane, subscribing plane): two planes, as in two processes."""
    if kind == "zmq":
        planes = (ZmqEventPlane(**options), ZmqEventPlane(**options))
        clients = []
    else:
        clients = [await connect_nats(nats_url), await connect_nats(nats_url)]
        planes = (NatsEventPlane(clients[0], "ns", **options), make_event_plane("nats", nats_client=clients[1], namespace="ns"))
    try:
        yield planes
    finally:
        for plane in planes:
            await plane.close()
        for nc in clients:
            await nc.close()


@pytest.fixture(params=["zmq", "nats"])
def kind(request):
    return request.param


@pytest.fixture
def nats_url(kind, request):
    if kind != "nats":
        return None
    return request.getfixturevalue("nats").url


async def test_typed_payloads_arrive_in_order_with_increasing_seq(kind, nats_url):
    async with _planes(kind, nats_url) as (worker, router):
        sub = await router.subscribe("load")
        seen = Collector(sub)
        pub = await worker.publisher("load", publisher_id=42)
        assert pub.address.startswith("tcp://127.0.0.1:") if kind == "zmq" else pub.address == ""
        await _join(pub, sub, seen)
        for i in range(50):
            pub.publish(_report(i))
        await seen.wait(lambda: len(seen.payloads()) == 50)
        reports = [msgspec.msgpack.decode(p, type=LoadReport) for p in seen.payloads()]
        assert [r.active_blocks for r in reports] == list(range(50))
        assert all(r.total_blocks == 128 and r.worker_id == 3 for r in reports)
        seqs = [e.seq for e in seen.envelopes]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[-1] == pub.seq
        assert {(e.publisher_id, e.topic) for e in seen.envelopes} == {(42, "load")}
        await seen.close()


async def test_subscriber_hears_every_publisher_of_its_topic_only(kind, nats_url):
    async with _planes(kind, nats_url) as (worker, router):
        kv = await router.subscribe("kv")
        seen = Collector(kv)
        a, b = await worker.publisher("kv", 1), await worker.publisher("kv", 2)
        other = await worker.publisher("load", 1)
        for pub in (a, b):
            await _join(pub, kv, seen)
        kv.connect(other.address)  # zmq: a publisher of another topic is filtered out too
        for i in range(10):
            a.publish(b"a%d" % i)
            b.publish(b"b%d" % i)
            other.publish(b"load")
        await seen.wait(lambda: len(seen.payloads()) == 20)
        await seen.quiet(0.1)
        assert sorted(seen.payloads()) == sorted([b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(10)])
        tracker = GapTracker()
        assert sum(tracker.observe(e) for e in seen.envelopes) == 0
        await seen.close()


async def test_skipped_sequence_numbers_are_a_gap(kind, nats_url):
    async with _planes(kind, nats_url) as (worker, router):
        sub = await router.subscribe("kv")
        seen = Collector(sub)
        pub = await worker.publisher("kv", 5)
        await _join(pub, sub, seen)
        pub.publish(b"before")
        pub.seq += 7  # seven envelopes lost on the way
        pub.publish(b"after")
        await seen.wait(lambda: seen.payloads()[-1:] == [b"after"])
        tracker = GapTracker()
        gaps = [tracker.observe(e) for e in seen.envelopes if e.payload != PROBE]
        assert gaps == [0, 7]
        await seen.close()


async def test_zmq_publishing_while_disconnected_is_a_gap():
    async with _planes("zmq") as (worker, router):
        sub = await router.subscribe("kv")
        seen = Collector(sub)
        pub = await worker.publisher("kv", 8)
        await _join(pub, sub, seen)
        sub.disconnect(pub.address)
        sub.disconnect(pub.address)  # twice: a no-op
        await _until_cut(pub, seen)  # zmq tears the connection down in the background
        for _ in range(5):
            pub.publish(b"lost")
        await _join(pub, sub, seen)  # reconnect
        pub.publish(b"back")
        await seen.wait(lambda: seen.payloads()[-1:] == [b"back"])
        assert b"lost" not in seen.payloads()
        tracker = GapTracker()
        gaps = [tracker.observe(e) for e in seen.envelopes]
        assert sum(gaps) >= 5
        await seen.close()


async def _until_cut(pub, seen: Collector) -> None:
    """Publish probes until one is not delivered: the connection is down (a probe's
    envelope in flight arrives within ``quiet``'s window)."""
    deadline = time.monotonic() + 30
    while True:
        before = len(seen.envelopes)
        pub.publish(PROBE)
        await seen.quiet()
        if len(seen.envelopes) == before:
            return
        assert time.monotonic() < deadline, "the subscription was never cut"


async def _burst_then_marker(pub, seen: Collector, count: int, size: int) -> None:
    payload = b"x" * size
    for _ in range(count):  # one synchronous burst: nobody reads meanwhile
        pub.publish(payload)
    await seen.quiet()
    deadline = time.monotonic() + 30
    while seen.payloads()[-1:] != [b"end"]:  # the marker itself may be dropped: retry
        assert time.monotonic() < deadline, "the end marker never arrived"
        pub.publish(b"end")
        await asyncio.sleep(0.05)


def _accounted(envelopes: list[Envelope]) -> tuple[int, int]:
    """(missing according to GapTracker, missing according to the sequence numbers)."""
    tracker = GapTracker()
    missing = sum(tracker.observe(e) for e in envelopes)
    first, last = envelopes[0].seq, envelopes[-1].seq
    return missing, last - first + 1 - len(envelopes)


async def test_zmq_high_water_mark_drops_and_every_drop_is_a_gap():
    async with _planes("zmq", hwm=50, inbox_capacity=50) as (worker, router):
        sub = await router.subscribe("kv")
        seen = Collector(sub)
        pub = await worker.publisher("kv", 9)
        await _join(pub, sub, seen)
        await _burst_then_marker(pub, seen, count=20_000, size=1024)  # a blocked publisher: the test's timeout
        missing, expected = _accounted(seen.envelopes)
        assert missing == expected > 0
        assert len(seen.envelopes) < 20_000
        await seen.close()


async def test_nats_publisher_queue_overflow_drops_and_every_drop_is_a_gap(nats):
    async with _planes("nats", nats.url, queue_limit=10) as (worker, router):
        sub = await router.subscribe("kv")
        seen = Collector(sub)
        pub = await worker.publisher("kv", 4)
        for _ in range(50):  # synchronous: the sender task cannot run meanwhile
            pub.publish(b"x")
        assert pub.dropped == 40
        await seen.wait(lambda: len(seen.envelopes) == 10)
        pub.publish(b"end")
        await seen.wait(lambda: seen.payloads()[-1:] == [b"end"])
        missing, expected = _accounted(seen.envelopes)
        assert missing == expected == 40
        await seen.close()


async def test_nats_plane_survives_a_closed_client(nats):
    nc = await connect_nats(nats.url)
    plane = NatsEventPlane(nc, "ns")
    pub = await plane.publisher("kv", 1)
    sub = await plane.subscribe("kv")
    await nc.close()
    pub.publish(b"x")  # never raises into the caller
    deadline = time.monotonic() + 30
    while pub.dropped < 1:  # the sender task finds the client closed
        assert time.monotonic() < deadline, "the send to a closed client was not counted as dropped"
        await asyncio.sleep(0.01)
    assert pub.dropped == 1
    await plane.close()
    assert [e async for e in sub] == []


async def test_close_ends_subscriptions_and_publishing_after_close_is_inert(kind, nats_url):
    async with _planes(kind, nats_url) as (worker, router):
        sub = await router.subscribe("kv")
        pub = await worker.publisher("kv", 1)
        reader = asyncio.ensure_future(_drain(sub))
        await asyncio.sleep(0.01)
        await router.close()
        assert isinstance(await asyncio.wait_for(reader, 30), list)
        await worker.close()
        pub.publish(b"after close")
        with pytest.raises(RuntimeError, match="closed"):
            await worker.publisher("kv", 2)


async def _drain(sub) -> list[Envelope]:
    return [e async for e in sub]


def test_nats_namespace_must_be_one_subject_token():
    with pytest.raises(ValueError, match="namespace"):
        NatsEventPlane(None, "a.b")  # type: ignore[arg-type]
