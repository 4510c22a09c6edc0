"""What adapter affinity buys: the KV router's LoRA cost term (router/cost.py) on a
virtual clock, against the same router without it and against round-robin.

A fleet of W workers serves requests for A LoRA adapters (Zipf popularity); each
worker holds at most M adapters (least recently used unloaded), loading one it lacks
takes LOAD_MS before the prefill; each worker prefills one request at a time at
RATE tokens per ms. The router is the real :class:`~kvmesh.router.core.KvRouterCore`
with :class:`~kvmesh.router.adapters.AdapterAffinity`; time is virtual, so the figures
do not depend on the machine. Prints adapter loads per 100 requests and TTFT
percentiles per arm.

    python bench/lora_affinity.py [--workers 8] [--adapters 32] [--requests 4000]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
from collections import OrderedDict

from kvmesh.router.adapters import AdapterAffinity
from kvmesh.router.core import KvRouterCore, RouterSettings
from kvmesh.router.cost import adapter_load_tokens

PROMPT, BLOCK, RATE, LOAD_MS, DECODE_MS = 256, 16, 8.0, 50.0, 200.0


def run(arm: str, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    weights = [1 / (i + 1) ** args.zipf for i in range(args.adapters)]
    load_tokens = adapter_load_tokens(LOAD_MS, RATE) if arm == "affinity" else 0.0
    core = KvRouterCore(RouterSettings(block_size=BLOCK, adapter_load_tokens=load_tokens, seed=args.seed))
    view = AdapterAffinity()
    held: dict[int, OrderedDict[str, None]] = {}
    busy = dict.fromkeys(range(args.workers), 0.0)
    for w in range(args.workers):
        core.add_worker(w)
        view.add_worker(w, args.max_adapters)
        held[w] = OrderedDict()
    events: list[tuple[float, int, str, str]] = []  # (time, tie, kind, request id)
    tie, turn, now = itertools.count(), itertools.cycle(range(args.workers)), 0.0
    loads, ttfts = 0, []
    prefill_ms = PROMPT / RATE
    for i in range(args.requests):
        now += rng.expovariate(args.load * args.workers / prefill_ms)
        while events and events[0][0] <= now:  # the router hears first tokens and ends in time order
            t, _, kind, rid = heapq.heappop(events)
            (core.first_token if kind == "first" else core.finished)(rid, t)
        adapter = f"a{rng.choices(range(args.adapters), weights)[0]}"
        prompt = [rng.randrange(1000, 30000) for _ in range(PROMPT)]  # no prefix shared: only the adapter matters
        rid = f"r{i}"
        if arm == "round_robin":
            w = next(turn)
        else:
            w = core.route(rid, prompt, now, holders=view.holders(adapter)).worker_id
            view.routed(w, adapter)
        lacks = adapter not in held[w]
        held[w][adapter] = None
        held[w].move_to_end(adapter)
        while len(held[w]) > args.max_adapters:
            held[w].popitem(last=False)
        loads += lacks
        start = max(now, busy[w])
        first = start + (LOAD_MS if lacks else 0.0) + prefill_ms
        busy[w] = first
        ttfts.append(first - now)
        if arm != "round_robin":
            heapq.heappush(events, (first, next(tie), "first", rid))
            heapq.heappush(events, (first + DECODE_MS, next(tie), "end", rid))
    q = statistics.quantiles(ttfts, n=100)
    return {"loads per 100": 100 * loads / args.requests, "TTFT p50 ms": q[49], "TTFT p99 ms": q[98]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--max-adapters", type=int, default=4)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--load", type=float, default=0.3, help="offered prefill load, a fraction of the fleet's (without loads)")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    print(f"{args.workers} workers, {args.adapters} adapters (Zipf {args.zipf}), {args.max_adapters} resident per worker, "
          f"load {LOAD_MS:g} ms, prefill {PROMPT / RATE:g} ms, offered load {args.load:g}, {args.requests} requests")
    print(f"| arm | adapter loads per 100 requests | TTFT p50 ms | TTFT p99 ms |\n| --- | ---: | ---: | ---: |")
    for arm in ("affinity", "no_load_cost", "round_robin"):
        r = run(arm, args)
        print(f"| {arm} | {r['loads per 100']:.1f} | {r['TTFT p50 ms']:.1f} | {r['TTFT p99 ms']:.1f} |")


if __name__ == "__main__":
    main()
