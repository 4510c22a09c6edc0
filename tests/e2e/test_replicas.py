"""Many workers in one process (kvmesh.worker.replicas), with real processes:

* distributed: ``kvmesh worker --replicas 3`` against real etcd and nats-server
  registers 3 instances (3 leases, 3 discovery keys), a ``kvmesh frontend`` routes
  requests to all 3, and SIGKILL of that one process takes all 3 out of discovery and
  routing (their leases expire);
* embedded: ``kvmesh run --workers 4 --workers-per-process 2`` serves 4 workers from 2
  processes; SIGKILL of one process drops its 2 workers and the supervisor replaces
  them (2 new ids), while requests keep succeeding.
"""

from __future__ import annotations

import json
import re
import signal
import time

import httpx
import pytest

from tests.helpers import KvmeshProcess, free_port, kvmesh_run, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(180)]

DECISIONS = re.compile(r'kvmesh_router_decisions_total\{model="kvmesh-tiny",worker="([0-9a-f]+)"\} ([0-9.e+]+)')


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _ready_cards(proc: KvmeshProcess, count: int, timeout: float = 60.0) -> list[dict]:
    cards: list[dict] = []

    def read() -> bool:
        if proc.proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.proc.returncode}:\n{proc.log()}")
        cards[:] = [json.loads(line[len("KVMESH_READY ") :]) for line in proc.log().splitlines() if line.startswith("KVMESH_READY ")]
        return len(cards) >= count

    _until(read, timeout, f"{count} READY lines")
    return cards


def _workers_seen(url: str) -> int:
    return int(httpx.get(url + "/health").json()["models"].get("kvmesh-tiny", 0))


def _routed(url: str) -> dict[int, float]:
    return {int(w, 16): float(v) for w, v in DECISIONS.findall(httpx.get(url + "/metrics").text)}


def _complete(url: str) -> None:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "kvmesh-tiny", "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def _reach_all(url: str, ids: set[int], limit: int = 60) -> None:
    """Requests until each of ``ids`` got at least one (round robin: a few rounds)."""
    for _ in range(limit):
        if ids <= {w for w, n in _routed(url).items() if n > 0}:
            return
        _complete(url)
    raise AssertionError(f"after {limit} requests, routed to {_routed(url)}, not all of {sorted(ids)}")


@pytest.mark.parametrize(("request_plane", "event_plane"), [("tcp", "zmq"), ("nats", "nats")])
def test_replicas_register_serve_and_leave_together_on_sigkill(tmp_path, etcd, nats, request_plane, event_plane):
    env = {
        "KVMESH_DISCOVERY": "etcd",
        "KVMESH_ETCD_ENDPOINTS": etcd.endpoint,
        "KVMESH_NATS_URL": nats.url,
        "KVMESH_REQUEST_PLANE": request_plane,
        "KVMESH_EVENT_PLANE": event_plane,
        "KVMESH_HOST": "127.0.0.1",
        "KVMESH_NAMESPACE": "replicas",
        "KVMESH_LEASE_TTL": "2",  # etcd's minimum: the killed process's keys go within ~2 s
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    frontend = KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), env=env)
    worker = KvmeshProcess(tmp_path, "worker", "--replicas", "3", "--speedup", "100", env=env)
    try:
        cards = _ready_cards(worker, 3)
        ids = {card["lease_id"] for card in cards}
        assert len(ids) == 3, cards  # three leases, three identities
        assert {card["pid"] for card in cards} == {worker.proc.pid}  # one process
        assert len({card["metrics_address"] for card in cards}) == 1  # one metrics endpoint for all
        keys = etcd.etcdctl("get", "--prefix", "--keys-only", "/services/replicas/backend/generate-").split()
        assert sorted(keys) == sorted(f"/services/replicas/backend/generate-{w:x}" for w in ids)
        if request_plane == "tcp":
            assert len({card["address"] for card in cards}) == 3  # each its own endpoint
        else:
            assert len({card["subject"] for card in cards}) == 3
        wait_healthy(url, proc=frontend.proc)
        _until(lambda: _workers_seen(url) == 3, 30, "the frontend to route to 3 workers")
        _reach_all(url, ids)

        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(10)
        _until(lambda: _workers_seen(url) == 0, 20, "all 3 replicas out of routing after SIGKILL")
        assert etcd.etcdctl("get", "--prefix", "--keys-only", "/services/replicas/").split() == []
        r = httpx.post(url + "/v1/completions", json={"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text  # nobody left to serve it
    finally:
        worker.stop()
        frontend.stop()


def test_run_workers_per_process_serves_and_replaces_a_killed_process(tmp_path):
    with kvmesh_run(tmp_path, "--workers-per-process", "2", workers=4) as server:
        url = server.url
        wait_healthy(url, proc=server.proc)
        _until(lambda: _workers_seen(url) == 4, 30, "4 workers")
        children = server.worker_pids()
        assert len(children) == 2, children  # 4 workers in 2 processes
        _reach_all(url, {0, 1, 2, 3})

        server_victim = children[0]
        import os

        os.kill(server_victim, signal.SIGKILL)
        _until(lambda: _workers_seen(url) == 2, 20, "the killed process's 2 workers out of routing")
        _until(lambda: _workers_seen(url) == 4, 60, "2 replacement workers")
        _reach_all(url, {4, 5})  # the replacement process's two fresh ids
        assert server_victim not in server.worker_pids()
        for _ in range(4):
            _complete(url)
