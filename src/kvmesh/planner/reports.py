"""What the frontends tell ``kvmesh planner``: their counters, signed, in discovery.

Key (bound to the frontend's lease: it goes with the frontend)::

    /planner/{namespace}/frontends/{frontend:x}   a FrontendReport, JSON, signed

Every ``REPORT_INTERVAL_S`` a ``kvmesh frontend`` puts its totals (:class:`FrontendReport`:
requests admitted = finished + in flight, finished, prompt and generated tokens, the
TTFT and ITL histograms' cumulative buckets) at its key, when they changed since its
last put: an idle frontend writes nothing, a busy one one small record a second, and no
request pays for it (the counters are the ones ``/metrics`` exports). The planner reads
the prefix each round (:func:`read_reports`) and turns two rounds' totals into the
round's arrivals and latencies (:func:`kvmesh.planner.signals.window`).

Anyone may write to discovery: a report counts only when it is at most
``MAX_REPORT_BYTES`` (checked before it is decoded), decodes as a report, names the
frontend its key names, is signed with the cluster secret (HMAC over the key and the
report, label ``frontend-report``) and holds sane numbers (:func:`check_report`); at
most ``MAX_FRONTENDS`` reports are read a round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec

from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.planner.orders import planner_prefix
from kvmesh.planner.signals import Buckets, Totals, counter_total, gauge_total, histogram_buckets
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.distributed import DistributedRuntime, sign_struct, struct_is_signed

__all__ = [
    "FrontendReport", "FrontendReporter", "MAX_REPORT_BYTES", "MAX_FRONTENDS", "REPORT_INTERVAL_S", "check_report",
    "read_reports", "report_key", "reports_prefix", "totals_of",
]  # fmt: skip

log = logging.getLogger("kvmesh.planner")

REPORT_INTERVAL_S = 1.0
MAX_REPORT_BYTES = 8192  # two histograms of at most 64 buckets and a few counters
MAX_FRONTENDS = 64  # reports read a round (sorted by key)
_MAX_BUCKETS = 64
_MAX_COUNT = 1 << 53  # integers a float holds exactly
_LABEL = "frontend-report"


class FrontendReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One frontend's totals since it started (see :class:`~kvmesh.planner.signals.Totals`);
    a histogram is its finite upper bounds (seconds) and cumulative counts, one more
    count than bounds (+Inf last)."""

    frontend_id: int
    seq: int  # newer reports have larger numbers (the frontend's wall clock in ns)
    admitted: int
    finished: int
    input_tokens: int
    output_tokens: int
    ttft_bounds: tuple[float, ...]
    ttft_counts: tuple[int, ...]
    itl_bounds: tuple[float, ...]
    itl_counts: tuple[int, ...]
    mac: str = ""


def reports_prefix(namespace: str) -> str:
    return f"{planner_prefix(namespace)}frontends/"


def report_key(namespace: str, frontend_id: int) -> str:
    return f"{reports_prefix(namespace)}{frontend_id:x}"


def totals_of(report: FrontendReport) -> Totals:
    def buckets(bounds: tuple[float, ...], counts: tuple[int, ...]) -> Buckets:
        return (*bounds, math.inf), tuple(float(c) for c in counts)

    return Totals(report.admitted, report.finished, report.input_tokens, report.output_tokens,
                  buckets(report.ttft_bounds, report.ttft_counts), buckets(report.itl_bounds, report.itl_counts))  # fmt: skip


def check_report(secret: ClusterSecret | None, key: str, value: bytes) -> FrontendReport | str:
    """The report at ``key``, or why it does not count (see the module docstring)."""
    if len(value) > MAX_REPORT_BYTES:
        return f"{len(value)} bytes (at most {MAX_REPORT_BYTES})"
    try:
        report = msgspec.json.decode(value, type=FrontendReport)
    except msgspec.DecodeError as exc:  # ValidationError included
        return f"not a frontend report: {exc}"
    if key.rsplit("/", 1)[-1] != f"{report.frontend_id:x}":
        return "the report names another frontend than its key"
    if not struct_is_signed(secret, _LABEL, key, report):
        return "not signed with the cluster secret"
    counters = (report.admitted, report.finished, report.input_tokens, report.output_tokens)
    if not all(0 <= c < _MAX_COUNT for c in counters) or report.finished > report.admitted:
        return "counters out of range (0 <= finished <= admitted < 2**53)"
    for bounds, counts in ((report.ttft_bounds, report.ttft_counts), (report.itl_bounds, report.itl_counts)):
        why = _histogram_problem(bounds, counts)
        if why:
            return why
    return report


def _histogram_problem(bounds: tuple[float, ...], counts: tuple[int, ...]) -> str:
    if len(bounds) > _MAX_BUCKETS or len(counts) != len(bounds) + 1:
        return f"a histogram has {len(bounds)} bounds (at most {_MAX_BUCKETS}) and {len(counts)} counts (one more)"
    if not all(math.isfinite(b) and b > 0 for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
        return "a histogram's bounds are not positive, finite and increasing"
    if any(c < 0 for c in counts) or any(a > b for a, b in zip(counts, counts[1:])) or (counts and counts[-1] >= _MAX_COUNT):
        return "a histogram's counts are not cumulative"
    return ""


async def read_reports(runtime: DistributedRuntime) -> dict[int, FrontendReport]:
    """The frontends' reports now, by frontend (reports that do not count are logged once
    per key and left out)."""
    found: dict[int, FrontendReport] = {}
    values = await runtime.discovery.get_prefix(reports_prefix(runtime.config.namespace))
    for key in sorted(values)[:MAX_FRONTENDS]:
        got = check_report(runtime.secret, key, values[key])
        if isinstance(got, str):
            _refused(key, got)
        else:
            found[got.frontend_id] = got
    return found


_said: dict[str, str] = {}


def _refused(key: str, why: str) -> None:
    if _said.get(key) != why and len(_said) < 1024:
        _said[key] = why
        log.warning("ignoring the frontend report at %s: %s", key, why)


class FrontendReporter:
    """A frontend's side: put its report every ``interval_s`` while its counts change
    (started by :meth:`start`, ended by :meth:`close`)."""

    def __init__(self, runtime: DistributedRuntime, metrics: FrontendMetrics, interval_s: float = REPORT_INTERVAL_S) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.interval_s = interval_s
        self.key = report_key(runtime.config.namespace, runtime.lease_id)
        self.puts = 0
        self._last: tuple[object, ...] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> FrontendReporter:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="frontend-report")
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def report(self) -> FrontendReport:
        """The frontend's totals now, unsigned."""
        m = self.metrics
        finished = round(counter_total(m.requests))
        ttft, itl = _finite(histogram_buckets(m.ttft)), _finite(histogram_buckets(m.itl))
        return FrontendReport(
            self.runtime.lease_id, time.time_ns(), finished + max(0, round(gauge_total(m.inflight))), finished,
            round(counter_total(m.input_tokens)), round(counter_total(m.output_tokens)), *ttft, *itl,
        )  # fmt: skip

    async def put_once(self) -> bool:
        """Put the report if the counts changed since the last put; True if it did."""
        report = self.report()
        counts = msgspec.structs.astuple(report)[2:]
        if counts == self._last:
            return False
        rt = self.runtime
        await rt.put_leased(self.key, msgspec.json.encode(sign_struct(rt.secret, _LABEL, self.key, report)))
        self._last = counts
        self.puts += 1
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self.put_once()
            except Exception:  # noqa: BLE001 - discovery out of reach: the next put tries again
                log.warning("frontend report not put at %s", self.key, exc_info=True)
            await asyncio.sleep(self.interval_s)


def _finite(snapshot: Buckets) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A histogram snapshot (+Inf last, or none observed yet) as a report carries it."""
    bounds, counts = snapshot
    if not bounds:
        return (), (0,)
    return bounds[:-1], tuple(round(c) for c in counts)
