"""Canary health checks on real worker processes with injected faults: a hung worker
is detected within two canary checks (counted, not timed: a loaded machine stretches
the interval, not the count) and its traffic (in flight too) moves; a
corrupting worker is detected and taken out of routing; a recovered worker comes back
through the half-open circuit."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

INTERVAL = 0.5
HEALTH_ARGS = ("--admin", "--canary-interval", str(INTERVAL), "--canary-timeout", "0.3", "--breaker-recovery", "1")


def _workers(url: str) -> dict[str, dict]:
    return {w["worker"]: w for w in httpx.get(url + "/admin/workers").json()["workers"]}


def _routed(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {w: float(v) for w, v in re.findall(r'kvmesh_router_decisions_total\{model="kvmesh-tiny",worker="([0-9a-f]+)"\} ([0-9.e+]+)', text)}


def _wait(predicate, timeout: float, what) -> float:
    """Poll ``predicate`` until true; ``what`` (a string, or a callable giving one at
    the timeout) names the condition in the failure."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.02)
    return time.monotonic() - start


def _canary_checks(url: str, worker: str) -> int:
    """Canary checks of ``worker`` finished so far, whatever their result."""
    text = httpx.get(url + "/metrics").text
    pattern = rf'kvmesh_health_check_duration_seconds_count\{{check_type="canary",result="[a-z_]+",worker_id="{worker}"\}} ([0-9.e+]+)'
    return int(sum(float(v) for v in re.findall(pattern, text)))


def _results(url: str, worker: str, result: str) -> int:
    """Canary checks of ``worker`` that ended in ``result`` (ok, wrong_tokens, ...)."""
    text = httpx.get(url + "/metrics").text
    pattern = rf'kvmesh_health_check_duration_seconds_count\{{check_type="canary",result="{result}",worker_id="{worker}"\}} ([0-9.e+]+)'
    return int(sum(float(v) for v in re.findall(pattern, text)))


def _fault(url: str, worker: str, spec: str) -> None:
    r = httpx.post(url + "/admin/fault", json={"worker": worker, "fault": spec})
    assert r.status_code == 200, r.text


class Load:
    """A few streaming clients in threads until stopped; failures are collected."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url, self.failures, self.done = url, [], 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        body = {"model": "kvmesh-tiny", "prompt": "def f():", "max_tokens": 16, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set() and self.done < 5000:
                try:
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        lines = [line for line in r.iter_lines() if line]
                    if r.status_code != 200 or lines[-1] != "data: [DONE]" or '"completion_tokens":16' not in "".join(lines):
                        self.failures.append((r.status_code, lines[-3:]))
                    self.done += 1
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_hung_worker_is_detected_and_its_traffic_moves(tmp_path):
    with kvmesh_run(tmp_path, *HEALTH_ARGS, workers=2, speedup="2") as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 2 and all(w["status"] == "healthy" for w in _workers(url).values()), 20, "2 healthy")
        hung, other = sorted(_workers(url))
        with Load(url) as load:
            _wait(lambda: load.done >= 10 and _canary_checks(url, hung) >= 1, 30, "warm load and a first canary")
            _fault(url, hung, "hang")
            checks_at_fault = _canary_checks(url, hung)
            _wait(lambda: _workers(url)[hung]["status"] != "healthy", 60, "detection")
            checks = _canary_checks(url, hung) - checks_at_fault
            # two failed checks, plus one that was under way at the fault and one finished
            # between the status poll and this read
            print(f"hung worker detected after {checks} canary checks")
            assert checks <= 4, f"detected after {checks} canary checks"
            _wait(lambda: _workers(url)[hung]["weight"] == 0.0, 30, "the hung worker out of routing")
            before = _routed(url).get(hung, 0)
            done = load.done
            _wait(lambda: load.done >= done + 30, 30, "load on the healthy worker")
            assert _routed(url).get(hung, 0) == before
        assert load.failures == []


def test_corrupting_worker_is_removed_then_recovers_through_half_open(tmp_path):
    # three failed half-open trials move a worker to DRAINING for good: an 8 s recovery
    # timeout leaves ~24 s between detection and repair (3 s, ~9 s, flaked on a loaded
    # machine: the routing check below outlasted it and the worker was given up on)
    args = [*HEALTH_ARGS[:-1], "8"]
    with kvmesh_run(tmp_path, *args, workers=2, speedup="2") as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 2 and all(w["status"] == "healthy" for w in _workers(url).values()), 20, "2 healthy")
        bad, _ = sorted(_workers(url))
        # the fleet agrees on the canary answers first (HEALTHY is where a worker starts):
        # corrupted before that, one worker of two has no majority to be judged against
        _wait(lambda: _canary_checks(url, bad) >= 1, 30, "the canary set recorded and a first check")
        _fault(url, bad, "corrupt")
        _wait(lambda: _workers(url)[bad]["status"] == "unhealthy", 30, "corruption detected")
        assert _workers(url)[bad]["weight"] == 0.0
        text = httpx.get(url + "/metrics").text
        assert re.search(rf'kvmesh_health_check_duration_seconds_count\{{check_type="canary",result="wrong_tokens",worker_id="{bad}"\}} [1-9]', text)
        assert f'kvmesh_circuit_breaker_state{{worker_id="{bad}"}} 1.0' in text or f'kvmesh_circuit_breaker_state{{worker_id="{bad}"}} 2.0' in text
        before = _routed(url).get(bad, 0)
        for _ in range(10):
            assert httpx.post(url + "/v1/completions", json={"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert _routed(url).get(bad, 0) == before  # removed from routing
        _fault(url, bad, "")  # repaired: the next half-open trial passes
        _wait(lambda: _workers(url)[bad]["status"] == "healthy" and _workers(url)[bad]["weight"] == 1.0, 60, lambda: f"recovery (now {_workers(url)[bad]})")
        for _ in range(10):
            httpx.post(url + "/v1/completions", json={"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 2})
        assert _routed(url).get(bad, 0) > before


def test_canary_record_then_check_against_the_file(tmp_path):
    import subprocess
    import sys

    from tests.helpers import KvmeshProcess, free_port

    port = free_port()
    worker = KvmeshProcess(tmp_path, "worker", "--static", "--port", str(port), "--speedup", "1e9")
    try:
        worker.wait_ready()
        out = tmp_path / "canaries.json"
        r = subprocess.run(
            [sys.executable, "-m", "kvmesh.cli.main", "canary", "record", "--worker", f"127.0.0.1:{port}", "--out", str(out)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        from kvmesh.health.canary import load_canaries

        recorded = load_canaries(out)
        assert recorded.model == "kvmesh-tiny" and len(recorded.canaries) == 2
        assert all(len(c.expected_token_ids) == 8 for c in recorded.canaries)
    finally:
        worker.stop()
    # a frontend checking every worker against the file: healthy workers pass it
    with kvmesh_run(tmp_path, *HEALTH_ARGS, "--canaries", str(out), workers=2) as server:
        _wait(lambda: len(_workers(server.url)) == 2, 20, "2 workers")
        ids = list(_workers(server.url))
        _wait(lambda: all(_canary_checks(server.url, w) >= 2 for w in ids), 60, "two canary checks of each worker")
        assert all(w["status"] == "healthy" for w in _workers(server.url).values())
        text = httpx.get(server.url + "/metrics").text
        assert re.search(r'kvmesh_health_check_duration_seconds_count\{check_type="canary",result="ok",worker_id="[0-9a-f]+"\} [1-9]', text)
    # the file decides, not the fleet: against a file recorded elsewhere (its first canary's
    # answer differs from these workers'), a worker fails, though without the file a lone
    # worker's own answers would become the canaries it passes
    import msgspec

    from kvmesh.health.canary import save_canaries

    first = recorded.canaries[0]
    other = tmp_path / "other-fleet.json"
    save_canaries(other, msgspec.structs.replace(recorded, canaries=[
        msgspec.structs.replace(first, expected_token_ids=[t + 1 for t in first.expected_token_ids]), *recorded.canaries[1:],
    ]))  # fmt: skip
    with kvmesh_run(tmp_path, *HEALTH_ARGS, "--canaries", str(other), workers=1) as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 1, 20, "1 worker")
        (w,) = _workers(url)
        _wait(lambda: _results(url, w, "wrong_tokens") + _results(url, w, "ok") >= 1, 60, "a canary verdict")
        assert _results(url, w, "ok") == 0, "a worker that disagrees with the file passed its canary"
        assert _results(url, w, "wrong_tokens") >= 1
        # judged wrong: unhealthy, or already given up on after failed recovery trials (a slow poll can miss the first)
        _wait(lambda: _workers(url)[w]["status"] in ("unhealthy", "draining"), 30, lambda: f"the worker judged wrong (now {_workers(url)[w]})")
        assert _workers(url)[w]["weight"] == 0.0
