"""``kvmesh planner`` on a distributed fleet (file discovery, real processes): two
serving workers, one ``kvmesh worker --standby`` (running, checked, not routed to),
the planner holding one hot spare. A serving worker is SIGKILLed; its record goes with
its lease; the planner orders the standby to serve (a signed order in discovery) and
the frontend routes to it. Conditions are waited on; no wall-clock asserts."""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from kvmesh.observability.metrics_server import metrics_token
from kvmesh.runtime.auth import ClusterSecret
from tests.e2e.test_health import _wait
from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.slow]

SECRET = "kvmesh-tests: the planner's distributed fleet secret"
METRICS_AUTH = {"Authorization": f"Bearer {metrics_token(ClusterSecret(SECRET.encode()))}"}  # the fleet has a secret


def _pids(url: str) -> set[int]:
    return {w["pid"] for w in httpx.get(url + "/admin/workers").json()["workers"]}


def _spares(metrics_url: str) -> float:
    try:
        text = httpx.get(metrics_url, headers=METRICS_AUTH).text
    except httpx.ConnectError:  # the planner is still starting
        return 0.0
    found = re.findall(r'kvmesh_planner_workers\{role="spare"\} ([0-9.e+]+)', text)
    return float(found[0]) if found else 0.0


def _completes(url: str) -> bool:
    body = {"model": "kvmesh-tiny", "prompt": "def f():", "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200


def test_the_planner_promotes_a_standby_worker_when_a_worker_dies(tmp_path):
    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "disc"),
           "KVMESH_NAMESPACE": "plannertest", "KVMESH_CLUSTER_SECRET": SECRET, "KVMESH_LEASE_TTL": "3"}  # fmt: skip
    port, mport = free_port(), free_port()
    url, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"
    procs = [KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), "--admin", "--canary-interval", "0", env=env)]
    try:
        serving = []
        for _ in range(2):
            procs.append(KvmeshProcess(tmp_path, "worker", "--speedup", "1e9", env=env))
            serving.append(procs[-1].wait_ready()["pid"])
        procs.append(KvmeshProcess(tmp_path, "worker", "--speedup", "1e9", "--standby", env=env))
        standby = procs[-1].wait_ready()["pid"]
        procs.append(KvmeshProcess(tmp_path, "planner", "--hot-spares", "1", "--min-workers", "2", "--planner-interval",
                                   "0.3", "--planner-metrics-port", str(mport), env=env))  # fmt: skip
        wait_healthy(url, proc=procs[0].proc)
        _wait(lambda: _pids(url) == set(serving), 30, "the two serving workers routed")
        _wait(lambda: _spares(metrics) == 1, 60, lambda: f"the standby checked by the planner:\n{procs[4].log()}")
        assert standby not in _pids(url), "a standby is not routed to"
        assert all(_completes(url) for _ in range(4))
        victim = next(p for p in procs[1:3] if p.proc.pid == serving[0])
        victim.signal(signal.SIGKILL)
        _wait(lambda: _pids(url) == {serving[1], standby}, 60, lambda: f"the standby promoted (routed: {_pids(url)})")
        assert all(_completes(url) for _ in range(4))
        assert "promoted by the planner" in procs[3].log()
        assert re.search(r"planner: promote aggregated worker [0-9a-f]+: aggregated worker lost", procs[4].log())
    finally:
        for p in reversed(procs):
            p.stop()
