"""``kvmesh planner --worker-flags`` on a distributed fleet (file discovery, real
processes): one serving worker is started by the test, the planner (``--min-workers 2``)
starts the other (a ``kvmesh worker`` with the given flags) and, with ``--hot-spares 1``,
a ``kvmesh worker --standby`` process that it vets and holds back. The planner's serving worker is SIGKILLed: the planner promotes its
own standby (routable at once) and starts a new standby process; when the planner is
stopped (SIGTERM), every worker process it started ends with it (drained), and no
other. Conditions are waited on; no wall-clock asserts."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import httpx
import pytest

from kvmesh.observability.metrics_server import metrics_token
from kvmesh.runtime.auth import ClusterSecret
from tests.e2e.test_health import _wait
from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.slow]

SECRET = "kvmesh-tests: the planner's own worker processes"
METRICS_AUTH = {"Authorization": f"Bearer {metrics_token(ClusterSecret(SECRET.encode()))}"}


def _routed(url: str) -> dict[int, str]:
    """PID -> worker id of the workers the frontend routes to."""
    return {w["pid"]: w["worker"] for w in httpx.get(url + "/admin/workers").json()["workers"]}


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return {int(x) for x in out.stdout.split()}


def _metric(metrics_url: str, pattern: str) -> float:
    try:
        text = httpx.get(metrics_url, headers=METRICS_AUTH).text
    except httpx.ConnectError:  # the planner is still starting
        return 0.0
    return sum(float(v) for v in re.findall(pattern, text))


def _completes(url: str) -> bool:
    body = {"model": "kvmesh-tiny", "prompt": "def f():", "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200


@pytest.mark.timeout(150)
def test_the_planner_starts_promotes_and_ends_its_own_worker_processes(tmp_path):
    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "disc"),
           "KVMESH_NAMESPACE": "plannerprocs", "KVMESH_CLUSTER_SECRET": SECRET, "KVMESH_LEASE_TTL": "3"}  # fmt: skip
    port, mport = free_port(), free_port()
    url, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"
    frontend = KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), "--admin", "--canary-interval", "0", env=env)
    bystander = KvmeshProcess(tmp_path, "worker", "--speedup", "1e9", env=env)  # serving, not the planner's
    planner = None
    try:
        bystander.wait_ready()
        planner = KvmeshProcess(
            tmp_path, "planner", "--worker-flags=--speedup 1e9", "--min-workers", "2", "--max-workers", "4",
            "--hot-spares", "1", "--planner-interval", "0.3", "--planner-metrics-port", str(mport), env=env,
        )  # fmt: skip
        wait_healthy(url, proc=frontend.proc, timeout=60)  # healthy once the planner's first worker serves
        _wait(lambda: len(_routed(url)) == 2, 60, lambda: f"the planner's first worker routed:\n{planner.log()}")
        (first,) = set(_routed(url)) - {bystander.proc.pid}
        assert first in _children(planner.proc.pid), "the serving worker is the planner's own process"
        _wait(lambda: _metric(metrics, r'kvmesh_planner_workers\{role="spare"\} ([0-9.e+]+)') >= 1, 60,
              lambda: f"a standby process started and vetted:\n{planner.log()}")  # fmt: skip
        assert all(_completes(url) for _ in range(4))
        ours = _children(planner.proc.pid)
        assert len(ours) >= 2 and bystander.proc.pid not in ours
        os.kill(first, signal.SIGKILL)
        _wait(lambda: len(r := _routed(url)) == 2 and first not in r, 60, lambda: f"a replacement routed:\n{planner.log()}")
        (second,) = set(_routed(url)) - {bystander.proc.pid}
        assert second in ours, "the planner's own standby was promoted (warm), not a cold start"
        assert all(_completes(url) for _ in range(4))
        _wait(lambda: len(_children(planner.proc.pid) - ours) >= 1, 60, lambda: f"a new standby process:\n{planner.log()}")
        assert re.search(r"planner: promote aggregated worker [0-9a-f]+: aggregated worker lost", planner.log())
        started = _children(planner.proc.pid)
        planner.signal(signal.SIGTERM)
        planner.proc.wait(60)
        _wait(lambda: not any(_alive(p) for p in started), 30, "the planner's workers ended with it")
        assert bystander.proc.poll() is None, "a worker the planner did not start is never signalled"
    finally:
        for p in (planner, bystander, frontend):
            if p is not None:
                p.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
