"""Degradation levels 1, 3 and 4 driven end to end by real overload (issue 32, item 4):
``kvmesh run --degradation`` with two mocker workers at a quarter of real speed, and a
client sending at a fixed rate with a bound on its requests in flight. The SLO flags fix
the fleet's capacity (degradation.py: concurrency ``--slo-max-batch`` per worker over
``--slo-ttft-ms`` + ``--slo-output-tokens`` × ``--slo-tpot-ms``), so the rate sets the
capacity/demand ratio, hence the level; each test checks the level's actions where
they land:

* level 1 (ratio 0.85): every worker runs at most 3 of its ``--max-num-seqs 4`` while
  requests wait there (the batch × 0.75 reached the engines: their own gauges);
* level 3 (ratio 0.37): best-effort requests get 503 + Retry-After, standard ones are
  served, and the workers run at most 2 of 4 (× 0.5);
* level 4 (ratio 0.12): every new request, premium too, gets 503 + Retry-After while
  the streams already in flight finish whole.

Conditions, not timings: each test waits for the level on the gauge, then judges what
the workers and the client saw at that level."""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass, field

import httpx
import pytest

from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

SPEEDUP = "0.25"
BASE = ("--degradation", "--canary-interval", "0", "--trust-priority-header", "--max-num-seqs", "4",
        "--shed-retry-after", "2")  # fmt: skip


def _slo(max_batch: int, ttft_ms: int, tpot_ms: int, tokens: int) -> tuple[str, ...]:
    return ("--slo-max-batch", str(max_batch), "--slo-ttft-ms", str(ttft_ms), "--slo-tpot-ms", str(tpot_ms),
            "--slo-output-tokens", str(tokens))  # fmt: skip


def _capacity_rps(workers: int, max_batch: int, ttft_ms: int, tpot_ms: int, tokens: int) -> float:
    return workers * max_batch / ((ttft_ms + tokens * tpot_ms) / 1000)


@dataclass
class Sample:
    level: int
    running: dict[str, float]
    waiting: dict[str, float]


def _gauges(text: str, name: str) -> dict[str, float]:
    out = {}
    for labels, value in re.findall(rf"^kvmesh_worker_{name}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M):
        worker = dict(re.findall(r'(\w+)="([^"]*)"', labels))["worker_id"]
        out[worker] = float(value)
    return out


async def _sample(client: httpx.AsyncClient) -> Sample:
    text = (await client.get("/metrics")).text
    level = int(float(re.search(r"^kvmesh_degradation_level ([0-9.]+)$", text, re.M).group(1)))
    return Sample(level, _gauges(text, "running_requests"), _gauges(text, "waiting_requests"))


@dataclass
class Load:
    """Requests at ``rps`` (a client more than one send late does not catch up: no
    burst), at most ``bound`` in flight; what each got back."""

    url: str
    rps: float
    tiers: list[str]
    max_tokens: int = 100
    bound: int = 100
    results: list[tuple[str, int, str | None, int]] = field(default_factory=list)  # (tier, status, retry-after, #sent)
    sent: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        rng = random.Random(7)
        gate = asyncio.Semaphore(self.bound)
        tasks: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            loop = asyncio.get_running_loop()
            interval = 1 / self.rps
            next_at = loop.time()
            while not self.stop.is_set():
                await gate.acquire()
                task = asyncio.ensure_future(self._one(client, rng.choice(self.tiers), self.sent, gate))
                self.sent += 1
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += interval
                now = loop.time()
                if next_at < now - interval:  # more than one send behind: no burst
                    next_at = now
                await asyncio.sleep(max(0.0, next_at - now))
            for task in tasks:  # the test has judged what it needed: the rest is not waited for
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def sent_after(self, index: int) -> list[tuple[str, int, str | None, int]]:
        return [r for r in self.results if r[3] >= index]

    async def _one(self, client: httpx.AsyncClient, tier: str, index: int, gate: asyncio.Semaphore) -> None:
        rng = random.Random(index)
        body = {"model": "kvmesh-tiny", "prompt": [rng.randrange(100, 2000) for _ in range(32)],
                "max_tokens": self.max_tokens, "ignore_eos": True, "priority": tier}  # fmt: skip
        try:
            r = await client.post("/v1/completions", json=body)
            self.results.append((tier, r.status_code, r.headers.get("retry-after"), index))
        finally:
            gate.release()


async def _watch(url: str, until, timeout: float, what: str) -> list[Sample]:
    """/metrics samples until ``until(samples)`` holds; fails after ``timeout`` s."""
    samples: list[Sample] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def loop() -> None:
            while not until(samples):
                samples.append(await _sample(client))
                await asyncio.sleep(0.1)

        try:
            await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; levels seen {sorted({s.level for s in samples})}") from None
    return samples


def _batch_checks(samples: list[Sample], levels: set[int]) -> list[tuple[str, float]]:
    """(worker, running) of every sample at ``levels`` where requests waited on it."""
    return [(w, s.running.get(w, 0.0)) for s in samples if s.level in levels for w, n in s.waiting.items() if n > 0]


async def _after_turnover(url: str, load: Load, levels: set[int]) -> tuple[list[tuple[str, float]], list[Sample]]:
    """Once the level is in ``levels``, and 12 requests sent after that were answered
    (FCFS: every batch running before the tune has finished by then), 8 looks at a worker
    where requests wait: (worker, running) of each, and those samples."""
    await _watch(url, lambda s: bool(s) and s[-1].level in levels, 30, f"level {sorted(levels)}")
    mark = load.sent
    await _watch(url, lambda s: len(load.sent_after(mark)) >= 12, 30, "12 answers to requests sent at the level")
    samples = await _watch(url, lambda s: len(_batch_checks(s, levels)) >= 8, 30, "8 looks at requests waiting")
    return _batch_checks(samples, levels), samples


@pytest.mark.timeout(60)
async def test_level_1_tells_the_workers_to_run_three_quarters_of_their_batch(tmp_path):
    slo = (4, 1000, 50, 20)  # 2 workers × 4 / 2 s = 4 requests/s
    rps = _capacity_rps(2, *slo) / 0.85  # ratio 0.85: level 1
    with kvmesh_run(tmp_path, *BASE, *_slo(*slo), workers=2, speedup=SPEEDUP) as server:
        load = Load(server.url, rps, ["standard"])
        sender = asyncio.ensure_future(load.run())
        try:
            checks, samples = await _after_turnover(server.url, load, {1, 2})
        finally:
            load.stop.set()
            await sender
    levels = [s.level for s in samples]
    print(f"levels seen {sorted(set(levels))}; running where requests waited at level 1: {checks}")
    assert 1 in levels, levels
    assert max(r for _, r in checks) <= 3, checks
    assert all(status == 200 for _, status, _, _ in load.results), "level 1 sheds nothing"


@pytest.mark.timeout(60)
async def test_level_3_sheds_best_effort_halves_the_batch_and_serves_the_rest(tmp_path):
    slo = (4, 1000, 50, 20)  # 4 requests/s
    rps = _capacity_rps(2, *slo) / 0.37  # ratio 0.37: level 3
    with kvmesh_run(tmp_path, *BASE, *_slo(*slo), workers=2, speedup=SPEEDUP) as server:
        # a third standard: more than the halved batch serves (the queue grows), not so much that
        # a standard request sent now waits behind a long queue
        load = Load(server.url, rps, ["standard", "best_effort", "best_effort"], max_tokens=60)
        sender = asyncio.ensure_future(load.run())
        try:
            checks, samples = await _after_turnover(server.url, load, {3})
            at3 = load.sent  # sent from here on: at level 3
            def answered(tier: str) -> int:
                return sum(r[0] == tier for r in load.sent_after(at3))

            await _watch(server.url, lambda s: answered("standard") >= 3 and answered("best_effort") >= 5, 30,
                         "answers to requests sent at level 3")  # fmt: skip
        finally:
            load.stop.set()
            await sender
    print(f"levels seen {sorted({s.level for s in samples})}; running where requests waited at level 3: {checks}")
    assert max(r for _, r in checks) <= 2, checks
    late = load.sent_after(at3)
    shed = [r for r in late if r[0] == "best_effort"]
    served = [r for r in late if r[0] == "standard"]
    assert shed and all(s == 503 and ra is not None and int(ra) >= 1 for _, s, ra, _ in shed), shed
    assert served and all(s == 200 for _, s, _, _ in served), served


@pytest.mark.timeout(60)
async def test_level_4_refuses_new_requests_while_streams_in_flight_finish(tmp_path):
    slo = (1, 1000, 50, 20)  # 2 workers × 1 / 2 s = 1 request/s
    rps = _capacity_rps(2, *slo) / 0.12  # ratio 0.12: level 4
    with kvmesh_run(tmp_path, *BASE, *_slo(*slo), workers=2, speedup=SPEEDUP) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            long = [asyncio.ensure_future(_long_stream(client, i)) for i in range(2)]
            await _watch(server.url, lambda s: bool(s) and sum(s[-1].running.values()) >= 2, 30, "2 streams running")
            load = Load(server.url, rps, ["premium", "standard"], max_tokens=8)
            sender = asyncio.ensure_future(load.run())
            try:
                await _watch(server.url, lambda s: bool(s) and s[-1].level == 4, 30, "level 4")
                at4 = load.sent  # sent from here on: at level 4
                await _watch(server.url, lambda s: len(load.sent_after(at4)) >= 10, 30, "10 answers at level 4")
            finally:
                load.stop.set()
                await sender
            streamed = await asyncio.wait_for(asyncio.gather(*long), 60)
    late = load.sent_after(at4)
    refused = [r for r in late if r[1] == 503]
    print(f"at level 4: {len(refused)} of {len(late)} refused; in-flight streams got {streamed} tokens")
    assert late and len(refused) == len(late), late
    assert all(ra is not None and int(ra) >= 1 for _, _, ra, _ in refused), refused
    assert {r[0] for r in refused} == {"premium", "standard"}
    assert streamed == [300, 300], "a stream in flight at level 4 was cut"


async def _long_stream(client: httpx.AsyncClient, i: int) -> int:
    body = {"model": "kvmesh-tiny", "prompt": f"a long story number {i}", "max_tokens": 300, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return int(re.search(r'"completion_tokens":(\d+)', "".join(lines)).group(1))
