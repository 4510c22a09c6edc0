"""A flood of events on the zmq event plane (1,000 busy workers publish hundreds of
thousands per second) must not hold the subscriber's event loop: its reader takes what
is queued in batches and lets the inbox's consumer run between them, so a small inbox
never overflows while a consumer keeps up."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp

import msgspec
import pytest
import zmq

from kvmesh.runtime.event_plane.base import Envelope
from kvmesh.runtime.event_plane.zmq import ZmqEventPlane

pytestmark = pytest.mark.timeout(60)

MESSAGES = 60_000


def _flood(conn, count: int) -> None:  # type: ignore[no-untyped-def]
    """A separate process: one PUB socket sending ``count`` envelopes as fast as it can."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)  # no limit: every message queues for the subscriber
    sock.bind("tcp://127.0.0.1:*")
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    conn.recv()  # the subscriber is connected
    encode = msgspec.msgpack.encode
    for seq in range(1, count + 1):
        sock.send(encode(Envelope(1, seq, "kv_events", b"x" * 32)))
    conn.send("sent")
    conn.recv()
    sock.close(linger=0)
    ctx.term()


async def test_a_flood_leaves_the_consumer_its_turns_and_the_inbox_drops_nothing() -> None:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_flood, args=(child, MESSAGES), daemon=True)
    proc.start()
    plane = ZmqEventPlane("127.0.0.1", secret=None, inbox_capacity=1000)
    try:
        sub = await plane.subscribe("kv_events")
        sub.connect(await asyncio.to_thread(parent.recv))
        got, last = 0, 0
        parent.send("go")

        async def consume() -> None:
            nonlocal got, last
            async for envelope in sub:
                assert envelope.seq > last  # in order, none twice
                last = envelope.seq
                got += 1
                if last == MESSAGES:
                    return

        with contextlib.suppress(TimeoutError):  # with drops the last one never comes: the asserts say why
            await asyncio.wait_for(consume(), 20)
        assert sub.inbox.dropped == 0
        assert last == MESSAGES
        assert got >= MESSAGES * 0.9  # the first ones may precede zmq's subscription
    finally:
        parent.send("done")
        proc.join(10)
        await plane.close()


async def test_a_trickle_arrives_whole_and_close_stops_reading() -> None:
    """The subscription reads its socket from a callback on zmq's descriptor, which
    signals edges: each message of a trickle (one at a time, the reader idle between
    them) must still arrive without waiting for the next one; after close, the
    descriptor is no longer watched and publishing on reaches nothing."""
    plane = ZmqEventPlane("127.0.0.1", secret=None)
    try:
        pub = await plane.publisher("kv_events", 1)
        sub = await plane.subscribe("kv_events")
        sub.connect(pub.address)
        for _ in range(500):  # zmq drops what a PUB sends before the subscription is joined
            pub.publish(b"probe")
            await asyncio.sleep(0.01)
            if len(sub.inbox):
                break
        else:
            raise AssertionError("the subscription never joined")
        it = sub.__aiter__()
        while len(sub.inbox):
            assert (await it.__anext__()).payload == b"probe"
        first = pub.seq + 1
        for n in range(first, first + 50):
            pub.publish(msgspec.msgpack.encode(n))
            envelope = await asyncio.wait_for(it.__anext__(), 10)  # this one, not after the next
            while envelope.payload == b"probe":  # a late probe of the join
                envelope = await asyncio.wait_for(it.__anext__(), 10)
            assert msgspec.msgpack.decode(envelope.payload) == n
        fd = sub._fd
        await sub.close()
        assert sub._fd is None
        assert fd is not None and not asyncio.get_running_loop().remove_reader(fd)  # already removed
        pub.publish(b"after")
        await asyncio.sleep(0.05)
        assert len(sub.inbox) == 0
    finally:
        await plane.close()
