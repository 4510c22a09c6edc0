"""KV-aware routing live: `kvmesh run --workers 4 --router-mode kv` under a
shared-prefix load reuses more prefix cache than round_robin, read from /metrics;
decisions can be explained; a worker with another block size is refused."""

from __future__ import annotations

import json
import random
import re
import subprocess
import time

import httpx
import pytest

from tests.helpers import KvmeshProcess, ServerProcess, free_port, kvmesh_run, wait_healthy

pytestmark = pytest.mark.processes

BLOCK = 16


def _metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M):
        total += float(m.group(1))
    return total


def _shared_prefix_load(url: str, groups: int = 4, per_group: int = 12) -> None:
    """Requests in `groups` families; each family shares a 256-token prefix."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(100, 2000) for _ in range(256)] for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    with httpx.Client(timeout=30) as client:
        for g in order:
            prompt = prefixes[g] + [rng.randrange(100, 2000) for _ in range(32)]
            body = {"model": "kvmesh-tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            assert client.post(url + "/v1/completions", json=body).status_code == 200


def _hit_rate(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return _metric(text, "kvmesh_frontend_cached_tokens_total") / _metric(text, "kvmesh_frontend_input_tokens_total")


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2])
def test_kv_routing_reuses_more_cache_than_round_robin(tmp_path, shards):
    """With ``--router-shards 2`` the index lives in two shard processes (router/shards.py)."""
    rates = {}
    for mode in ("round_robin", "kv"):
        # a generous wait for the shards' answers: this checks where requests go, not how fast (bench/fleet.py)
        extra = ("--router-shards", str(shards), "--router-shard-wait-ms", "200") if mode == "kv" else ()
        with kvmesh_run(tmp_path, "--router-mode", mode, "--block-size", str(BLOCK), *extra, workers=4) as server:
            _wait_workers(server.url, 4)
            _shared_prefix_load(server.url)
            rates[mode] = _hit_rate(server.url)
            if mode == "kv":
                # the index lives where the flag says: S shard processes, children of the
                # frontend (`kvmesh run`), or none (the frontend's own index)
                assert len(_shard_processes(server)) == (shards if shards > 1 else 0), server.log()
                # shards report their counters every 0.2 s (router/shards.py)
                deadline = time.monotonic() + 10
                while _metric(text := httpx.get(server.url + "/metrics").text, "kvmesh_router_kv_events_applied_total") == 0:
                    assert time.monotonic() < deadline, "no KV event applied"
                    time.sleep(0.05)
                assert _metric(text, "kvmesh_router_decision_seconds_count") >= 48
                assert "kvmesh_router_overlap_ratio_bucket" in text
    # 4 families on 4 workers: kv sends a family to the worker that holds its prefix
    assert rates["kv"] > rates["round_robin"] + 0.2, rates
    assert rates["kv"] > 0.6, rates


def _shard_processes(server: ServerProcess) -> list[str]:
    """Command lines of the server's children that are KV index shards (router/shard_main.py)."""
    out = subprocess.run(["ps", "-o", "args=", "--ppid", str(server.proc.pid)], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if "kvmesh.router.shard_main" in line]


def _wait_workers(url: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").json()["models"].get("kvmesh-tiny", 0) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {n} workers")
        time.sleep(0.1)


def test_decision_is_explained_on_request(tmp_path):
    # no canaries: their KV events would make the wait below pass early
    with kvmesh_run(tmp_path, "--router-mode", "kv", "--canary-interval", "0", workers=2) as server:
        _wait_workers(server.url, 2)
        applied = _metric(httpx.get(server.url + "/metrics").text, "kvmesh_router_kv_events_applied_total")
        prompt = list(range(100, 164))
        body = {"model": "kvmesh-tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "router_explain": True}
        first = httpx.post(server.url + "/v1/completions", json=body).json()["kvmesh_route"]
        assert {c["worker"] for c in first["candidates"]} and len(first["candidates"]) == 2
        deadline = time.monotonic() + 30  # the worker's KV events reach the router
        while _metric(httpx.get(server.url + "/metrics").text, "kvmesh_router_kv_events_applied_total") <= applied:
            assert time.monotonic() < deadline, "the first request's KV events never reached the router"
            time.sleep(0.05)
        r = httpx.post(server.url + "/v1/completions", json=dict(body, stream=True), headers={"x-kvmesh-explain": "1"})
        route = json.loads(r.headers["x-kvmesh-route"])
        assert route["worker"] == first["worker"]
        assert route["overlap_blocks"] == len(prompt) // 16
        chosen = next(c for c in route["candidates"] if c["worker"] == route["worker"])
        assert chosen["cost"] == min(c["cost"] for c in route["candidates"])


def test_block_size_mismatch_is_refused(tmp_path):
    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "d"), "KVMESH_NAMESPACE": "bs"}
    port = free_port()
    procs = [KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), "--router-mode", "kv", env=env)]
    try:
        procs.append(KvmeshProcess(tmp_path, "worker", "--block-size", "16", "--speedup", "1e9", env=env))
        procs[-1].wait_ready()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=procs[0].proc)
        procs.append(KvmeshProcess(tmp_path, "worker", "--block-size", "32", "--speedup", "1e9", env=env))
        procs[-1].wait_ready()
        deadline = time.monotonic() + 10
        while _metric(httpx.get(url + "/metrics").text, "kvmesh_router_block_size_mismatch_total") < 1:
            assert time.monotonic() < deadline, procs[0].log()
            time.sleep(0.1)
        assert httpx.get(url + "/health").json()["models"]["kvmesh-tiny"] == 1
        assert "uses KV blocks of 32 tokens" in procs[0].log()
    finally:
        for p in reversed(procs):
            p.stop()
