"""Engine capabilities (kvmesh.engines.base): an engine implements the Protocols it
supports; the worker serves one without KV capabilities (EchoEngine) aggregated, and
every disaggregation or migration role refuses it with a clear error, never an
AttributeError."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvmesh.config import WorkerConfig
from kvmesh.disagg.engine import DisaggEngine
from kvmesh.disagg.prefill import KvMetadataCache, PrefillWorker
from kvmesh.disagg.queue import LocalPrefillQueue
from kvmesh.disagg.transfer import TcpKvConnector
from kvmesh.engines.base import BatchTuning, Engine, KvBlockAccess, KvEventSource, LoadReporting, kv_blocks
from kvmesh.engines.mocker.engine import MockerEngine
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.sample import EchoEngine
from kvmesh.errors import InvalidArgument
from kvmesh.protocol import DisaggThresholds, OutputChunk, PreprocessedRequest, StopConditions
from kvmesh.runtime.context import Context
from kvmesh.runtime.names import FAULT, GENERATE, KV_DUMP, KV_EVENTS, LOAD, METRICS, TUNE
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.protocol import WorkerMetrics
from kvmesh.worker.disagg import wire
from kvmesh.worker.service import WorkerService

pytestmark = pytest.mark.timeout(60)

CAPABILITIES = (LoadReporting, BatchTuning, KvEventSource, KvBlockAccess)


def _mocker() -> MockerEngine:
    return MockerEngine(MockerOptions(worker_id=1, speedup=1e9, num_blocks=64, vocab_size=2048, eos_token_ids=(2,)))


def test_the_sample_engine_has_the_lifecycle_only_and_the_mocker_every_capability() -> None:
    echo, mocker = EchoEngine(), _mocker()
    assert [isinstance(echo, c) for c in CAPABILITIES] == [False] * 4
    assert [isinstance(mocker, c) for c in CAPABILITIES] == [True] * 4
    # the lifecycle carries no KV stubs any more: nothing to call that would raise "unsupported"
    assert not any(hasattr(Engine, name) for name in ("kv_layout", "kv_reserve", "prefill_remote", "load_report"))


def test_vllm_reports_load_and_kv_events_but_moves_no_blocks() -> None:
    from kvmesh.engines.vllm.engine import VllmEngine

    assert issubclass(VllmEngine, LoadReporting) and issubclass(VllmEngine, KvEventSource)
    assert not issubclass(VllmEngine, KvBlockAccess) and not issubclass(VllmEngine, BatchTuning)


def test_kv_blocks_names_the_role_and_the_engine() -> None:
    mocker = _mocker()
    assert kv_blocks(mocker, "x") is mocker
    with pytest.raises(InvalidArgument, match=r"a prefill worker needs an engine with KV block access.*EchoEngine"):
        kv_blocks(EchoEngine(), "a prefill worker")


@pytest.mark.parametrize("mode", ["aggregated", "decode"])
def test_a_disaggregation_front_refuses_an_engine_without_kv_blocks(mode: str) -> None:
    queue = LocalPrefillQueue(DisaggThresholds())
    with pytest.raises(InvalidArgument, match="KV block access.*EchoEngine has none"):
        DisaggEngine(EchoEngine(), worker_id=1, transfer=None, connector=TcpKvConnector(), mode=mode, queue=queue)


def test_a_prefill_worker_refuses_an_engine_without_kv_blocks() -> None:
    async def nowhere(_worker_id: int) -> None:
        return None

    with pytest.raises(InvalidArgument, match="a prefill worker needs .*EchoEngine has none"):
        PrefillWorker(EchoEngine(), LocalPrefillQueue(DisaggThresholds()), TcpKvConnector(), KvMetadataCache(nowhere))


@pytest.mark.parametrize(
    ("change", "flag"),
    [({"mode": "decode", "prefill_queue": "tcp://127.0.0.1:1"}, "--mode decode"),
     ({"mode": "prefill", "prefill_queue": "tcp://127.0.0.1:1"}, "--mode prefill"),
     ({"drain_migrate": True}, "--drain-migrate")],
)  # fmt: skip
async def test_a_worker_role_that_moves_kv_refuses_an_engine_without_kv_blocks(change: dict[str, object], flag: str) -> None:
    cfg = dataclasses.replace(WorkerConfig(), engine="echo", **change)
    with pytest.raises(ValueError, match=f"{flag} needs an engine that moves KV blocks.*echo does not"):
        await wire(cfg, EchoEngine(), 1)


async def test_an_engine_without_capabilities_is_served_and_says_what_it_lacks() -> None:
    service = WorkerService(EchoEngine(step_delay_s=0))
    await service.start()
    client = TcpClient(service.address)
    try:
        request = PreprocessedRequest(request_id="r", model="echo", token_ids=[5, 6, 7], stop=StopConditions(max_tokens=3))
        payload = msgspec.msgpack.encode(request)
        chunks = [msgspec.msgpack.decode(raw, type=OutputChunk) async for raw in client.stream(GENERATE, payload, Context("t"))]
        assert [t for c in chunks for t in c.token_ids] == [5, 6, 7] and chunks[-1].finish_reason == "length"

        async def call(endpoint: str, body: object) -> list[msgspec.Raw]:
            return [raw async for raw in client.stream(endpoint, msgspec.msgpack.encode(body), Context("t"))]

        for endpoint, body, said in [
            (KV_DUMP, b"", "EchoEngine publishes no KV events"),
            (KV_EVENTS, 0, "EchoEngine publishes no KV events"),
            (LOAD, b"", "EchoEngine does not report its load"),
            (FAULT, "crash", "EchoEngine has no fault injection"),
        ]:
            with pytest.raises(InvalidArgument, match=said):
                await call(endpoint, body)
        # degradation's batch multiplier: accepted, nothing to shrink
        assert [msgspec.msgpack.decode(r, type=float) for r in await call(TUNE, 0.5)] == [0.5]
        (metrics,) = [msgspec.msgpack.decode(r, type=WorkerMetrics) for r in await call(METRICS, b"")]
        assert (metrics.requests, metrics.running, metrics.preemptions, metrics.mode) == (1, 0, 0, "aggregated")
    finally:
        await client.close()
        await service.shutdown(grace_s=1)


def test_a_batching_engine_gives_the_worker_its_load_and_preemptions() -> None:
    engine = _mocker()
    engine.scheduler.preemptions = 3
    metrics = WorkerService(engine).metrics_sample()
    assert (metrics.preemptions, metrics.kv_blocks_total) == (3, 64)
