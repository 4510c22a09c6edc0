"""The KV router keeps an exact view of a worker's cache through lost events: a gap in
the event ids is repaired from the worker's event buffer, or from a full dump when the
buffer no longer reaches back; a new worker's warm cache is loaded from its dump."""

from __future__ import annotations

import asyncio

import msgspec

from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.protocol import InstanceInfo, KvEvent, LoadReport, OutputChunk, PreprocessedRequest, StopConditions
from kvmesh.router.core import RouterSettings
from kvmesh.router.service import KvRouterService
from kvmesh.runtime.context import Context
from kvmesh.runtime.event_plane.memory import MemoryEventPlane
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import GENERATE, KV_EVENTS_TOPIC
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.worker.service import WorkerService

WORKER = 7
BLOCK = 16


class LossyPublisher:
    """Publishes KV events on the plane but loses the ones whose ids are in ``drop``."""

    def __init__(self, publisher, drop: set[int]) -> None:
        self._publisher = publisher
        self.drop = drop

    def publish_kv(self, event: KvEvent) -> None:
        if event.event_id not in self.drop:
            self._publisher.publish(msgspec.msgpack.encode(event))

    def publish_load(self, report: LoadReport) -> None:
        pass


async def _generate(client: TcpClient, seed: int) -> None:
    prompt = [(seed * 131 + i) % 1900 + 100 for i in range(3 * BLOCK + 5)]
    req = PreprocessedRequest(
        request_id=str(seed), model="m", token_ids=prompt, stop=StopConditions(max_tokens=BLOCK + 2, ignore_eos=True)
    )
    decode = msgspec.msgpack.Decoder(OutputChunk).decode
    async for _ in client.stream(GENERATE, msgspec.msgpack.encode(req), Context(str(seed)), decode=decode):
        pass


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _stack(drop: set[int], ring: int, warm: int = 0):
    plane = MemoryEventPlane()
    lossy = LossyPublisher(await plane.publisher(KV_EVENTS_TOPIC, WORKER), drop)
    opts = MockerOptions(speedup=1e9, worker_id=WORKER, block_size=BLOCK, event_ring_capacity=ring, eos_rate=0.0)
    engine = MockerEngine(opts, lossy)
    service = WorkerService(engine)
    config = await service.start()
    client = TcpClient(service.address)
    for seed in range(warm):  # cache filled before the router knows the worker
        await _generate(client, 1000 + seed)
    metrics = FrontendMetrics()
    router = KvRouterService(RouterSettings(block_size=BLOCK), await plane.subscribe(KV_EVENTS_TOPIC), metrics.model("m").router)
    router.start()
    router.add_worker(Instance(InstanceInfo(WORKER, service.address, config), client))
    return plane, engine, service, client, router, metrics


def _indexed(router: KvRouterService) -> set[int]:
    return router.core.indexer.blocks_of(WORKER)


async def _close(plane, service, client, router) -> None:
    await router.close()
    await client.close()
    await service.shutdown(grace_s=1)
    await plane.close()


async def test_new_worker_cache_is_loaded_from_its_dump():
    plane, engine, service, client, router, metrics = await _stack(drop=set(), ring=1024, warm=5)
    try:
        await _until(lambda: _indexed(router) == engine.kv_dump() and engine.kv_dump())
        assert metrics.registry.get_sample_value("kvmesh_router_kv_repairs_total", {"model": "m", "method": "dump"}) == 1
    finally:
        await _close(plane, service, client, router)


async def test_gap_is_repaired_from_the_worker_buffer():
    plane, engine, service, client, router, metrics = await _stack(drop={3, 4}, ring=1024)
    try:
        for seed in range(12):
            await _generate(client, seed)
        await _until(lambda: _indexed(router) == engine.kv_dump())
        assert metrics.registry.get_sample_value("kvmesh_router_kv_event_gaps_total", {"model": "m"}) >= 1
        assert metrics.registry.get_sample_value("kvmesh_router_kv_repairs_total", {"model": "m", "method": "buffer"}) >= 1
    finally:
        await _close(plane, service, client, router)


async def test_gap_past_the_buffer_is_repaired_from_a_dump():
    # the ring keeps 2 events: by the time the gap is seen, the lost ones are gone
    plane, engine, service, client, router, metrics = await _stack(drop=set(range(3, 9)), ring=2)
    try:
        for seed in range(12):
            await _generate(client, seed)
        await _until(lambda: _indexed(router) == engine.kv_dump())
        dumps = metrics.registry.get_sample_value("kvmesh_router_kv_repairs_total", {"model": "m", "method": "dump"})
        assert dumps >= 2  # the initial load, then the repair
    finally:
        await _close(plane, service, client, router)
