"""Measure the workers' capacity profile on the virtual clock (``kvmesh replay
--profile-capacity OUT.json``).

For each mix of a grid (prompt × output tokens: the trace's 10th, 50th and 90th
percentiles of each, or its median alone where the 10th and 90th are within 2x), a
steady Poisson load of that mix (lengths ±25 %, every prompt's first block shared, and
the trace's prefix sharing beyond it: :class:`PrefixReuse`) is replayed at rising
rates, each for two lifetimes of a request that just meets the SLOs (at least
``requests`` requests, at most ``max_requests``: a short burst would fit in one batch
and measure nothing); the highest rate at which the SLOs hold for ``attainment`` of
the requests is the capacity. :func:`max_rate` finds it: a bracket grown from a guess
in widening steps (×1.5, ×2.25, ×4 …), then bisections in log scale until the
bracket's ends are within ``tolerance`` (default 1.05: the capacity is at most 5 %
low). Each role's bracket is recorded in the profile (``bounds``).

* ``aggregated_rps``: one aggregated worker;
* ``prefill_rps``: a fleet of one prefill worker and three decode workers (decode
  ample: the prefill worker is what runs out), the same thresholds and queue as the
  replay's disaggregated arms;
* ``decode_rps``: three prefill workers and one decode worker.

A mix that no rate serves at the SLOs (one request alone misses them: e.g. a
27k-token prompt's prefill takes longer than the TTFT SLO) is recorded with 0 req/s
for that role and the reason in ``infeasible``, and the measurement goes on; the
planner sizes such a mix with the role's least measured capacity and says the SLOs
are not attainable there (:func:`kvmesh.planner.profile.size_fleet`).

**Prefix sharing.** A prompt whose leading blocks are cached is prefilled only past
them, and its shared blocks are held once in the KV pool: a profile measured on prompts
that share nothing over-states the prefill work of a trace whose turns continue earlier
ones (the whole conversation trace: 38.7 % of requests continue an earlier prompt, over
75.6 % of their blocks). :func:`trace_reuse` measures the trace's sharing from its hash
ids (the share of requests whose leading run of seen blocks is longer than the first
block, and that run's depth, block-weighted); the probes carry it: that share of their
requests continue a random earlier request of the probe over that depth of their blocks
(the earlier prompt's leading blocks, as many as it has). The note says what was
measured with. A trace with no sharing gets the probes it always had.

What a profile does not tell: which P/D split serves a trace whose requests arrive in
groups. The conversation trace's 12,031 requests come at 1,180 instants (10 at each): a
group of long prompts fills the bounded prefill queue at once, and the rest prefill on
the decode workers. As recorded, it serves more at 1p3d than at 2p2d (8.04 vs 7.60
req/s at speed 2.5, 4 workers, SLOs 2000/35 ms); in the same order at Poisson times,
more at 2p2d (8.26 vs 8.09), as the probes' fleets say at every mix. Probes in groups of
ten of one mix are no model of it (a group of ten 27k-token prompts meets the TTFT at no
rate, where the trace's groups mix lengths): a profile is per mix, and what grouping
costs depends on the whole mixture.

The result is a :class:`~kvmesh.planner.profile.CapacityProfile` (the planner's
``--capacity-profile``). The mocker's timing model is the one measured: a profile
is only as true as that model is of the real workers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord
from kvmesh.planner.profile import PROFILE_VERSION, CapacityPoint, CapacityProfile
from kvmesh.protocol import PreprocessedRequest
from kvmesh.replay.arms import Arm, DisaggModel, default_router, run_arm
from kvmesh.replay.goodput import Slo, mean_itl_ms, meets
from kvmesh.replay.report import percentile
from kvmesh.replay.trace import TRACE_BLOCK_TOKENS, TokenSynth, TraceRequest, arrivals

__all__ = ["Bounds", "PrefixReuse", "trace_mixes", "trace_reuse", "steady_load", "max_rate", "measure_profile"]

_ROLES = (("prefill", Arm("disagg:1p3d", 1, 3), 4), ("decode", Arm("disagg:3p1d", 3, 1), 4), ("aggregated", Arm("aggregated"), 1))
_LONE = 0.05  # the lowest rate tried: one request per 20 lifetimes (a request alone, nearly always)


@dataclass(frozen=True, slots=True)
class Bounds:
    """What :func:`max_rate` found: the SLOs held at ``low`` (0: at no rate tried) and
    failed at ``high`` (None: at no rate tried)."""

    low: float
    high: float | None

    def pair(self) -> tuple[float, float | None]:
        return self.low, self.high


def trace_mixes(trace: Sequence[TraceRequest]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The grid: the 10th, 50th and 90th percentiles of the trace's prompt and output
    lengths (the median so the planner interpolates between measured mixes; beyond the
    ends the profile extrapolates along its edges), or the median alone where the 10th
    and 90th are within 2x (a narrow mix: one point measures it)."""
    if not trace:
        raise ValueError("the trace is empty")

    def axis(values: list[int]) -> tuple[int, ...]:
        low, mid, high = (max(1, round(percentile(values, q))) for q in (10, 50, 90))
        return tuple(sorted({low, mid, high})) if high >= 2 * low else (mid,)

    return axis(sorted(r.input_length for r in trace)), axis(sorted(r.output_length for r in trace))


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """A trace's prefix sharing beyond the first block: ``share`` of the requests
    continue an earlier prompt (their leading run of already-seen blocks is longer than
    one block), and ``depth`` of those requests' blocks are that leading run
    (block-weighted). share × depth is about the trace's block-level reuse past block 0."""

    share: float = 0.0
    depth: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.share <= 1 and 0 <= self.depth <= 1):
            raise ValueError(f"prefix reuse needs share and depth within [0, 1], got {self.share}, {self.depth}")

    def describe(self) -> str:
        if not self.share:
            return "no prefix shared beyond the first block"
        return f"{self.share:.1%} of requests continue an earlier prompt over {self.depth:.1%} of their blocks"


def trace_reuse(trace: Sequence[TraceRequest]) -> PrefixReuse:
    """The trace's :class:`PrefixReuse` from its hash ids (chained: a request shares an
    earlier one's KV for the leading run of ids already seen), with an infinite cache."""
    seen: set[int] = set()
    continued = blocks = shared = 0
    for r in trace:
        run = 0
        while run < len(r.hash_ids) and r.hash_ids[run] in seen:
            run += 1
        if run > 1:
            continued, blocks, shared = continued + 1, blocks + len(r.hash_ids), shared + run
        seen.update(r.hash_ids)
    return PrefixReuse(continued / len(trace) if trace else 0.0, shared / blocks if blocks else 0.0)


def steady_load(rate: float, input_tokens: int, output_tokens: int, n: int, seed: int = 0,
                reuse: PrefixReuse = PrefixReuse()) -> list[TraceRequest]:  # fmt: skip
    """``n`` Poisson arrivals of the mix (lengths ±25 %); every prompt starts with block 0,
    and ``reuse.share`` of them continue a random earlier request over ``reuse.depth`` of
    their blocks (at most the earlier prompt's; new blocks after it)."""
    rng = random.Random(seed)
    t, next_id = 0.0, 1
    rows: list[TraceRequest] = []
    for i in range(n):
        t += rng.expovariate(rate)
        n_in = max(1, round(input_tokens * rng.uniform(0.75, 1.25)))
        n_out = max(1, round(output_tokens * rng.uniform(0.75, 1.25)))
        blocks = -(-n_in // TRACE_BLOCK_TOKENS)
        prefix: tuple[int, ...] = (0,)
        if reuse.share and rows and rng.random() < reuse.share:  # no draw without sharing: the same loads as before
            earlier = rows[rng.randrange(len(rows))].hash_ids
            prefix = earlier[: max(1, min(round(reuse.depth * blocks), len(earlier), blocks))]
        fresh = blocks - len(prefix)
        rows.append(TraceRequest(i + 1, t * 1000.0, n_in, n_out, (*prefix, *range(next_id, next_id + fresh))))
        next_id += fresh
    return rows


def max_rate(ok: Callable[[float], bool], guess: float, tolerance: float = 1.05, floor: float = 0.0,
             limit: int = 12, ceiling: float = math.inf) -> Bounds:  # fmt: skip
    """The highest rate ``ok`` accepts (assumed monotone), bracketed, then bisected in
    log scale until high/low <= ``tolerance``; at most ``limit`` calls of ``ok``. A
    ``guess`` that passes is raised in widening steps (×1.5, then each step squared, at
    most ×4) until a rate fails; one that fails is followed by ``floor`` (the lowest rate
    searched): a failure there means no rate serves (``low`` 0, two calls), a pass
    brackets the capacity (bisection is as cheap on a wide bracket as stepping down).
    Up to ``ceiling`` (the highest rate the probe can judge): a pass there is ``low``
    with no ``high``."""
    if not (tolerance > 1 and guess > 0):
        raise ValueError(f"max_rate needs a tolerance > 1 and a positive guess, got {tolerance}, {guess}")
    low, high, rate, step, calls = 0.0, None, guess, 1.5, 0
    while calls < limit and (not low or high is None):
        calls += 1
        if ok(rate):
            if rate >= ceiling:
                return Bounds(rate, None)
            low, rate, step = rate, min(rate * step, ceiling), min(step * step, 4.0)
        elif rate <= floor:
            return Bounds(0.0, rate)
        else:
            high, rate = rate, (floor if floor > 0 else rate / 4.0)
    while calls < limit and high is not None and low and high / low > tolerance:
        calls += 1
        mid = math.sqrt(low * high)
        low, high = (mid, high) if ok(mid) else (low, mid)
    return Bounds(low, high)


class _Probe:
    """``ok(rate)`` for one role at one mix: a steady load replayed on the role's fleet;
    remembers why the last refused rate failed (the profile's ``infeasible`` reason)."""

    def __init__(self, arm: Arm, workers: int, n_in: int, n_out: int, slo: Slo, ctx: _Context) -> None:
        self.arm, self.workers, self.n_in, self.n_out, self.slo, self.ctx = arm, workers, n_in, n_out, slo, ctx
        self.lifetime_s = (slo.ttft_ms + n_out * 1.25 * slo.itl_ms) / 1000.0
        self.why = ""

    def __call__(self, rate: float) -> bool:
        c = self.ctx
        n = min(max(c.requests, math.ceil(rate * 2 * self.lifetime_s)), c.max_requests)
        trace = steady_load(rate, self.n_in, self.n_out, n, c.seed, c.reuse)
        stream = arrivals(trace, TokenSynth(c.options.vocab_size))
        run = run_arm(self.arm, stream, c.options, self.workers, default_router(c.router, c.options, c.seed), c.model)
        met = sum(meets(r, self.slo) for r in run.records)
        if met >= c.attainment * len(run.records):
            return True
        self.why = _why(run.records, met, rate, self.slo)
        return False


def _why(records: Sequence[RequestRecord], met: int, rate: float, slo: Slo) -> str:
    ttfts = sorted(r.ttft_ms if r.ttft_ms is not None else math.inf for r in records)
    itls = sorted(v for r in records if (v := mean_itl_ms(r)) is not None)
    itl = f"{percentile(itls, 90):.0f}" if itls else "-"
    return (f"at {rate:.3g} req/s {met}/{len(records)} requests met the SLOs: TTFT p90 {percentile(ttfts, 90):.0f} ms "
            f"(SLO {slo.ttft_ms:g}), mean ITL p90 {itl} ms (SLO {slo.itl_ms:g})")  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Context:
    options: MockerOptions
    model: DisaggModel
    attainment: float
    requests: int
    max_requests: int
    router: str
    seed: int
    reuse: PrefixReuse = PrefixReuse()


def measure_profile(
    inputs: Sequence[int], outputs: Sequence[int], options: MockerOptions, slo: Slo, model: DisaggModel,
    attainment: float = 0.99, requests: int = 150, router: str = "kv", seed: int = 0, max_requests: int = 800,
    progress: Callable[[str], None] | None = None, tolerance: float = 1.05, reuse: PrefixReuse = PrefixReuse(),
) -> CapacityProfile:  # fmt: skip
    if requests < 20 or not 0 < attainment <= 1:
        raise ValueError("a capacity measurement needs at least 20 requests per rate and 0 < attainment <= 1")
    need = max(inputs) * 5 // 4 + max(outputs) * 5 // 4 + 2
    options = options if options.context_length >= need else replace(options, context_length=need)
    ctx = _Context(options, model, attainment, requests, max_requests, router, seed, reuse)
    points = [_measure_mix(n_in, n_out, slo, ctx, tolerance, progress) for n_in in inputs for n_out in outputs]
    note = (f"kvmesh replay --profile-capacity: mocker block_size={options.block_size} num_blocks={options.num_blocks} "
            f"speedup={options.speedup:g} max_num_seqs={options.max_num_seqs}, {requests}..{max_requests} requests per rate, "
            f"bounds within {tolerance:g}x; prefix sharing: {reuse.describe()}")  # fmt: skip
    return CapacityProfile(slo.ttft_ms, slo.itl_ms, attainment, tuple(points), note, version=PROFILE_VERSION)


def _alone_s(role: str, n_in: int, n_out: int, o: MockerOptions) -> float:
    """Seconds the role's workers spend on one request with nothing beside it."""
    prefill_ms = o.remote_prefill_ms(n_in)
    return (prefill_ms if role == "prefill" else prefill_ms + n_out * o.decode_ms(0.0) / o.speedup) / 1000.0


def _measure_mix(n_in: int, n_out: int, slo: Slo, ctx: _Context, tolerance: float,
                 progress: Callable[[str], None] | None) -> CapacityPoint:  # fmt: skip
    """One mix, each role: its bounds, and why a role no rate serves fails."""
    found: dict[str, Bounds] = {}
    why: list[str] = []
    o = ctx.options
    guess = 1000.0 / max(o.remote_prefill_ms(n_in) + n_out * o.decode_ms(0.2) / 64, 1.0)
    for name, arm, workers in _ROLES:
        probe = _Probe(arm, workers, n_in, n_out, slo, ctx)
        # below one request per 20 lifetimes a request is alone; above the ceiling a run's
        # max_requests all arrive within the time the role spends on one request alone (a
        # burst: no rate above it can be told apart)
        floor, ceiling = _LONE / probe.lifetime_s, ctx.max_requests / _alone_s(name, n_in, n_out, o)
        b = found[name] = max_rate(probe, min(max(guess, floor), ceiling), tolerance, floor, ceiling=ceiling)
        if not b.low:
            why.append(f"{name}: {probe.why}")
        if progress is not None:
            high = "the probe's ceiling" if b.high is None else f"{b.high:.3g}"
            say = f"{b.low:.3g} req/s per worker (bounds {b.low:.3g}..{high})" if b.low else f"infeasible ({probe.why})"
            progress(f"{n_in} prompt / {n_out} output tokens: {name} {say}")
        if name == "prefill" and not b.low:  # a prefill that misses the TTFT alone: decode ample or not, the same
            guess = floor
    bounds = (found["prefill"].pair(), found["decode"].pair(), found["aggregated"].pair())
    return CapacityPoint(n_in, n_out, found["prefill"].low, found["decode"].low, found["aggregated"].low, bounds, "; ".join(why))
