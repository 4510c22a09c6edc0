"""The in-process event plane: delivery, sequence numbers, gap detection, bounded inboxes, close."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvmesh.protocol import LoadReport
from kvmesh.runtime.event_plane import GapTracker, MemoryEventPlane, MemoryHub, make_event_plane


async def _take(sub, n: int, timeout: float = 2.0) -> list:
    async def take():
        out = []
        async for env in sub:
            out.append(env)
            if len(out) == n:
                return out
        return out

    return await asyncio.wait_for(take(), timeout)


def _report(i: int) -> bytes:
    return msgspec.msgpack.encode(LoadReport(worker_id=7, active_blocks=i, total_blocks=64, num_waiting=0, num_running=1))


async def test_delivers_typed_payloads_in_order_with_increasing_seq():
    plane = MemoryEventPlane()
    sub = await plane.subscribe("load")
    pub = await plane.publisher("load", publisher_id=7)
    for i in range(5):
        pub.publish(_report(i))
    envs = await _take(sub, 5)
    assert [e.seq for e in envs] == [1, 2, 3, 4, 5]
    assert {e.publisher_id for e in envs} == {7} and {e.topic for e in envs} == {"load"}
    reports = [msgspec.msgpack.decode(e.payload, type=LoadReport) for e in envs]
    assert [r.active_blocks for r in reports] == [0, 1, 2, 3, 4]
    assert pub.address == ""
    await plane.close()


async def test_planes_sharing_a_hub_meet_and_topics_are_separate():
    hub = MemoryHub()
    worker, router = MemoryEventPlane(hub), make_event_plane("memory", hub=hub)
    kv = await router.subscribe("kv")
    load = await router.subscribe("load")
    (await worker.publisher("kv", 1)).publish(b"k")
    (await worker.publisher("load", 1)).publish(b"l")
    assert [e.payload for e in await _take(kv, 1)] == [b"k"]
    assert [e.payload for e in await _take(load, 1)] == [b"l"]
    await worker.close()
    await router.close()
    assert hub.topics == {}


async def test_every_subscriber_gets_every_publisher_and_seq_is_per_publisher():
    plane = MemoryEventPlane()
    subs = [await plane.subscribe("kv") for _ in range(3)]
    a, b = await plane.publisher("kv", 1), await plane.publisher("kv", 2)
    for _ in range(3):
        a.publish(b"a")
    b.publish(b"b")
    for sub in subs:
        envs = await _take(sub, 4)
        assert [(e.publisher_id, e.seq) for e in envs] == [(1, 1), (1, 2), (1, 3), (2, 1)]
    await plane.close()


async def test_gap_tracker_sees_skipped_sequence_numbers():
    plane = MemoryEventPlane()
    sub = await plane.subscribe("kv")
    pub = await plane.publisher("kv", 3)
    pub.publish(b"1")
    pub.seq += 4  # four messages "lost" on the way
    pub.publish(b"6")
    tracker = GapTracker()
    assert [tracker.observe(e) for e in await _take(sub, 2)] == [0, 4]
    await plane.close()


async def test_a_full_inbox_drops_and_the_gap_is_visible():
    plane = MemoryEventPlane(inbox_capacity=10)
    sub = await plane.subscribe("kv")
    pub = await plane.publisher("kv", 1)
    for _ in range(25):  # nobody reads meanwhile: publish must not block
        pub.publish(b"x")
    assert sub.inbox.dropped == 15
    tracker = GapTracker()
    envs = await _take(sub, 10)
    assert sum(tracker.observe(e) for e in envs) == 0 and envs[-1].seq == 10
    pub.publish(b"last")
    (last,) = await _take(sub, 1)
    assert last.seq == 26 and tracker.observe(last) == 15


async def test_restarted_publisher_is_not_a_gap():
    plane = MemoryEventPlane()
    sub = await plane.subscribe("kv")
    first = await plane.publisher("kv", 9)
    first.publish(b"a")
    first.publish(b"b")
    await first.close()
    first.publish(b"after close")  # ignored, never raises
    (await plane.publisher("kv", 9)).publish(b"again")
    tracker = GapTracker()
    envs = await _take(sub, 3)
    assert [e.payload for e in envs] == [b"a", b"b", b"again"]
    assert [tracker.observe(e) for e in envs] == [0, 0, 0]
    await plane.close()


async def test_close_ends_iteration_and_stops_delivery():
    plane = MemoryEventPlane()
    sub = await plane.subscribe("kv")
    pub = await plane.publisher("kv", 1)
    pub.publish(b"before")

    async def drain():
        return [e.payload async for e in sub]

    reader = asyncio.ensure_future(drain())
    await asyncio.sleep(0)
    await plane.close()
    assert await asyncio.wait_for(reader, 1) == [b"before"]
    pub.publish(b"after")  # a closed plane's publisher is inert
    with pytest.raises(RuntimeError, match="closed"):
        await plane.subscribe("kv")


async def test_bad_topics_and_kinds_are_value_errors():
    plane = MemoryEventPlane()
    for topic in ("", "a b", "kv.*", "kv.>", ".kv", "kv.", "a..b"):
        with pytest.raises(ValueError, match="topic"):
            await plane.publisher(topic, 1)
    with pytest.raises(ValueError, match="unknown event plane 'kafka'"):
        make_event_plane("kafka")
    with pytest.raises(ValueError, match="nats_client"):
        make_event_plane("nats")
    with pytest.raises(ValueError, match="hub"):
        make_event_plane("zmq", hub=MemoryHub())
    await plane.close()
