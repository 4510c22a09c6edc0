"""Health checks tell load from failure on real worker processes: a fleet driven to
saturation by honest closed-loop traffic keeps every worker HEALTHY and migrates no
stream, while a worker truly slower than its peers (``slow:factor=K``) is still
caught."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable

import httpx
import pytest

from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

INTERVAL = 0.5
MAX_NUM_SEQS = 4
LONG_PROMPT = " ".join(f"word{i % 97} value{i % 13}" for i in range(250))  # ~1,400 tokens


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def _workers(url: str) -> dict[str, dict]:
    return {w["worker"]: w for w in httpx.get(url + "/admin/workers", timeout=30).json()["workers"]}


def _sum(text: str, pattern: str) -> float:
    return sum(float(v) for v in re.findall(pattern, text))


def _canaries_ok(text: str, worker: str) -> float:
    return _sum(text, rf'kvmesh_health_check_duration_seconds_count\{{check_type="canary",result="ok",worker_id="{worker}"\}} ([0-9.e+]+)')


def _schedulers(text: str) -> dict[str, tuple[float, float]]:
    """Each worker's (running, waiting) requests, as the frontend's /metrics shows them."""
    gauge = r'kvmesh_worker_{}_requests\{{[^}}]*worker_id="([0-9a-f]+)"[^}}]*\}} ([0-9.e+]+)'
    running = dict(re.findall(gauge.format("running"), text))
    waiting = dict(re.findall(gauge.format("waiting"), text))
    return {w: (float(running[w]), float(waiting[w])) for w in running.keys() & waiting.keys()}


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def _closed_loop(url: str, clients: int, until: float, max_requests: int, at_least: int = 0) -> tuple[int, list]:
    """``clients`` streaming clients, each sending its next request when the last
    ends, until ``until`` (monotonic) or ``max_requests`` in all; past ``until`` they
    go on until ``at_least`` requests were sent (a slow machine runs longer, not less)."""
    done, failures = 0, []
    sent = 0

    async def client(i: int) -> None:
        nonlocal done, sent
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while (time.monotonic() < until or sent < at_least) and sent < max_requests:
                sent += 1
                prompt = LONG_PROMPT if (i + sent) % 3 == 0 else f"def f{i}():"
                body = {"model": "kvmesh-tiny", "prompt": prompt, "max_tokens": 48, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        lines = [line async for line in r.aiter_lines() if line]
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                    continue
                if r.status_code != 200 or lines[-1] != "data: [DONE]" or '"completion_tokens":48' not in "".join(lines):
                    failures.append((r.status_code, lines[-3:]))
                done += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return done, failures


async def _sampling_schedulers(url: str, load: Awaitable[tuple[int, list]]) -> tuple[int, list, list[dict]]:
    """``load``'s result, and the workers' schedulers (:func:`_schedulers`) sampled from
    /metrics every 0.2 s while it ran."""
    samples: list[dict] = []

    async def sample() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while True:
                samples.append(_schedulers((await http.get("/metrics")).text))
                await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    try:
        done, failures = await load
    finally:
        sampler.cancel()
    return done, failures, samples


@pytest.mark.timeout(240)
def test_saturated_fleet_keeps_every_worker_healthy(tmp_path):
    # 2 workers of 4 sequences each, 32 clients: most requests wait in the workers'
    # queues, every step carries long prefills; canaries every 0.5 s.
    args = ("--canary-interval", str(INTERVAL), "--canary-timeout", "1", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", "1024", "--admin")  # fmt: skip
    with kvmesh_run(tmp_path, *args, workers=2, speedup="4") as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 2, 30, "2 workers")
        ids = sorted(_workers(url))
        _wait(lambda: all(_canaries_ok(_metrics(url), w) >= 2 for w in ids), 30, "idle baselines")
        before = _metrics(url)
        load = _closed_loop(url, clients=32, until=time.monotonic() + 12, max_requests=3000, at_least=64)
        done, failures, samples = asyncio.run(_sampling_schedulers(url, load))
        after = _metrics(url)
        assert failures == [] and done >= 64
        # it was saturated: requests queued behind the batch, and canaries were judged under that load
        assert _sum(after, r'kvmesh_frontend_time_to_first_token_seconds_sum\{model="kvmesh-tiny"\} ([0-9.e+]+)') > 0
        full = {w for sample in samples for w, (running, waiting) in sample.items() if running == MAX_NUM_SEQS and waiting > 0}
        peaks = {w: max((sample[w] for sample in samples if w in sample), default=None) for w in ids}
        assert full == set(ids), f"not every worker ran a full batch with a queue behind it: (running, waiting) peaks {peaks}"
        assert all(_canaries_ok(after, w) - _canaries_ok(before, w) >= 5 for w in ids), "canaries did not run under load"
        transitions = re.findall(r'kvmesh_health_transitions_total\{cause="([^"]*)",to="([a-z]+)",worker_id="[0-9a-f]+"\} ([0-9.e+]+)', after)
        assert [t for t in transitions if float(t[2]) > 0] == [], transitions
        assert _sum(after, r"kvmesh_migration_total\{[^}]*\} ([0-9.e+]+)") == 0
        assert all(w["status"] == "healthy" and w["weight"] == 1.0 for w in _workers(url).values())


@pytest.mark.timeout(240)
def test_a_worker_slower_than_its_peers_is_caught(tmp_path):
    args = ("--canary-interval", str(INTERVAL), "--canary-timeout", "2", "--breaker-recovery", "30", "--admin")
    with kvmesh_run(tmp_path, *args, workers=3, speedup="2") as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 3, 30, "3 workers")
        ids = sorted(_workers(url))
        _wait(lambda: all(_canaries_ok(_metrics(url), w) >= 2 for w in ids), 30, "baselines")
        slow = ids[0]
        r = httpx.post(url + "/admin/fault", json={"worker": slow, "fault": "slow:factor=8"})
        assert r.status_code == 200, r.text
        _wait(lambda: _workers(url)[slow]["status"] == "unhealthy", 30, "the slow worker removed")
        assert _workers(url)[slow]["weight"] == 0.0
        assert all(_workers(url)[w]["status"] == "healthy" for w in ids[1:])
        assert re.search(rf'kvmesh_health_transitions_total\{{cause="latency_spike",to="unhealthy",worker_id="{slow}"\}} 1', _metrics(url))
