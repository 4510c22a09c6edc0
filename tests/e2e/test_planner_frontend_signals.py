"""``kvmesh planner`` sees what the frontends see (real processes, file discovery, a
cluster secret): a ``kvmesh frontend`` under load from the openai client puts its
signed totals in discovery, and the planner's observation carries the round's
arrivals (requests admitted), TTFT and ITL p90; with ``--capacity-profile`` its
forecast follows them. Read from the planner's own /metrics
(``kvmesh_planner_input{signal=...}``). Conditions are waited on; no wall-clock asserts."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from kvmesh.observability.metrics_server import metrics_token
from kvmesh.planner.profile import CapacityPoint, CapacityProfile, dump_profile
from kvmesh.runtime.auth import ClusterSecret
from tests.e2e.test_health import _wait
from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.slow]

SECRET = "kvmesh-tests: the planner reads the frontends"
METRICS_AUTH = {"Authorization": f"Bearer {metrics_token(ClusterSecret(SECRET.encode()))}"}


def _inputs(metrics_url: str) -> dict[str, float]:
    try:
        text = httpx.get(metrics_url, headers=METRICS_AUTH).text
    except httpx.ConnectError:  # the planner is still starting
        return {}
    return {k: float(v) for k, v in re.findall(r'kvmesh_planner_input\{signal="([a-z_0-9]+)"\} ([0-9.e+-]+)', text)}


@pytest.mark.timeout(120)
def test_the_distributed_planner_reads_arrivals_and_latencies_from_a_real_frontend(tmp_path):
    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "disc"),
           "KVMESH_NAMESPACE": "plannersignals", "KVMESH_CLUSTER_SECRET": SECRET, "KVMESH_LEASE_TTL": "3"}  # fmt: skip
    profile = tmp_path / "profile.json"
    dump_profile(CapacityProfile(2000.0, 100.0, 0.99, (CapacityPoint(16, 16, 50.0, 50.0, 50.0),), version=2), profile)
    port, mport = free_port(), free_port()
    url, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"
    frontend = KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), env=env)
    worker = KvmeshProcess(tmp_path, "worker", "--speedup", "20", env=env)  # a few ms a token: latencies to see
    planner = KvmeshProcess(
        tmp_path, "planner", "--min-workers", "1", "--max-workers", "1", "--planner-interval", "0.5",
        "--planner-metrics-port", str(mport), "--capacity-profile", str(profile), env=env,
    )  # fmt: skip
    done = threading.Event()
    sent: list[int] = []

    def load() -> None:  # a steady trickle of streamed completions until the planner has seen them
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        while not done.is_set():
            stream = client.completions.create(model="kvmesh-tiny", prompt="def f():", max_tokens=12, stream=True)
            assert sum(1 for _ in stream) > 0
            sent.append(1)

    threads: list[threading.Thread] = []
    try:
        worker.wait_ready()
        wait_healthy(url, proc=frontend.proc, timeout=60)
        threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()

        def seen() -> bool:
            s = _inputs(metrics)
            return all(s.get(k, 0.0) > 0 for k in ("arrival_rps", "ttft_p90_ms", "itl_p90_ms", "forecast_rps"))

        _wait(seen, 60, lambda: f"the planner's inputs {_inputs(metrics)}:\n{planner.log()}")
        s = _inputs(metrics)
        assert s["forecast_input_tokens"] > 0 and s["forecast_output_tokens"] > 0
        assert sent, "the load ran"
    finally:
        done.set()
        for t in threads:
            t.join(30)
        for p in (planner, worker, frontend):
            p.stop()
