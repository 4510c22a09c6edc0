"""Many workers in one process (kvmesh.worker.replicas, the supervisor's groups): the
configs each replica and each process gets, and three static replicas served in this
event loop over loopback TCP, each answering as its own worker."""

from __future__ import annotations

import asyncio
import io
import json

import msgspec
import pytest

from kvmesh.config import FrontendConfig, RunConfig, WorkerConfig
from kvmesh.engines.settings import MockerSettings
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.distributed import call
from kvmesh.runtime.names import INFO
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.worker.main import READY_PREFIX
from kvmesh.worker.replicas import replica_config, serve_replicas
from kvmesh.worker.supervisor import processes, slot_config

pytestmark = pytest.mark.timeout(60)


def test_each_replica_gets_its_own_id_and_port_and_no_metrics_port() -> None:
    cfg = WorkerConfig(worker_id=100, port=9000, replicas=3, metrics_port=9100)
    ones = [replica_config(cfg, i) for i in range(3)]
    assert [(c.worker_id, c.port, c.replicas, c.metrics_port) for c in ones] == [
        (100, 9000, 1, None), (101, 9001, 1, None), (102, 9002, 1, None)
    ]  # fmt: skip
    assert {replica_config(WorkerConfig(port=0, replicas=2), i).port for i in range(2)} == {0}  # any free port


def test_processes_hold_the_workers_k_at_a_time() -> None:
    assert processes(5, 2) == 3 and processes(4, 2) == 2 and processes(1, 250) == 1
    slots = [slot_config(WorkerConfig(), s, 5, 2, first_id=10) for s in range(3)]
    assert [(c.worker_id, c.replicas) for c in slots] == [(10, 2), (12, 2), (14, 1)]


def test_workers_per_process_is_for_aggregated_workers_only() -> None:
    with pytest.raises(ValueError, match="--workers-per-process"):
        RunConfig(FrontendConfig(), WorkerConfig(), workers_per_process=2, prefill_workers=1, decode_workers=1)
    with pytest.raises(ValueError, match="--workers-per-process"):
        RunConfig(FrontendConfig(), WorkerConfig(), workers_per_process=0)
    with pytest.raises(ValueError, match="--replicas"):
        WorkerConfig(replicas=0)


async def test_static_replicas_are_each_a_worker_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVMESH_CLUSTER_SECRET", "KVMESH_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    cfg = WorkerConfig(worker_id=7, replicas=3, grace_s=1.0, engine_options=MockerSettings(speedup=1e9, num_blocks=64))
    out = io.StringIO()
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve_replicas(cfg, None, stop, out))
    try:
        while out.getvalue().count(READY_PREFIX) < 3:
            assert not task.done(), task.exception() if task.done() else None
            await asyncio.sleep(0.01)
        cards = [json.loads(line[len(READY_PREFIX) :]) for line in out.getvalue().splitlines()]
        assert sorted(c["lease_id"] for c in cards) == [7, 8, 9]
        assert len({c["address"] for c in cards}) == 3 and len({c["event_address"] for c in cards}) == 3
        for card in cards:  # each endpoint answers as its own worker
            client = TcpClient(card["address"])
            try:
                info = await call(client, INFO, decode=msgspec.msgpack.Decoder(InstanceInfo).decode)
            finally:
                await client.close()
            assert info is not None and info.worker_id == card["lease_id"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
