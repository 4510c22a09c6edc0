#!/usr/bin/env python3
"""Short-prompt TTFT while long prompts are being preprocessed (issue 19, item 2).

One ``kvmesh run --workers 1 --speedup 1e9 --canary-interval 0`` per arm (a source tree
on PYTHONPATH, as in ``frontend_ab.py``; ``--base-commit C`` adds an arm ``before``
from ``git archive C src``), serving the bundled model with its context raised to
256k tokens. The mocker is instant, so the time a request spends is the frontend's:
templating, tokenizing, routing, streaming. Each round, for each arm in alternating
order:

* **alone**: one client sends ``--short-requests`` short text prompts
  (``--short-tokens`` one-token words, distinct per request, ``max_tokens=4``),
  one after another; TTFT is send → first text event;
* **beside long**: the same, while ``--long-concurrency`` clients send long text
  prompts (``--long-tokens`` words each, distinct, ``max_tokens=1``) back to back.

Printed per arm: short-prompt TTFT p50/p90 alone and beside long prompts (medians over
rounds), the slowdown (beside ÷ alone, median of per-round ratios), the long prompts
completed per second, and each arm's ratios to the first arm. A frontend that builds
long prompts on its event loop shows a slowdown of many milliseconds per long prompt;
one that builds them off the loop (and, for threads, a tokenizer that releases the GIL)
shows only the CPU the machine has left.

    python bench/long_prompt_ttft.py --base-commit 86ba59b^1          # inline vs now
    python bench/long_prompt_ttft.py --rounds 5 --long-tokens 64000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import (  # noqa: E402
    source_arms,
    HttpConnection,
    build_request,
    check_loopback,
    free_port,
    kvmesh_command,
    launch_server,
    percentile,
    precompile_kvmesh,
    wait_ready_async,
)
from trace_replay import MODEL, model_folder, one_token_words  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/long_prompt_ttft.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", default=[], help="LABEL=SRC[,VAR=VALUE...] (repeatable; default now=src)")
    p.add_argument("--base-commit", help="add an arm 'before' built from this commit's src/ (git archive)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--short-requests", type=int, default=40)
    p.add_argument("--short-tokens", type=int, default=200)
    p.add_argument("--long-tokens", type=int, default=48_000)
    p.add_argument("--long-concurrency", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0)
    return p.parse_args()


def _arms(a: argparse.Namespace, tmp: str) -> list[tuple[str, str, dict[str, str]]]:
    return source_arms(REPO, a.base_commit, a.arm or ["now=src"], tmp)


class Prompts:
    """Distinct text prompts of exactly ``n`` one-token words."""

    def __init__(self, words: list[str], seed: int) -> None:
        self.words = words
        self.rng = random.Random(seed)

    def body(self, n: int, max_tokens: int) -> bytes:
        text = " " + " ".join(self.rng.choice(self.words) for _ in range(n))
        return json.dumps({"model": MODEL, "prompt": text, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True}).encode()  # fmt: skip


async def _ttft_ms(url: str, body: bytes, timeout: float) -> float | None:
    host, port = check_loopback(url)
    conn = await HttpConnection.connect(host, port)
    try:
        r = await conn.request(build_request("POST", "/v1/completions", host, port, body), timeout)
    finally:
        conn.close()
    if not r.ok or r.status != 200 or r.t_first is None:
        print(f"[long] request failed: {r.error or r.status}", file=sys.stderr)
        return None
    return (r.t_first - r.t_send) * 1000.0


async def _shorts(url: str, prompts: Prompts, a: argparse.Namespace) -> list[float]:
    out = []
    for _ in range(a.short_requests):
        ms = await _ttft_ms(url, prompts.body(a.short_tokens, 4), a.timeout)
        if ms is not None:
            out.append(ms)
    return out


async def _longs(url: str, prompts: Prompts, a: argparse.Namespace, stop: asyncio.Event, done: list[int]) -> None:
    # bodies built ahead (48k words take ~20 ms to join; the client must not be the bottleneck)
    bodies = [prompts.body(a.long_tokens, 1) for _ in range(4)]
    i = 0
    while not stop.is_set():
        if await _ttft_ms(url, bodies[i % len(bodies)], a.timeout) is not None:
            done[0] += 1
        i += 1


async def _round(url: str, words: list[str], a: argparse.Namespace, seed: int) -> dict[str, float]:
    alone = await _shorts(url, Prompts(words, seed), a)
    stop, done = asyncio.Event(), [0]
    longs = [asyncio.ensure_future(_longs(url, Prompts(words, seed * 100 + k), a, stop, done))
             for k in range(a.long_concurrency)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        beside = await _shorts(url, Prompts(words, seed + 7), a)
    finally:
        stop.set()
        await asyncio.gather(*longs)
    wall = time.perf_counter() - t0
    return {"alone_p50": percentile(alone, 50) or 0.0, "alone_p90": percentile(alone, 90) or 0.0,
            "beside_p50": percentile(beside, 50) or 0.0, "beside_p90": percentile(beside, 90) or 0.0,
            "longs_per_s": done[0] / wall}  # fmt: skip


async def _main(a: argparse.Namespace) -> int:
    precompile_kvmesh()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(tmp)
        words = one_token_words(model)
        arms = _arms(a, tmp)
        servers = []
        try:
            for label, src, extra in arms:
                port = free_port()
                env = dict(os.environ, PYTHONPATH=src, **extra)
                cmd = kvmesh_command(port, extra=["--canary-interval", "0", "--model-path", model])
                servers.append((label, launch_server(cmd, port, env=env)))
            for _, server in servers:
                await wait_ready_async(server.url, 180, proc=server.proc)
            rows: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in arms}
            for rnd in range(a.rounds):
                for label, server in servers if rnd % 2 == 0 else servers[::-1]:
                    r = await _round(server.url, words, a, rnd + 1)
                    rows[label].append(r)
                    print(f"[long] round {rnd + 1} {label:>8}: short TTFT p50 alone {r['alone_p50']:7.1f} ms, beside "
                          f"{a.long_concurrency} x {a.long_tokens:,}-token prompts {r['beside_p50']:7.1f} ms "
                          f"(p90 {r['beside_p90']:7.1f}); {r['longs_per_s']:.2f} long/s", file=sys.stderr, flush=True)
        finally:
            for _, server in servers:
                server.stop()
    _report(rows, a)
    return 0


def _report(rows: dict[str, list[dict[str, float]]], a: argparse.Namespace) -> None:
    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[label])

    first = next(iter(rows))
    print(f"\nshort prompts ({a.short_tokens} tokens) beside {a.long_concurrency} clients of {a.long_tokens:,}-token "
          f"prompts; medians of {a.rounds} rounds (ms)")  # fmt: skip
    print(f"{'arm':>10} {'alone p50':>10} {'alone p90':>10} {'beside p50':>11} {'beside p90':>11} {'slowdown p50':>13} "
          f"{'long/s':>7} {'beside p50 / ' + first:>20}")  # fmt: skip
    for label in rows:
        slow = statistics.median(r["beside_p50"] / r["alone_p50"] for r in rows[label] if r["alone_p50"])
        paired = statistics.median(x["beside_p50"] / y["beside_p50"] for x, y in zip(rows[label], rows[first])
                                   if y["beside_p50"])  # fmt: skip
        print(f"{label:>10} {med(label, 'alone_p50'):10.1f} {med(label, 'alone_p90'):10.1f} {med(label, 'beside_p50'):11.1f} "
              f"{med(label, 'beside_p90'):11.1f} {slow:12.2f}x {med(label, 'longs_per_s'):7.2f} {paired:19.2f}x")  # fmt: skip
    print("(slowdown: median of the per-round ratios beside ÷ alone; the last column pairs each round's arms)")


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(_parse())))
