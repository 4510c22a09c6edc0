"""3× overload with mixed priority tiers: the fleet's capacity (2 mocker workers of 4
sequences each, held to a TTFT / per-token SLO) is a third of the offered load.
Premium requests jump the queue that standard ones wait in, best-effort ones get 503
with Retry-After, and the frontend's memory stays bounded.

No duration is asserted (a loaded machine slows everything): that premium jumps the
queue is checked as an order of events (a premium request sent while a standard one waits
on the same worker gets its first token first); bench/degradation.py prints the TTFTs of
the same scenario. The mocker runs at a quarter speed (and the SLO is
scaled to match) so the workers, not the test's own client on a busy CPU, are the
bottleneck the priorities act on."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import time
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import pytest

from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

SPEEDUP = 0.25  # every model step takes 4× as long: 4× fewer requests for the same overload
SLO_TTFT_S = 0.150 / SPEEDUP
SLO_TPOT_S = 0.006 / SPEEDUP
ARGS = (
    "--degradation", "--slo-ttft-ms", str(round(SLO_TTFT_S * 1000)), "--slo-tpot-ms", str(round(SLO_TPOT_S * 1000)),
    "--slo-output-tokens", "16", "--slo-max-batch", "4",
    "--max-num-seqs", "4", "--shed-retry-after", "2", "--canary-interval", "0",
    "--trust-priority-header",  # the test's clients ask for premium themselves
)  # fmt: skip
CAPACITY_RPS = 2 * 4 / (SLO_TTFT_S + 16 * SLO_TPOT_S)  # the model's estimate: ~8 requests/s
OFFERED_RPS = 3 * CAPACITY_RPS
DURATION_S = 12.0
WARMUP_S = 4.0  # demand is measured over a few seconds before the level settles
TIERS = ["premium"] * 2 + ["standard"] * 4 + ["best_effort"] * 4


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


class Result(NamedTuple):
    at: float  # when it was sent, s after the start of the load
    tier: str
    status: int
    sent: int  # the client's event order: when it was sent ...
    first: int | None  # ... and when its first token came (None: none came)
    worker: str | None  # the worker the frontend routed it to (its x-kvmesh-route)
    retry_after: str | None
    ttft_s: float | None  # for bench/degradation.py: no assertion here reads a duration


async def _one(client: httpx.AsyncClient, i: int, tier: str, start: float, order: Iterator[int], out: list) -> None:
    rng = random.Random(i)
    body = {"model": "kvmesh-tiny", "prompt": [rng.randrange(100, 2000) for _ in range(64)], "max_tokens": 16,
            "ignore_eos": True, "stream": True, "priority": tier, "router_explain": True}  # fmt: skip
    sent_at = time.monotonic()
    sent, first, ttft = next(order), None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        retry_after = r.headers.get("retry-after")
        route = r.headers.get("x-kvmesh-route")
        async for line in r.aiter_lines():
            if first is None and line.startswith('data: {"id"') and '"text":""' not in line:
                first, ttft = next(order), time.monotonic() - sent_at
    worker = json.loads(route)["worker"] if route else None
    out.append(Result(sent_at - start, tier, r.status_code, sent, first, worker, retry_after, ttft))


async def _overload(url: str) -> list[Result]:
    results: list[Result] = []
    order = itertools.count()  # one loop: the order in which this client saw sends and first tokens
    rng = random.Random(3)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=2000)) as client:
        start = time.monotonic()
        tasks = []
        for i in range(int(OFFERED_RPS * DURATION_S)):
            delay = start + i / OFFERED_RPS - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_one(client, i, rng.choice(TIERS), start, order, results)))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return results


def overtaking(results: list[Result]) -> tuple[int, int]:
    """Premium requests sent while a standard one was waiting on the same worker (sent,
    no first token yet): how many such pairs, and in how many the premium request's
    first token came first. FCFS would serve the standard one first in nearly all."""
    late = [r for r in results if r.at >= WARMUP_S and r.status == 200 and r.first is not None]
    premium = [r for r in late if r.tier == "premium"]
    standard = [r for r in late if r.tier == "standard"]
    pairs = [(p, s) for p in premium for s in standard if p.worker == s.worker and s.sent < p.sent < s.first]
    return len(pairs), sum(p.first < s.first for p, s in pairs)


async def _highest_level(url: str, stop: asyncio.Event) -> float:
    highest = 0.0
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            text = (await client.get("/metrics")).text
            highest = max(highest, float(re.search(r"^kvmesh_degradation_level ([0-9.]+)$", text, re.M).group(1)))
            await asyncio.sleep(0.25)
    return highest


async def test_three_times_overload_sheds_best_effort_and_keeps_premium_fast(tmp_path):
    with kvmesh_run(tmp_path, *ARGS, workers=2, speedup=str(SPEEDUP)) as server:
        rss_before = _rss_kib(server.proc.pid)
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(_highest_level(server.url, stop))
        results = await _overload(server.url)
        stop.set()
        level = await watcher
        rss_after = _rss_kib(server.proc.pid)
    late = [r for r in results if r.at >= WARMUP_S]
    premium = [r for r in late if r.tier == "premium"]
    best_effort = [r for r in late if r.tier == "best_effort"]
    assert level >= 2, "the overload was not noticed"
    assert premium and all(r.status == 200 for r in premium), "premium requests were refused"
    standard = [r for r in late if r.tier == "standard" and r.status == 200]
    assert len(premium) >= 10 and len(standard) >= 10, (len(premium), len(standard))
    # premium jumps the queue: ordered by what the client saw happen, not by how long it took
    pairs, overtook = overtaking(results)
    print(f"premium sent behind a waiting standard request on its worker: first in {overtook} of {pairs}, level {level}")
    assert pairs >= 10, f"only {pairs} premium requests found a standard one waiting: no queue to jump"
    assert overtook >= 0.8 * pairs, f"premium got its first token first in only {overtook} of {pairs} cases"
    shed = [r for r in best_effort if r.status == 503]
    assert len(shed) >= 0.9 * len(best_effort), f"only {len(shed)} of {len(best_effort)} best-effort requests shed"
    assert all(r.retry_after is not None and int(r.retry_after) >= 1 for r in shed), "a shed request lacks Retry-After"
    assert rss_after - rss_before < 64 * 1024, f"frontend grew {(rss_after - rss_before) / 1024:.0f} MiB"
