"""What the planner reads from the fleet's own metrics, as plain numbers.

:func:`window_quantile` is pure: a quantile of the observations made between two
snapshots of a cumulative histogram (Prometheus buckets), so the planner judges the
latency of the last round, not of the whole run. :func:`histogram_buckets` reads such
a snapshot from a histogram collector (``prometheus_client.Histogram`` or the
frontend's ``LoopHistogram``; every label set summed); :func:`counter_total` a
counter's total (the planner's forecast takes each round's requests and tokens from the
frontend's counters).

:class:`Totals` is what one frontend has counted since it started; :func:`window` turns
two rounds' totals of every frontend into the round's arrivals (requests *admitted*:
finished plus in flight, so a request counts when it comes, not a lifetime later),
their tokens and the round's TTFT/ITL p90. ``kvmesh run --planner`` reads its one
frontend's metrics; ``kvmesh planner`` the frontends' signed reports in discovery
(:mod:`kvmesh.planner.reports`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "window_quantile", "histogram_buckets", "counter_total", "gauge_total", "align", "Buckets", "Totals", "Window",
    "window",
]  # fmt: skip

Buckets = tuple[tuple[float, ...], tuple[float, ...]]  # (upper bounds, cumulative counts), +Inf last


class Collector(Protocol):
    """A metric that yields families with samples (``name``, ``labels``, ``value``), as
    ``prometheus_client``'s collectors and kvmesh's own metrics do."""

    def collect(self) -> Iterable[Any]: ...


def window_quantile(bounds: Sequence[float], before: Sequence[float], now: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of the observations between ``before`` and ``now``
    (cumulative counts per upper bound), interpolated inside its bucket; 0.0 when
    nothing was observed. A quantile in the +Inf bucket is the last finite bound."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    counts = [n - b for n, b in zip(now, before)]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram_buckets(histogram: Collector) -> Buckets:
    """The histogram's cumulative bucket counts now, summed over its label sets."""
    sums: dict[float, float] = {}
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                sums[le] = sums.get(le, 0.0) + sample.value
    bounds = tuple(sorted(sums))
    return bounds, tuple(sums[b] for b in bounds)


def counter_total(counter: Collector) -> float:
    """The counter's value now, summed over its label sets."""
    return float(sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total")))


def gauge_total(gauge: Collector) -> float:
    """The gauge's value now, summed over its label sets."""
    return float(sum(s.value for family in gauge.collect() for s in family.samples))


def align(before: Buckets, now: Buckets) -> tuple[float, ...]:
    """``before``'s counts on ``now``'s bounds (a label set that appeared since: 0)."""
    counts = dict(zip(*before))
    return tuple(counts.get(b, 0.0) for b in now[0])


@dataclass(frozen=True, slots=True)
class Totals:
    """One frontend's counts since it started: requests admitted (finished + in flight)
    and finished, the admitted requests' prompt tokens, the finished ones' generated
    tokens, and its TTFT and ITL histograms (seconds)."""

    admitted: int
    finished: int
    input_tokens: int
    output_tokens: int
    ttft: Buckets
    itl: Buckets


_ZERO = Totals(0, 0, 0, 0, ((), ()), ((), ()))


@dataclass(frozen=True, slots=True)
class Window:
    """A round of the fleet's frontends: requests arrived and finished in it, the
    arrivals' prompt tokens and expected output tokens (their count × the finished
    requests' mean: a request's output is known when it ends), TTFT and ITL p90 (ms)."""

    arrived: int = 0
    finished: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_p90_ms: float = 0.0
    itl_p90_ms: float = 0.0


def window(before: Mapping[int, Totals], now: Mapping[int, Totals]) -> Window:
    """The round between two snapshots of the frontends' totals (by frontend). A
    frontend new since ``before``, or whose counts went back (it restarted), counts from
    zero; one gone since is not counted. Histograms whose bounds differ from the first
    frontend's are left out of the quantiles (a frontend of another version)."""
    deltas = []
    for key, t in now.items():
        b = before.get(key, _ZERO)
        if t.admitted < b.admitted or t.finished < b.finished:
            b = _ZERO
        deltas.append((t, b))
    arrived = sum(t.admitted - b.admitted for t, b in deltas)
    finished = sum(t.finished - b.finished for t, b in deltas)
    out = sum(t.output_tokens - b.output_tokens for t, b in deltas)
    total_out, total_finished = sum(t.output_tokens for t, _ in deltas), sum(t.finished for t, _ in deltas)
    per_request = out / finished if finished > 0 else (total_out / total_finished if total_finished else 0.0)
    return Window(
        arrived, finished, sum(t.input_tokens - b.input_tokens for t, b in deltas), round(arrived * per_request),
        _p90_ms([(t.ttft, b.ttft) for t, b in deltas]), _p90_ms([(t.itl, b.itl) for t, b in deltas]),
    )  # fmt: skip


def _p90_ms(pairs: Sequence[tuple[Buckets, Buckets]]) -> float:
    """The p90 (ms) of the observations between each pair's snapshots, pooled."""
    bounds = next((now[0] for now, _ in pairs if now[0]), ())
    pooled = [0.0] * len(bounds)
    for now, before in pairs:
        if now[0] != bounds:
            continue
        since = align(before, now) if before[0] == bounds else (0.0,) * len(bounds)
        for i, (n, b) in enumerate(zip(now[1], since)):
            pooled[i] += n - b
    return window_quantile(bounds, (0.0,) * len(bounds), pooled, 0.9) * 1000.0
