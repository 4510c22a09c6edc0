"""Distributed roles without etcd: file discovery (the default on one host) and static
mode (fixed addresses, no discovery at all)."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = pytest.mark.processes


def _complete(url: str) -> httpx.Response:
    body = {"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 4, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=20)


def _seen(url: str) -> int:
    return httpx.get(url + "/health").json()["models"].get("kvmesh-tiny", 0)


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


def test_file_discovery_frontend_and_workers(tmp_path):
    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "disc"), "KVMESH_NAMESPACE": "filetest"}
    port = free_port()
    procs = [KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), env=env)]
    try:
        for _ in range(2):
            procs.append(KvmeshProcess(tmp_path, "worker", "--speedup", "1e9", env=env))
            procs[-1].wait_ready()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=procs[0].proc)
        _wait(lambda: _seen(url) == 2, 30)
        assert all(_complete(url).status_code == 200 for _ in range(6))
        procs[1].signal(signal.SIGTERM)
        assert procs[1].proc.wait(20) == 0
        _wait(lambda: _seen(url) == 1, 30)
        assert all(_complete(url).status_code == 200 for _ in range(6))
    finally:
        for p in reversed(procs):
            p.stop()


def test_static_mode_needs_no_discovery(tmp_path):
    ports = [free_port(), free_port()]
    workers = [KvmeshProcess(tmp_path, "worker", "--static", "--port", str(p), "--speedup", "1e9") for p in ports]
    fport = free_port()
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    frontend = KvmeshProcess(tmp_path, "frontend", "--http-port", str(fport), "--static-workers", addresses)
    url = f"http://127.0.0.1:{fport}"
    try:
        for w in workers:
            w.wait_ready()
        wait_healthy(url, proc=frontend.proc)
        _wait(lambda: _seen(url) == 2, 30)
        assert all(_complete(url).status_code == 200 for _ in range(6))
        workers[0].stop()
        _wait(lambda: _seen(url) == 1, 30)
        assert all(_complete(url).status_code == 200 for _ in range(6))
        # the same address comes back: it is attached again
        workers[0] = KvmeshProcess(tmp_path, "worker", "--static", "--port", str(ports[0]), "--speedup", "1e9")
        workers[0].wait_ready()
        _wait(lambda: _seen(url) == 2, 30)
    finally:
        frontend.stop()
        for w in workers:
            w.stop()


def test_bad_runtime_option_is_one_line():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli.main", "worker", "--discovery", "zookeeper"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "kvmesh worker: --discovery (or KVMESH_DISCOVERY) must be one of memory, file, etcd, got 'zookeeper'"
    ]


def test_no_worker_is_a_503_after_the_wait_never_a_hang(tmp_path):
    from kvmesh.preprocess.model import bundled_model_path

    wait_s = 0.5
    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "empty"), "KVMESH_NAMESPACE": "none"}
    port = free_port()
    frontend = KvmeshProcess(
        tmp_path, "frontend", "--http-port", str(port), "--worker-wait", str(wait_s), "--model-path", str(bundled_model_path()),
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _live(url), 20)
        assert httpx.get(url + "/health").status_code == 503
        start = time.monotonic()
        r = _complete(url)  # never a hang: answered within the client's timeout (40 × the wait)
        waited = time.monotonic() - start
        assert r.status_code == 503
        # the frontend's own account: it waited the configured time for a worker
        assert f"no worker serves model 'kvmesh-tiny' (waited {wait_s:g} s)" in r.json()["error"]["message"]
        assert waited >= wait_s, f"answered after {waited:.3f} s, before the configured wait of {wait_s} s"
        assert r.headers["retry-after"]
        # ... and the request is over there: counted as a 503, nothing left in flight
        metrics = httpx.get(url + "/metrics").text
        assert _sample(metrics, "kvmesh_frontend_requests_total", status="503") == 1
        assert _sample(metrics, "kvmesh_frontend_inflight_requests") == 0
    finally:
        frontend.stop()


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The one sample of ``name`` for kvmesh-tiny with ``labels`` in a /metrics text."""
    want = {"model": "kvmesh-tiny", **labels}
    found = []
    for line in metrics.splitlines():
        head, _, value = line.rpartition(" ")
        family, _, rest = head.partition("{")
        if family != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in want.items()):
            found.append(float(value))
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _live(url: str) -> bool:
    try:
        return httpx.get(url + "/live").status_code == 200
    except httpx.HTTPError:
        return False
