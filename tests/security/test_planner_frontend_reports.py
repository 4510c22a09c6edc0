"""Frontend reports steer ``kvmesh planner``'s sizing (a forecast of arrivals), and
anyone who can write to discovery can write one: an unsigned or wrongly signed report,
one copied to another frontend's key, an oversized one, one with absurd numbers or an
older one replayed must not move the planner's observation. Only the honest frontend's
arrivals are seen."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.assembly.discovery_fleet import DiscoveryFleet
from kvmesh.config import RuntimeConfig
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.planner.reports import MAX_REPORT_BYTES, FrontendReport, FrontendReporter, check_report, report_key
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.discovery.memory import MemoryDiscovery
from kvmesh.runtime.distributed import DistributedRuntime, sign_struct

pytestmark = pytest.mark.timeout(30)

SECRET = ClusterSecret(b"kvmesh-tests: frontend report forgery")
NS = "ns"


def _report(frontend: int, admitted: int, seq: int = 1, **kw: object) -> FrontendReport:
    fields: dict[str, object] = dict(frontend_id=frontend, seq=seq, admitted=admitted, finished=0, input_tokens=admitted,
                                     output_tokens=0, ttft_bounds=(0.5,), ttft_counts=(0, 0), itl_bounds=(0.5,), itl_counts=(0, 0))  # fmt: skip
    fields.update(kw)
    return FrontendReport(**fields)  # type: ignore[arg-type]


def _signed(frontend: int, admitted: int, seq: int = 1, key_of: int | None = None, **kw: object) -> tuple[str, bytes]:
    key = report_key(NS, frontend if key_of is None else key_of)
    return key, msgspec.json.encode(sign_struct(SECRET, "frontend-report", key, _report(frontend, admitted, seq, **kw)))


@pytest.mark.parametrize(
    "forge, why",
    [
        (lambda: (report_key(NS, 0xBAD), msgspec.json.encode(_report(0xBAD, 10**9))), "not signed"),
        (lambda: (report_key(NS, 0xBAD), msgspec.json.encode(sign_struct(ClusterSecret(b"not the cluster's secret!"), "frontend-report",
                                                                         report_key(NS, 0xBAD), _report(0xBAD, 10**9)))), "not signed"),  # fmt: skip
        (lambda: _signed(0xBAD, 10**9, key_of=0xB0B), "another frontend"),
        (lambda: (report_key(NS, 0xBAD), b'{"frontend_id": 1' + b" " * MAX_REPORT_BYTES + b"}"), "bytes (at most"),
        (lambda: _signed(0xBAD, 5, finished=9), "counters out of range"),
        (lambda: _signed(0xBAD, 2**60), "counters out of range"),
        (lambda: _signed(0xBAD, 5, ttft_bounds=tuple(float(i + 1) for i in range(100)), ttft_counts=(0,) * 101), "at most 64"),
        (lambda: _signed(0xBAD, 5, ttft_counts=(5, 1)), "not cumulative"),
        (lambda: _signed(0xBAD, 5, ttft_bounds=(1.0, 0.5), ttft_counts=(0, 0, 0)), "increasing"),
        (lambda: (report_key(NS, 0xBAD), b'{"frontend_id": 2989, "seq": 1, "admitted": "lots"}'), "not a frontend report"),
    ],
)
def test_a_forged_or_absurd_report_is_refused_with_the_reason(forge, why) -> None:  # type: ignore[no-untyped-def]
    key, value = forge()
    got = check_report(SECRET, key, value)
    assert isinstance(got, str) and why in got


async def test_the_planner_sees_only_the_honest_frontends_arrivals() -> None:
    discovery = MemoryDiscovery()
    cfg = RuntimeConfig(discovery="memory", namespace=NS)
    frontend_rt, planner_rt = DistributedRuntime(cfg, discovery, secret=SECRET), DistributedRuntime(cfg, discovery, secret=SECRET)
    await frontend_rt.start()
    await planner_rt.start()
    try:
        metrics = FrontendMetrics()
        reporter = FrontendReporter(frontend_rt, metrics)
        fleet = DiscoveryFleet(planner_rt)
        await reporter.put_once()
        own = report_key(NS, frontend_rt.lease_id)
        old = (await discovery.get_prefix(own))[own]  # the honest report at 0 admitted, kept to replay
        await fleet.observe()
        metrics.inflight.labels("m").inc(3)  # three admitted
        await reporter.put_once()
        honest = (await discovery.get_prefix(own))[own]
        forged = [(report_key(NS, 0xB0B), honest), (report_key(NS, 0xBAD), msgspec.json.encode(_report(0xBAD, 10**6)))]
        for key, value in forged:  # an attacker: the honest report copied to another key, an unsigned one
            await discovery.put(key, value)
        obs = await fleet.observe()
        assert obs.arrived == 3, "only the honest frontend's report counts"
        await discovery.put(own, old)  # the honest report of a round ago, replayed
        obs = await fleet.observe()
        assert obs.arrived == 0, "an older report does not replace a newer: no restart read, no arrivals invented"
        metrics.inflight.labels("m").inc(2)
        await reporter.put_once()
        reporter._last = None  # noqa: SLF001 - put again even if unchanged
        assert (await fleet.observe()).arrived == 2
        await fleet.close()
    finally:
        await frontend_rt.shutdown()
        await planner_rt.shutdown()
