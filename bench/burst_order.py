#!/usr/bin/env python3
"""In what order should the frontend release a burst of prompts? A virtual-clock replay.

The Mooncake conversation trace arrives in bursts: ~110 groups of 2–17 requests with the
same timestamp in its first 1,000 requests. The frontend routes a request (and it joins
its worker's FCFS queue) when its prompt is tokenized, so the order in which the
preprocessing pool releases a burst is the order the fleet serves it. This replays the
trace (``kvmesh replay``'s engine: the mocker's model on a virtual clock, the product's
router) with every burst reordered, spread over a few milliseconds of random gaps (what
tokenizing takes) and prints per order: TTFT p50/p99 and per-request ITL p50/p99 (ITL
as aiperf defines it: (last − first token) ÷ (tokens − 1)), for each routing policy:

* ``arrival``: the trace's own order (what a FIFO pool gives);
* ``smallest``: smallest prompt first (a shortest-job-first pool);
* ``small<N``: prompts under N tokens smallest first, then the rest in arrival order
  (the pool before it put long prompts largest first);
* ``small<N+largest``: prompts under N tokens smallest first, then the rest largest first
  (what :class:`kvmesh.preprocess.preprocessor.SizedPool` does with ``LONG_CHARS``);
* ``largest``: largest first.

``--shuffle``: each burst first in a random order of its own, as a client with several
connections sends it (aiperf does), so "arrival" is the client's order, not the trace's.

    python bench/burst_order.py                       # 1,000 requests, the trace_replay fleet
    python bench/burst_order.py --orders arrival,small<8000 --seeds 3
    python bench/burst_order.py --shuffle --orders small<7000,small<10500+largest --seeds 4
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _lib import percentile  # noqa: E402
from trace_replay import DEFAULT_TRACE, FLEET  # noqa: E402

from kvmesh.engines.mocker.options import MockerOptions  # noqa: E402
from kvmesh.replay.runner import ReplayConfig, replay_policy  # noqa: E402
from kvmesh.replay.trace import TraceRequest, load_trace  # noqa: E402

Order = Callable[[list[TraceRequest]], list[TraceRequest]]


def order_named(name: str) -> Order:
    if name == "arrival":
        return lambda burst: burst
    if name == "smallest":
        return lambda burst: sorted(burst, key=lambda r: r.input_length)
    if name == "largest":
        return lambda burst: sorted(burst, key=lambda r: -r.input_length)
    if name.startswith("small<"):
        limit_text, _, rest = name[len("small<"):].partition("+")
        limit = int(limit_text)
        if rest not in ("", "largest"):
            raise SystemExit(f"unknown order {name!r}")
        sign = -1 if rest else 0  # 0: the long ones keep their order (sorted is stable)
        return lambda burst: (sorted((r for r in burst if r.input_length < limit), key=lambda r: r.input_length)
                              + sorted((r for r in burst if r.input_length >= limit),
                                       key=lambda r: sign * r.input_length))  # fmt: skip
    raise SystemExit(f"unknown order {name!r}")


def reordered(trace: Sequence[TraceRequest], order: Order, rng: random.Random, gap_ms: float,
              shuffle: bool = False) -> list[TraceRequest]:  # fmt: skip
    """Each burst (same timestamp) in ``order`` (after a random shuffle with ``shuffle``),
    its requests a random 0.1–``gap_ms`` ms apart."""
    out: list[TraceRequest] = []
    for ts, group in itertools.groupby(trace, key=lambda r: r.timestamp_ms):
        burst = list(group)
        if shuffle:
            rng.shuffle(burst)
        t = ts
        for r in order(burst):
            t += rng.uniform(0.1, gap_ms)
            out.append(replace(r, timestamp_ms=t))
    return out


def one(trace: Sequence[TraceRequest], policy: str) -> tuple[float, float, float, float]:
    mocker = MockerOptions(block_size=FLEET["block_size"], speedup=FLEET["speedup"], num_blocks=FLEET["num_blocks"],
                           max_num_seqs=FLEET["max_num_seqs"], max_num_batched_tokens=FLEET["max_num_batched_tokens"])  # fmt: skip
    records = replay_policy(policy, trace, ReplayConfig(policies=(policy,), workers=int(FLEET["workers"]), mocker=mocker))
    ttft = [r.ttft_ms for r in records if r.ttft_ms is not None]
    itl = [(r.token_times_ms[-1] - r.token_times_ms[0]) / (len(r.token_times_ms) - 1)
           for r in records if len(r.token_times_ms) > 1]  # fmt: skip
    return (percentile(ttft, 50) or 0.0, percentile(ttft, 99) or 0.0, percentile(itl, 50) or 0.0,
            percentile(itl, 99) or 0.0)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--orders", default="arrival,smallest,small<8000,small<14000,largest")
    ap.add_argument("--policies", default="kv,round_robin")
    ap.add_argument("--seeds", type=int, default=2, help="random spreads per order (medians are printed)")
    ap.add_argument("--gap-ms", type=float, default=3.0, help="largest gap between a burst's requests")
    ap.add_argument("--shuffle", action="store_true", help="each burst in a random client order first")
    a = ap.parse_args()
    trace = load_trace(a.trace, limit=a.requests)
    print(f"{len(trace)} requests of {Path(a.trace).name}; {FLEET['workers']} mocker workers, block "
          f"{FLEET['block_size']}, {FLEET['num_blocks']} blocks, speedup {FLEET['speedup']:g}; medians of "
          f"{a.seeds} spreads; times in ms\n")  # fmt: skip
    print("| order | policy | TTFT p50 | TTFT p99 (range) | ITL p50 | ITL p99 |\n|---|---|---|---|---|---|")
    for name in a.orders.split(","):
        for policy in a.policies.split(","):
            runs = [one(reordered(trace, order_named(name), random.Random(s), a.gap_ms, a.shuffle), policy)
                    for s in range(a.seeds)]  # fmt: skip
            med = [statistics.median(col) for col in zip(*runs)]
            p99s = sorted(r[1] for r in runs)
            print(f"| {name} | {policy} | {med[0]:.1f} | {med[1]:.1f} ({p99s[0]:.0f}–{p99s[-1]:.0f}) | {med[2]:.2f} "
                  f"| {med[3]:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
