"""The KV router's admission queue leaves in weighted fair order across tenants
(router/service.py with router/fair.py): a tenant that queued ten requests does not
hold back another tenant's one."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.config import FrontendConfig
from kvmesh.errors import CannotConnect
from kvmesh.frontend.models import ModelRegistry
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.preprocess.model import bundled_model_path
from kvmesh.protocol import EngineConfig, InstanceInfo, PreprocessedRequest, RoutingHints, StopConditions
from kvmesh.runtime.event_plane.memory import MemoryEventPlane

pytestmark = pytest.mark.timeout(30)


class _NoWorker:
    def stream(self, *args: object, **kwargs: object) -> object:
        raise CannotConnect("no worker behind this test record")

    async def close(self) -> None:
        pass


def _request(rid: str, tenant: str | None) -> PreprocessedRequest:
    hints = RoutingHints(tenant=tenant) if tenant is not None else None
    return PreprocessedRequest(rid, "kvmesh-tiny", list(range(200)), stop=StopConditions(max_tokens=10), routing=hints)


async def test_a_light_tenant_leaves_the_queue_before_a_heavy_ones_backlog() -> None:
    config = FrontendConfig(router_mode="kv", canary_interval_s=0, admission_threshold=0.01)
    registry = ModelRegistry(config, FrontendMetrics(), MemoryEventPlane())
    engine = EngineConfig("mocker", "kvmesh-tiny", 2048, 16, 1024, 8, 1024)
    try:
        await registry.attach(InstanceInfo(1, "127.0.0.1:9001", engine, str(bundled_model_path())), _NoWorker())  # type: ignore[arg-type]
        service = registry.get("kvmesh-tiny").kv
        assert service is not None
        service.route(_request("busy", None), [1])  # its prefill makes the only worker busy
        order: list[str] = []

        async def wait(rid: str, tenant: str) -> None:
            await service.admit(_request(rid, tenant))
            order.append(rid)

        tasks = [asyncio.ensure_future(wait(f"a{i}", "A")) for i in range(10)]
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(wait("b0", "B")))
        await asyncio.sleep(0)
        assert order == [] and len(service._waiting) == 11
        service.first_token("busy")  # the worker is free: one waiter leaves per event
        for _ in range(10):
            await asyncio.sleep(0)
            service._admit_waiting()
        await asyncio.gather(*tasks)
        assert order.index("b0") <= 1, order  # FCFS would have served it last
    finally:
        await registry.close()
