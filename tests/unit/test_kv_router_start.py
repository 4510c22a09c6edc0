"""Workers attaching at once to a frontend in kv mode share one KV router.

Discovery attaches every new instance in its own task; the first ones find no KV router
for the model yet and start one, and starting it awaits the event plane's subscribe
(NATS really waits for its server). Before, every attach that arrived meanwhile started a
router of its own, the last one won, and the workers added to the others were missing
from it: their KV events were rejected as from unknown workers, they were never picked,
and every decision scored the whole fleet (seen with 1,000 workers on NATS)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.config import FrontendConfig
from kvmesh.errors import CannotConnect
from kvmesh.frontend.models import ModelRegistry
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.preprocess.model import bundled_model_path
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.runtime.event_plane.memory import MemoryEventPlane, MemorySubscription

pytestmark = pytest.mark.timeout(30)


class _SlowSubscribe(MemoryEventPlane):
    """Subscribing takes a few passes of the loop, as a round trip to NATS does."""

    async def subscribe(self, topic: str) -> MemorySubscription:
        for _ in range(5):
            await asyncio.sleep(0)
        return await super().subscribe(topic)


class _NoWorker:
    """A request-plane client with nobody behind it: the routers' KV dump requests fail."""

    def stream(self, *args: object, **kwargs: object) -> object:
        raise CannotConnect("no worker behind this test record")

    async def close(self) -> None:
        pass


async def test_workers_attaching_at_once_share_one_kv_router() -> None:
    registry = ModelRegistry(FrontendConfig(router_mode="kv", canary_interval_s=0), FrontendMetrics(), _SlowSubscribe())
    path = str(bundled_model_path())
    engine = EngineConfig("mocker", "kvmesh-tiny", 2048, 16, 1024, 8, 1024)
    infos = [InstanceInfo(w, f"127.0.0.1:{9000 + w}", engine, path) for w in range(1, 21)]
    try:
        await asyncio.gather(*(registry.attach(info, _NoWorker()) for info in infos))  # type: ignore[arg-type]
        entry = registry.get("kvmesh-tiny")
        assert entry.kv is not None
        assert sorted(entry.kv.workers) == list(range(1, 21))
        assert sorted(entry.instances.ids) == list(range(1, 21))
    finally:
        await registry.close()
