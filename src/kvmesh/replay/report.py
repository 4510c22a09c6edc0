"""Summaries of a replay: one :class:`PolicyResult` per policy, a table, JSON.

Definitions (over the requests that completed, i.e. ended with ``stop`` or ``length``):

* TTFT: first token time − arrival; ITL: every gap between consecutive tokens of a
  request, pooled over requests; percentiles interpolate linearly between ranks;
* cache hit rate: Σ cached prompt tokens / Σ prompt tokens (the engine's usage);
* throughput: Σ output tokens / (last finish − first arrival), in tokens per second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvmesh.engines.mocker.sim import RequestRecord

__all__ = ["JSON_FIELDS", "PolicyResult", "format_table", "percentile", "summarize"]

JSON_FIELDS = (
    "policy",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "cache_hit_rate",
    "throughput_tok_s",
    "requests",
)


@dataclass(frozen=True)
class PolicyResult:
    """One policy's numbers. ``failed`` requests (``error``/``cancelled`` or unfinished)
    and the raw TTFT samples are kept for the table and the plot, not the JSON."""

    policy: str
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    cache_hit_rate: float
    throughput_tok_s: float
    requests: int
    failed: int = 0
    ttfts_ms: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, object]:
        """Exactly :data:`JSON_FIELDS`; a metric without samples is ``None``."""
        d = asdict(self)
        return {k: (None if isinstance(d[k], float) and math.isnan(d[k]) else d[k]) for k in JSON_FIELDS}


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending ``sorted_values``; NaN when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def summarize(policy: str, records: Sequence[RequestRecord]) -> PolicyResult:
    ok = [r for r in records if r.finish_reason in ("stop", "length")]
    ttfts = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
    itls = sorted(gap for r in ok for gap in r.itl_ms)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(len(r.token_ids) for r in ok)
    finishes = [r.finish_ms for r in ok if r.finish_ms is not None]
    span_ms = max(finishes) - min(r.arrival_ms for r in ok) if finishes else 0.0
    return PolicyResult(
        policy=policy,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p90_ms=percentile(ttfts, 90),
        ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(itls, 50),
        itl_p99_ms=percentile(itls, 99),
        cache_hit_rate=cached / prompt if prompt else math.nan,
        throughput_tok_s=output / (span_ms / 1000.0) if span_ms > 0 else math.nan,
        requests=len(ok),
        failed=len(records) - len(ok),
        ttfts_ms=ttfts,
    )


_COLUMNS = (
    ("policy", "{:<12}", "policy"),
    ("requests", "{:>8}", "requests"),
    ("ttft_p50_ms", "{:>10.1f}", "TTFT p50"),
    ("ttft_p90_ms", "{:>10.1f}", "TTFT p90"),
    ("ttft_p99_ms", "{:>10.1f}", "TTFT p99"),
    ("itl_p50_ms", "{:>9.1f}", "ITL p50"),
    ("itl_p99_ms", "{:>9.1f}", "ITL p99"),
    ("cache_hit_rate", "{:>9.1%}", "cache hit"),
    ("throughput_tok_s", "{:>10.1f}", "tok/s"),
)


def format_table(results: Sequence[PolicyResult], baseline: str = "round_robin") -> str:
    """A fixed-width table (times in ms), then TTFT p50 ratios against ``baseline``
    when it was replayed, and a note on failed requests."""
    head = "  ".join(f"{title:>{_width(fmt)}}" if i else f"{title:<12}" for i, (_, fmt, title) in enumerate(_COLUMNS))
    lines = [head]
    for r in results:
        cells = []
        for key, fmt, _title in _COLUMNS:
            value = getattr(r, key)
            cells.append(f"{'-':>{_width(fmt)}}" if isinstance(value, float) and math.isnan(value) else fmt.format(value))
        lines.append("  ".join(cells))
    base = next((r for r in results if r.policy == baseline), None)
    if base is not None:
        for r in results:
            if r is not base and r.ttft_p50_ms > 0 and not math.isnan(base.ttft_p50_ms):
                lines.append(f"TTFT p50 {baseline} / {r.policy}: {base.ttft_p50_ms / r.ttft_p50_ms:.2f}x")
    for r in results:
        if r.failed:
            lines.append(f"{r.policy}: {r.failed} request(s) did not complete (errors are left out of the numbers)")
    return "\n".join(lines)


def _width(fmt: str) -> int:
    return int("".join(ch for ch in fmt.split(":")[1].split(".")[0] if ch.isdigit()))
