"""What the planner reads from the fleet's own metrics, as plain numbers.

:func:`window_quantile` is pure: a quantile of the observations made between two
snapshots of a cumulative histogram (Prometheus buckets), so the planner judges the
latency of the last round, not of the whole run. :func:`histogram_buckets` reads such
a snapshot from a histogram collector (``prometheus_client.Histogram`` or the
frontend's ``LoopHistogram``; every label set summed); :func:`counter_total` a
counter's total (the planner's forecast takes each round's requests and tokens from the
frontend's counters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client.registry import Collector

__all__ = ["window_quantile", "histogram_buckets", "counter_total", "align", "Buckets"]

Buckets = tuple[tuple[float, ...], tuple[float, ...]]  # (upper bounds, cumulative counts), +Inf last


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
    return sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total"))


def align(before: Buckets, now: Buckets) -> tuple[float, ...]:
    """``before``'s counts on ``now``'s bounds (a label set that appeared since: 0)."""
    counts = dict(zip(*before))
    return tuple(counts.get(b, 0.0) for b in now[0])
