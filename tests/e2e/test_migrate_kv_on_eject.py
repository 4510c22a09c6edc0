"""A worker that health checks eject while it still answers hands its in-flight
streams off with their KV (issue 32, item 4): ``kvmesh run --drain-migrate`` with two
mocker workers, four long streams pinned to one of them (two standard, then two
premium), then ``POST /admin/fault`` makes it 100× slower, so its canaries time out
and it goes UNHEALTHY while it still answers. Every stream completes with the text the
healthy worker gives the same prompt, every move is counted as ``kv_transfer`` from
the ejected worker, and the premium requests leave first. A worker ejected for wrong
tokens (its KV may be corrupt) re-prefills instead."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from tests.e2e.test_health import _fault, _routed, _wait, _workers
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ARGS = ("--admin", "--trust-priority-header", "--drain-migrate", "--canary-interval", "0.5", "--canary-timeout", "1", "--breaker-recovery", "600")
PROMPTS = [f"stream number {i} tells a long story about migration" for i in range(4)]
PRIORITIES = ["standard", "standard", "premium", "premium"]  # the premium ones arrive last
MAX_TOKENS = 150
CORRUPT_TOKENS = 800  # the streams outlast the corrupt worker's ejection (a canary round or two) on a loaded box


def _moves(url: str) -> dict[tuple[str, str, str], float]:
    """kvmesh_migration_total by (method, source worker, target worker)."""
    text = httpx.get(url + "/metrics").text
    found: dict[tuple[str, str, str], float] = {}
    for labels, value in re.findall(r"kvmesh_migration_total\{([^}]*)\} ([0-9.e+]+)", text):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = (fields["method"], fields["source"], fields.get("target", ""))
        found[key] = found.get(key, 0.0) + float(value)
    return found


def _migrations(url: str) -> dict[tuple[str, str], float]:
    """kvmesh_migration_total by (method, source worker)."""
    found: dict[tuple[str, str], float] = {}
    for (method, source, _), value in _moves(url).items():
        found[method, source] = found.get((method, source), 0.0) + value
    return found


def _wait_healthy(url: str, workers: int, timeout: float) -> None:
    """Until ``workers`` workers are registered, all healthy."""
    _wait(lambda: len(_workers(url)) == workers and all(w["status"] == "healthy" for w in _workers(url).values()),
          timeout, f"{workers} healthy workers")  # fmt: skip


async def _stream(client: openai.AsyncOpenAI, prompt: str, worker: str, priority: str, started: asyncio.Event,
                  tokens: int = MAX_TOKENS) -> str:
    pin = {"x-kvmesh-worker": worker} if worker else None
    stream = await client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=tokens, stream=True,
                                             extra_body={"ignore_eos": True, "priority": priority},
                                             extra_headers=pin)  # fmt: skip
    text = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            text.append(chunk.choices[0].text)
            if len(text) >= 3:
                started.set()
    return "".join(text)


async def _reference(client: openai.AsyncOpenAI, prompt: str, worker: str) -> str:
    out = await client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                          extra_body={"ignore_eos": True}, extra_headers={"x-kvmesh-worker": worker})  # fmt: skip
    return out.choices[0].text


async def _drill(url: str, victim: str, other: str, fault: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    started = [asyncio.Event() for _ in PROMPTS]
    tasks = []
    for prompt, priority, event in zip(PROMPTS, PRIORITIES, started):
        tasks.append(asyncio.ensure_future(_stream(client, prompt, victim, priority, event)))
        await asyncio.wait_for(event.wait(), 60)  # in flight, in this order
    await asyncio.to_thread(_fault, url, victim, fault)
    texts = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    expected = [await _reference(client, p, other) for p in PROMPTS]
    assert texts == expected, "a migrated stream's text differs from the healthy worker's"
    await client.close()
    return texts


@pytest.mark.timeout(120)
def test_an_ejected_worker_that_still_answers_hands_its_streams_off_with_their_kv(tmp_path):
    with kvmesh_run(tmp_path, *ARGS, workers=2, speedup="1") as server:
        url = server.url
        _wait_healthy(url, 2, 30)
        victim, other = sorted(_workers(url))
        asyncio.run(_drill(url, victim, other, "slow:factor=100"))
        assert _workers(url)[victim]["weight"] == 0.0
        moved = _migrations(url)
        print("migrations by (method, source):", moved)
        assert moved.get(("kv_transfer", victim), 0) == 4, moved
        assert moved.get(("re_prefill", victim), 0) == 0, moved
        log = server.log_path.read_text()
        order = re.findall(rf"worker {victim}: handed 4 in-flight requests off with their KV, in order \[([^\]]*)\]", log)
        assert order, log[-3000:]
        tiers = [item.rsplit(":", 1)[1] for item in order[0].split(", ")]
        print("hand-off order:", tiers)
        assert tiers == ["premium", "premium", "standard", "standard"], order


@pytest.mark.timeout(120)
def test_a_worker_ejected_for_wrong_tokens_re_prefills_its_streams(tmp_path):
    with kvmesh_run(tmp_path, *ARGS, workers=2, speedup="1") as server:
        url = server.url
        _wait_healthy(url, 2, 30)
        victim = asyncio.run(_corrupt_drill(url))
        moved = _migrations(url)
        print("migrations by (method, source):", moved)
        assert moved.get(("kv_transfer", victim), 0) == 0, moved
        assert moved.get(("re_prefill", victim), 0) >= 1, moved
        assert "off with their KV, in order" not in server.log_path.read_text()


async def _corrupt_drill(url: str) -> str:
    """Four streams (not pinned: a pinned request never moves), then the worker the
    router gave most of them starts answering wrong tokens; returns that worker."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    started = [asyncio.Event() for _ in PROMPTS]
    tasks = [asyncio.ensure_future(_stream(client, p, "", "standard", e, CORRUPT_TOKENS)) for p, e in zip(PROMPTS, started)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    routed = await asyncio.to_thread(_routed, url)
    victim = max(routed, key=lambda w: routed[w])
    await asyncio.to_thread(_fault, url, victim, "corrupt")
    await asyncio.wait_for(asyncio.gather(*tasks), 90)  # text from before the ejection may be wrong: not compared
    await client.close()
    return victim
