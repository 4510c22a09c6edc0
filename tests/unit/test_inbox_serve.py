"""A served inbox (``Inbox.serve``): envelopes handed to a synchronous consumer as they
are put, in order, a few per turn of the event loop, the rest waiting under the same
bound; and a KV router served that way ends with the index a router reading the
inbox with a task builds."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from kvmesh.kv.events import BlockRemoved, BlockStored, KvDump, KvEventBatch, KvEventData
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.router.core import RouterSettings
from kvmesh.router.service import KvRouterService
from kvmesh.runtime.event_plane.base import Envelope, Subscription
from kvmesh.runtime.event_plane.memory import Inbox
from kvmesh.runtime.instances import Instance

pytestmark = pytest.mark.timeout(30)

W = 9
enc = msgspec.msgpack.encode


def _env(seq: int, payload: bytes = b"", publisher: int = W) -> Envelope:
    return Envelope(publisher, seq, "kv_events", payload)


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_served_inbox_hands_over_in_order_a_few_per_turn() -> None:
    got: list[int] = []
    inbox = Inbox(capacity=100)
    inbox.serve(lambda e: got.append(e.seq), per_turn=2)
    for seq in range(1, 8):  # one turn: two handed over at once, five wait
        inbox.put(_env(seq))
    assert got == [1, 2] and len(inbox) == 5
    inbox.put(_env(8))  # behind the waiting ones, not before them
    assert got == [1, 2]
    await _turns(1)
    assert got == [1, 2, 3, 4]
    await _turns(10)
    assert got == list(range(1, 9)) and len(inbox) == 0
    inbox.put(_env(9))  # a new turn, nothing waiting: handed over at once
    assert got[-1] == 9


async def test_a_served_inbox_keeps_its_bound_and_stops_on_close() -> None:
    got: list[int] = []
    inbox = Inbox(capacity=3)
    inbox.serve(lambda e: got.append(e.seq), per_turn=1)
    for seq in range(1, 11):
        inbox.put(_env(seq))
    assert got == [1] and len(inbox) == 3 and inbox.dropped == 6
    await _turns(1)
    assert got == [1, 2]
    inbox.close()
    inbox.put(_env(11))
    await _turns(5)
    assert got == [1, 2]  # nothing handed over after close


class _Sub(Subscription):
    """A subscription whose envelopes the test puts in its inbox; served or iterated."""

    def __init__(self, served: bool) -> None:
        self.inbox = Inbox(capacity=10_000)
        if served:
            self.serve = self.inbox.serve

    def __aiter__(self) -> AsyncIterator[Envelope]:
        return self.inbox.__aiter__()

    async def close(self) -> None:
        self.inbox.close()


class _Worker:
    """The repair calls of a worker that starts empty (its first dump: no blocks)."""

    async def _one(self, item: Any, decode: Callable[[msgspec.Raw], Any] | None) -> AsyncIterator[Any]:
        raw = msgspec.Raw(enc(item))
        yield raw if decode is None else decode(raw)

    def stream(self, endpoint: str, payload: bytes, ctx: Any, decode: Any = None) -> AsyncIterator[Any]:
        return self._one(KvDump(W, -1, []), decode)

    async def close(self) -> None:
        pass


def _batches(seed: int) -> tuple[list[bytes], set[int]]:
    """An engine's steps: runs of stores and removals, some repeated, some junk."""
    rng = random.Random(seed)
    held: list[int] = []
    out: list[bytes] = []
    next_id = 0
    for _ in range(300):
        events: list[KvEventData] = []
        for _ in range(rng.randint(1, 12)):
            if held and rng.random() < 0.45:
                gone = rng.sample(held, min(len(held), rng.randint(1, 8)))
                held = [h for h in held if h not in gone]
                events.append(BlockRemoved(gone))
            else:
                new = [rng.getrandbits(64) for _ in range(rng.randint(1, 8))]
                held += new
                events.append(BlockStored(new))
        out.append(enc(KvEventBatch(W, next_id, events)))
        next_id += len(events)
    out.insert(100, b"\x94\xc1")  # junk: rejected, the rest still applied
    return out, set(held)


async def _index_after(served: bool, payloads: list[bytes]) -> tuple[set[int], float, float]:
    metrics = FrontendMetrics()
    sub = _Sub(served)
    router = KvRouterService(RouterSettings(block_size=16), sub, metrics.model("m").router)
    router.start()
    assert (router._reader is None) == served
    engine = EngineConfig("mocker", "m", 2048, 16, 1024, 8, 1024)
    router.add_worker(Instance(InstanceInfo(W, "127.0.0.1:1", engine), _Worker()))  # type: ignore[arg-type]
    while router._repairing:  # its first dump (the test's timeout bounds the wait)
        await asyncio.sleep(0.005)
    for seq, payload in enumerate(payloads, 1):
        sub.inbox.put(_env(seq, payload))
        if seq % 50 == 0:
            await asyncio.sleep(0)
    while len(sub.inbox) or router._repairing:  # all handed over (or read), nothing held
        await asyncio.sleep(0)
    await _turns(5)
    indexer = router.core.indexer
    assert indexer is not None
    blocks = indexer.blocks_of(W)
    applied = metrics.registry.get_sample_value("kvmesh_router_kv_events_applied_total", {"model": "m"}) or 0.0
    malformed = metrics.registry.get_sample_value("kvmesh_router_kv_events_rejected_total", {"model": "m", "reason": "malformed"}) or 0.0
    await router.close()
    return blocks, applied, malformed


async def test_a_served_router_builds_the_index_a_task_reader_builds() -> None:
    payloads, held = _batches(seed=36)
    task_blocks, task_applied, task_bad = await _index_after(False, payloads)
    assert task_blocks == held
    served_blocks, served_applied, served_bad = await _index_after(True, payloads)
    assert task_applied > 1000 and task_bad == 1 and task_blocks  # the workload did something
    assert (served_blocks, served_applied, served_bad) == (task_blocks, task_applied, task_bad)
