"""A worker's role (worker/disagg.wire): the disaggregation front goes in front of the
engine's generate without wrapping it, and a KV-transfer port opens only where KV
leaves the worker (decode workers, --drain-migrate)."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.config import WorkerConfig
from kvmesh.engines.mocker.engine import MockerEngine
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.sample import EchoEngine
from kvmesh.worker.disagg import wire


def _mocker() -> MockerEngine:
    return MockerEngine(MockerOptions(worker_id=1, speedup=1e9, num_blocks=64, vocab_size=2048, eos_token_ids=(2,)))


async def test_an_aggregated_worker_receives_kv_but_opens_no_transfer_port() -> None:
    from kvmesh.disagg.engine import DisaggEngine
    from kvmesh.protocol import DisaggregatedParams, PreprocessedRequest
    from kvmesh.runtime.context import Context
    from kvmesh.worker.disagg import OnDemandFront

    engine = _mocker()
    cfg = dataclasses.replace(WorkerConfig(), max_local_prefill_length=77)
    roles = await wire(cfg, engine, 1)
    assert roles.engine is engine  # served as it is: load reports, faults, KV dumps reach it directly
    front = roles.disagg
    assert isinstance(front, OnDemandFront) and front.inner is engine and front.front is None
    assert roles.kv_endpoint() is None and roles.stats() is not None and roles.stats().mode == "aggregated"
    request = PreprocessedRequest("r", "m", [5, 6, 7], disaggregated_params=DisaggregatedParams(kind="kv_source"))
    stream = front.generate(request, Context("r"))  # a request that brings KV builds the real front, once
    built = front.front
    assert isinstance(built, DisaggEngine) and built.inner is engine and built.transfer is None
    assert built.thresholds.max_local_prefill_length == 77 and built.worker_id == 1
    await stream.aclose()  # type: ignore[attr-defined]
    assert roles.kv_endpoint() is None and roles.stats() is built.disagg_stats()
    assert built.hand_off_all() == 0


async def test_an_aggregated_request_without_kv_goes_to_the_engine_and_builds_nothing() -> None:
    from kvmesh.protocol import PreprocessedRequest, StopConditions
    from kvmesh.runtime.context import Context
    from kvmesh.worker.disagg import OnDemandFront

    engine = _mocker()
    await engine.start()
    try:
        front = (await wire(WorkerConfig(), engine, 1)).disagg
        assert isinstance(front, OnDemandFront)
        request = PreprocessedRequest("r", "m", [5, 6, 7], stop=StopConditions(max_tokens=3))
        chunks = [c async for c in front.generate(request, Context("r"))]
        assert chunks[-1].finish_reason is not None and front.front is None
    finally:
        await engine.cleanup()


async def test_a_draining_worker_that_hands_kv_off_has_a_transfer_port() -> None:
    engine = _mocker()
    roles = await wire(dataclasses.replace(WorkerConfig(), drain_migrate=True), engine, 1)
    assert roles.disagg is not None and roles.disagg.transfer is not None
    await engine.start()
    await roles.disagg.open()
    try:
        endpoint = roles.kv_endpoint()
        assert endpoint is not None and endpoint.address.startswith("127.0.0.1:")
    finally:
        await roles.disagg.close()
        await engine.cleanup()


async def test_an_engine_without_kv_access_gets_no_front() -> None:
    roles = await wire(WorkerConfig(), EchoEngine(), 1)  # the engine, not the config, decides
    assert roles.disagg is None


async def test_a_decode_front_needs_a_transfer_server() -> None:
    from kvmesh.disagg.engine import DisaggEngine
    from kvmesh.disagg.queue import LocalPrefillQueue
    from kvmesh.disagg.transfer import TcpKvConnector
    from kvmesh.protocol import DisaggThresholds

    with pytest.raises(ValueError, match="KV-transfer server"):
        DisaggEngine(_mocker(), worker_id=1, transfer=None, connector=TcpKvConnector(), mode="decode",
                     queue=LocalPrefillQueue(DisaggThresholds()))  # fmt: skip
