"""Goodput under SLOs: one :class:`ArmResult` per deployment arm of a replay.

Definitions (the same as ``bench/disagg.py``, so the two can be compared):

* a request's TTFT is its first token − its arrival; its ITL is its *mean* gap,
  (last token − first token) ÷ (tokens − 1) (a one-token request meets any ITL SLO);
* a request *meets the SLOs* when it completed (``stop``/``length``), its TTFT is at
  most ``slo_ttft_ms`` and its mean ITL at most ``slo_itl_ms`` (`kvmesh replay --slo-tpot-ms`);
* goodput = requests meeting the SLOs ÷ the arrival window, in requests per second;
  the window is last − first arrival × N/(N−1) (one mean gap more: N requests cover
  N gaps), the same for every arm of one trace slice; when every request arrives at
  once, the arm's own first arrival → last completion;
* ``slo_met_fraction`` = requests meeting the SLOs ÷ requests sent;
* TTFT and ITL percentiles are over completed requests (ITL: the per-request means);
* ``worker_seconds``: the workers the arm held, integrated over its makespan (first
  arrival → last finish; a planner's workers from their start order to their release),
  and ``goodput_per_worker_hour`` = good requests ÷ worker-hours: the cost side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.engines.mocker.sim import RequestRecord
from kvmesh.replay.report import percentile

__all__ = ["ARM_JSON_FIELDS", "COST_JSON_FIELDS", "ArmResult", "Slo", "arrival_window_s", "format_arms", "mean_itl_ms", "meets", "summarize_arm"]

ARM_JSON_FIELDS = (
    "arm",
    "goodput_rps",
    "slo_met_fraction",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "requests",
    "completed",
    "good",
    "remote_prefills",
    "local_prefills",
    "local_by_queue",
    "queue_max",
    "kv_bytes",
)
COST_JSON_FIELDS = ("worker_seconds", "goodput_per_worker_hour", "starts", "stops", "moves")


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = 2000.0
    itl_ms: float = 35.0

    def __post_init__(self) -> None:
        for name, v in (("--slo-ttft-ms", self.ttft_ms), ("--slo-tpot-ms", self.itl_ms)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v}")


def mean_itl_ms(r: RequestRecord) -> float | None:
    t = r.token_times_ms
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None


def meets(r: RequestRecord, slo: Slo) -> bool:
    """Completed, TTFT and mean ITL within the SLOs."""
    if r.finish_reason not in ("stop", "length") or r.ttft_ms is None:
        return False
    itl = mean_itl_ms(r)
    return r.ttft_ms <= slo.ttft_ms and (itl is None or itl <= slo.itl_ms)


def arrival_window_s(arrivals_ms: Sequence[float]) -> float | None:
    """Seconds N requests arrive over (see the module docstring); None if at once."""
    n = len(arrivals_ms)
    span = max(arrivals_ms) - min(arrivals_ms) if n else 0.0
    return span * n / (n - 1) / 1000.0 if n > 1 and span > 0 else None


@dataclass
class ArmResult:
    """One arm's figures; ``counters`` are the disaggregation counters (0 for an
    aggregated arm), ``decisions`` the planner's log lines, the samples are for plots."""

    arm: str
    goodput_rps: float
    slo_met_fraction: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    requests: int
    completed: int
    good: int
    counters: dict[str, int] = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)
    resources: dict[str, float] = field(default_factory=dict)
    worker_seconds: float = 0.0
    ttfts_ms: list[float] = field(default_factory=list, repr=False)
    itls_ms: list[float] = field(default_factory=list, repr=False)
    # a planner arm's ticks: (t_s, prefill, decode, aggregated workers serving, observed rps, forecast rps)
    timeline: list[tuple[float, int, int, int, float, float]] = field(default_factory=list, repr=False)

    @property
    def goodput_per_worker_hour(self) -> float:
        return self.good / (self.worker_seconds / 3600.0) if self.worker_seconds > 0 else math.nan

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {
            "arm": self.arm,
            "goodput_rps": self.goodput_rps,
            "slo_met_fraction": self.slo_met_fraction,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "itl_p50_ms": self.itl_p50_ms,
            "itl_p99_ms": self.itl_p99_ms,
            "requests": self.requests,
            "completed": self.completed,
            "good": self.good,
        }
        for key in ARM_JSON_FIELDS[10:]:
            d[key] = self.counters.get(key, 0)
        d["worker_seconds"] = self.worker_seconds
        d["goodput_per_worker_hour"] = self.goodput_per_worker_hour
        for key in COST_JSON_FIELDS[2:]:
            d[key] = self.counters.get(key, 0)
        d["planner_decisions"] = list(self.decisions)
        d["planner_timeline"] = [list(row) for row in self.timeline]
        d["resources"] = dict(self.resources)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def summarize_arm(
    arm: str,
    records: Sequence[RequestRecord],
    slo: Slo,
    window_s: float | None,
    counters: dict[str, int] | None = None,
    decisions: Sequence[str] = (),
    resources: dict[str, float] | None = None,
    worker_seconds: float = 0.0,
    timeline: Sequence[tuple[float, int, int, int, float, float]] = (),
) -> ArmResult:
    done = [r for r in records if r.finish_reason in ("stop", "length")]
    ttfts = sorted(r.ttft_ms for r in done if r.ttft_ms is not None)
    itls = sorted(x for x in (mean_itl_ms(r) for r in done) if x is not None)
    good = sum(meets(r, slo) for r in records)
    span = window_s if window_s is not None else _makespan_s(done)
    return ArmResult(
        arm=arm,
        goodput_rps=good / span if span and span > 0 else 0.0,
        slo_met_fraction=good / len(records) if records else math.nan,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(itls, 50),
        itl_p99_ms=percentile(itls, 99),
        requests=len(records),
        completed=len(done),
        good=good,
        counters=dict(counters or {}),
        decisions=list(decisions),
        resources=dict(resources or {}),
        worker_seconds=worker_seconds,
        ttfts_ms=ttfts,
        itls_ms=itls,
        timeline=list(timeline),
    )


def _makespan_s(done: Sequence[RequestRecord]) -> float:
    ends = [r.finish_ms for r in done if r.finish_ms is not None]
    return (max(ends) - min(r.arrival_ms for r in done)) / 1000.0 if ends else math.nan


def format_arms(results: Sequence[ArmResult], slo: Slo) -> str:
    """A table, one row per arm, then each arm's goodput against the best aggregated one."""
    head = f"{'arm':<16}{'goodput':>10}{'SLO met':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
    head += f"{'remote/local(full)':>20}{'worker-s':>10}{'good/wkr-h':>11}"
    lines = [f"SLOs: TTFT <= {slo.ttft_ms:g} ms, mean ITL <= {slo.itl_ms:g} ms; goodput in requests/s", head]
    for r in results:
        c = r.counters
        split = f"{c.get('remote_prefills', 0)}/{c.get('local_prefills', 0)}({c.get('local_by_queue', 0)})"
        lines.append(
            f"{r.arm:<16}{r.goodput_rps:>10.3f}{r.slo_met_fraction:>9.1%}{_ms(r.ttft_p50_ms):>10}{_ms(r.ttft_p99_ms):>10}"
            f"{_ms(r.itl_p50_ms, 1):>9}{_ms(r.itl_p99_ms, 1):>9}{split:>20}{r.worker_seconds:>10,.0f}"
            f"{_ms(r.goodput_per_worker_hour):>11}"
        )
    lines.append("where the time went (per worker, fraction of the makespan; KV: pool use of serving workers)")
    lines.append(f"{'arm':<16}{'serve busy':>11}{'of it prefill':>14}{'prefill wkr':>12}{'KV link':>9}{'KV max':>8}{'KV mean':>8}{'batch max':>10}")
    for r in results:
        x = r.resources
        if x:
            lines.append(
                f"{r.arm:<16}{x['serve_busy']:>11.0%}{x['serve_prefill']:>14.0%}{x['prefill_busy']:>12.0%}"
                f"{x['link_busy']:>9.0%}{x['kv_max']:>8.0%}{x['kv_mean']:>8.0%}{x['running_max']:>10.0f}"
            )
    base = [r for r in results if r.arm.startswith("aggregated")]
    if base:
        best = max(base, key=lambda r: r.goodput_rps)
        for r in results:
            if r is not best and best.goodput_rps > 0:
                lines.append(f"goodput {r.arm} / {best.arm}: {r.goodput_rps / best.goodput_rps:.2f}x")
    return "\n".join(lines)


def _ms(v: float, digits: int = 0) -> str:
    return "-" if math.isnan(v) else f"{v:,.{digits}f}"
