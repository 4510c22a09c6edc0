"""Workers die mid-stream; clients do not notice. 1,000 streamed requests at concurrency
32 across 4 worker processes while 5 workers are SIGKILLed at random moments (and
replaced by the supervisor): every request completes, and every stream equals the one
an undisturbed run gives (the mocker is deterministic), so no token is missing or
repeated."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal

import httpx
import pytest

from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

REQUESTS = 1000
CONCURRENCY = 32
MAX_TOKENS = 32


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(100, 2000) for _ in range(40)]


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[str, int]:
    body = {
        "model": "kvmesh-tiny", "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    text, tokens, done = [], None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            assert line != "event: error", f"request {i}: error event"
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                assert not line.startswith('data: {"error"'), line
                m = re.search(r'"text":("(?:[^"\\]|\\.)*")', line)
                if m:
                    text.append(json.loads(m.group(1)))  # chunk boundaries may differ; the text may not
                u = re.search(r'"completion_tokens":(\d+)', line)
                if u:
                    tokens = int(u.group(1))
    assert done, f"request {i}: stream ended without [DONE]"
    return "".join(text), tokens or 0


async def _run_all(url: str) -> dict[int, tuple[str, int]]:
    results: dict[int, tuple[str, int]] = {}
    queue = list(range(REQUESTS))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def loop() -> None:
            while queue:
                i = queue.pop()
                results[i] = await _stream(client, i)

        await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
    return results


async def _kill_workers(server, count: int, rng: random.Random, stop: asyncio.Event) -> list[int]:
    killed = []
    while len(killed) < count and not stop.is_set():
        await asyncio.sleep(rng.uniform(0.3, 0.9))
        pids = [p for p in server.worker_pids() if p not in killed]
        if pids:
            pid = rng.choice(pids)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


async def test_sigkilled_workers_lose_no_request_and_no_token(tmp_path):
    with kvmesh_run(tmp_path, workers=4, speedup="1") as server:
        undisturbed = await _run_all(server.url)
        assert all(n == MAX_TOKENS for _, n in undisturbed.values())
        stop = asyncio.Event()
        killer = asyncio.ensure_future(_kill_workers(server, 5, random.Random(5), stop))
        disturbed = await _run_all(server.url)
        stop.set()
        killed = await killer
        metrics = httpx.get(server.url + "/metrics").text
    assert len(killed) == 5
    assert len(disturbed) == REQUESTS
    different = [i for i in range(REQUESTS) if disturbed[i] != undisturbed[i]]
    examples = [(i, undisturbed[i], disturbed[i]) for i in different[:2]]
    assert different == [], f"{len(different)} streams differ, e.g. {examples}"
    migrations = sum(float(v) for v in re.findall(r'^kvmesh_migration_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M))
    assert migrations > 0, "no request was caught mid-stream: the test did not test migration"
    assert re.search(r'^kvmesh_migration_duration_seconds_count\{method="re_prefill"\} [1-9]', metrics, re.M)
