"""Hand-offs go where the capacity is (issue 32, item 4): with three mocker workers, a
worker ejected while it still answers hands its streams to the healthy worker with the
most free KV per request it holds, not to whichever the router would pick next.

``kvmesh run --router-mode round_robin --drain-migrate`` with three workers: one (the
busy target) holds eight long streams pinned to it, another (the idle target) holds
none, and the victim holds four streams when a fault makes it 100× slower, so its
canaries eject it while it answers. The monitor books the two healthy workers' free
blocks ÷ (1 + requests held): all four moves land on the idle worker. Without the
capacity ledger the round-robin router would split them two and two; a ledger that
picked the fullest worker would send them all to the busy one — both fail here."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.e2e.test_health import _fault, _workers
from tests.e2e.test_migrate_kv_on_eject import _moves, _wait_healthy
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ARGS = ("--admin", "--router-mode", "round_robin", "--drain-migrate", "--canary-interval", "0.5",
        "--canary-timeout", "1", "--breaker-recovery", "600")  # fmt: skip
MOVED = 4
LONG = 600  # tokens: the moving streams outlast the ejection (~2 s) by far
BUSY = 8


async def _stream(client: openai.AsyncOpenAI, prompt: str, worker: str, tokens: int, started: asyncio.Event) -> int:
    stream = await client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=tokens, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                             extra_headers={"x-kvmesh-worker": worker})  # fmt: skip
    seen, generated = 0, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            seen += 1
            if seen >= 3:
                started.set()
        if chunk.usage is not None:
            generated = chunk.usage.completion_tokens
    return generated


async def _drill(url: str, victim: str, busy: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    load = [asyncio.Event() for _ in range(BUSY)]
    held = [asyncio.ensure_future(_stream(client, f"the busy worker's story {i}", busy, 2000, e)) for i, e in enumerate(load)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in load)), 60)
    started = [asyncio.Event() for _ in range(MOVED)]
    moving = [asyncio.ensure_future(_stream(client, f"stream {i} that will move", victim, LONG, e)) for i, e in enumerate(started)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    assert not any(t.done() for t in held), "the busy worker's streams ended before the hand-off"
    await asyncio.to_thread(_fault, url, victim, "slow:factor=100")
    counts = await asyncio.wait_for(asyncio.gather(*moving), 90)
    assert counts == [LONG] * MOVED, counts
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    await client.close()


@pytest.mark.timeout(150)
def test_handed_off_streams_go_to_the_worker_with_free_capacity(tmp_path):
    with kvmesh_run(tmp_path, *ARGS, workers=3, speedup="1") as server:
        url = server.url
        _wait_healthy(url, 3, 40)
        victim, busy, idle = sorted(_workers(url))
        asyncio.run(_drill(url, victim, busy))
        moves = _moves(url)
        print("moves by (method, source, target):", moves, "victim", victim, "busy", busy, "idle", idle)
        from_victim = {k: v for k, v in moves.items() if k[1] == victim}
        assert from_victim.get(("kv_transfer", victim, idle), 0) == MOVED, from_victim
        assert sum(from_victim.values()) == MOVED, from_victim
