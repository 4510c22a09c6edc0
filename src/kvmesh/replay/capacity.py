"""Measure the workers' capacity profile on the virtual clock (``kvmesh replay
--profile-capacity OUT.json``).

For each mix of a grid (prompt × output tokens: the trace's 10th and 90th percentiles
of each, or its median where they are within 2x of each other), a steady Poisson load of that mix (lengths ±25 %, no shared prefix beyond
the first block) is replayed at rising rates, each for two lifetimes of a request
that just meets the SLOs (at least ``requests`` requests, at most ``max_requests``:
a short burst would fit in one batch and measure nothing); the highest rate at which
the SLOs hold for ``attainment`` of the requests is the capacity, found by doubling
from a guess and then bisecting (in log scale, to ``1.19×``):

* ``aggregated_rps``: one aggregated worker;
* ``prefill_rps``: a fleet of one prefill worker and three decode workers (decode
  ample: the prefill worker is what runs out), the same thresholds and queue as the
  replay's disaggregated arms;
* ``decode_rps``: three prefill workers and one decode worker.

The result is a :class:`~kvmesh.planner.profile.CapacityProfile` (the planner's
``--capacity-profile``). The mocker's timing model is the one measured: a profile
is only as true as that model is of the real workers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.planner.profile import CapacityPoint, CapacityProfile
from kvmesh.protocol import PreprocessedRequest
from kvmesh.replay.arms import Arm, DisaggModel, default_router, run_arm
from kvmesh.replay.goodput import Slo, meets
from kvmesh.replay.report import percentile
from kvmesh.replay.trace import TRACE_BLOCK_TOKENS, TokenSynth, TraceRequest, arrivals

__all__ = ["trace_mixes", "steady_load", "max_rate", "measure_profile"]

_ROLES = (("aggregated", Arm("aggregated"), 1), ("prefill", Arm("disagg:1p3d", 1, 3), 4), ("decode", Arm("disagg:3p1d", 3, 1), 4))


def trace_mixes(trace: Sequence[TraceRequest]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The grid: the 10th and 90th percentiles of the trace's prompt and output lengths
    (beyond them the profile extrapolates along its edges), or the median alone where
    they are within 2x (a narrow mix: one point measures it)."""
    if not trace:
        raise ValueError("the trace is empty")

    def axis(values: list[int]) -> tuple[int, ...]:
        low, high = (max(1, round(percentile(values, q))) for q in (10, 90))
        return (low, high) if high >= 2 * low else (max(1, round(percentile(values, 50))),)

    return axis(sorted(r.input_length for r in trace)), axis(sorted(r.output_length for r in trace))


def steady_load(rate: float, input_tokens: int, output_tokens: int, n: int, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, rows, next_id = 0.0, [], 1
    for i in range(n):
        t += rng.expovariate(rate)
        n_in = max(1, round(input_tokens * rng.uniform(0.75, 1.25)))
        n_out = max(1, round(output_tokens * rng.uniform(0.75, 1.25)))
        blocks = -(-n_in // TRACE_BLOCK_TOKENS)
        rows.append(TraceRequest(i + 1, t * 1000.0, n_in, n_out, (0, *range(next_id, next_id + blocks - 1))))
        next_id += blocks - 1
    return rows


def max_rate(ok: Callable[[float], bool], guess: float, steps: int = 4, limit: int = 10) -> float:
    """The highest rate ``ok`` accepts (assumed monotone): bracket by doubling or halving
    from ``guess`` (at most ``limit`` times), then ``steps`` bisections in log scale."""
    lo, hi = 0.0, 0.0
    rate = guess
    for _ in range(limit):
        if ok(rate):
            lo = rate
            if hi:
                break
            rate *= 2
        else:
            hi = rate
            if lo:
                break
            rate /= 2
    if not lo:
        raise ValueError(f"no rate down to {rate:.3g} req/s meets the SLOs: check the SLOs and the workers' options")
    if not hi:
        return lo
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def measure_profile(
    inputs: Sequence[int], outputs: Sequence[int], options: MockerOptions, slo: Slo, model: DisaggModel,
    attainment: float = 0.99, requests: int = 150, router: str = "kv", seed: int = 0, max_requests: int = 800,
    progress: Callable[[str], None] | None = None,
) -> CapacityProfile:  # fmt: skip
    if requests < 20 or not 0 < attainment <= 1:
        raise ValueError("a capacity measurement needs at least 20 requests per rate and 0 < attainment <= 1")
    need = max(inputs) * 5 // 4 + max(outputs) * 5 // 4 + 2
    options = options if options.context_length >= need else replace(options, context_length=need)
    points = []
    for n_in in inputs:
        for n_out in outputs:
            rates: dict[str, float] = {}
            for name, arm, workers in _ROLES:
                lifetime_s = (slo.ttft_ms + n_out * 1.25 * slo.itl_ms) / 1000.0

                def ok(rate: float, arm: Arm = arm, workers: int = workers, lifetime_s: float = lifetime_s) -> bool:
                    n = min(max(requests, math.ceil(rate * 2 * lifetime_s)), max_requests)
                    trace = steady_load(rate, n_in, n_out, n, seed)
                    stream = arrivals(trace, TokenSynth(options.vocab_size))
                    run = run_arm(arm, stream, options, workers, default_router(router, options, seed), model)
                    return sum(meets(r, slo) for r in run.records) >= attainment * len(run.records)

                guess = 1000.0 / max(options.remote_prefill_ms(n_in) + n_out * options.decode_ms(0.2) / 64, 1.0)
                rates[name] = max_rate(ok, guess, steps=2)
                if progress is not None:
                    progress(f"{n_in} prompt / {n_out} output tokens: {name} {rates[name]:.3g} req/s per worker")
            points.append(CapacityPoint(n_in, n_out, rates["prefill"], rates["decode"], rates["aggregated"]))
    note = (f"kvmesh replay --profile-capacity: mocker block_size={options.block_size} num_blocks={options.num_blocks} "
            f"speedup={options.speedup:g} max_num_seqs={options.max_num_seqs}, {requests}..{max_requests} requests per rate")  # fmt: skip
    return CapacityProfile(slo.ttft_ms, slo.itl_ms, attainment, tuple(points), note)
