"""The frontends' reports to ``kvmesh planner``: a round's arrivals are requests
admitted (not finished), TTFT/ITL p90 pooled over the frontends, a restarted frontend
counted from zero; a frontend's reporter puts its totals (signed) in discovery and the
distributed planner's fleet turns two rounds of them into its observation."""

from __future__ import annotations

import math

import msgspec
import pytest

from kvmesh.assembly.discovery_fleet import DiscoveryFleet
from kvmesh.config import RuntimeConfig
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.planner.reports import FrontendReporter, check_report, read_reports, report_key
from kvmesh.planner.signals import Totals, window
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.discovery.memory import MemoryDiscovery
from kvmesh.runtime.distributed import DistributedRuntime

BOUNDS = (0.1, 0.5, 1.0, math.inf)
SECRET = ClusterSecret(b"kvmesh-tests: frontend reports")


def _totals(admitted: int, finished: int, tokens_in: int, tokens_out: int, ttft: tuple[float, ...] = (0, 0, 0, 0)) -> Totals:
    return Totals(admitted, finished, tokens_in, tokens_out, (BOUNDS, ttft), (BOUNDS, (0.0,) * 4))


def test_arrivals_are_admitted_requests_not_finished_ones() -> None:
    before = {1: _totals(10, 10, 1000, 500)}
    now = {1: _totals(25, 12, 2500, 600)}  # 15 came in, 2 requests ended (100 tokens)
    w = window(before, now)
    assert w.arrived == 15 and w.finished == 2 and w.input_tokens == 1500
    assert w.output_tokens == 15 * 50  # the arrivals × the finished requests' mean output (100 tokens / 2)


def test_frontends_are_summed_a_restarted_one_counts_from_zero_and_latencies_pool() -> None:
    before = {1: _totals(10, 10, 100, 100, (5, 5, 5, 5)), 2: _totals(50, 50, 500, 500, (0, 50, 50, 50))}
    now = {
        1: _totals(20, 20, 200, 200, (5, 5, 14, 15)),  # 10 more: 9 in (0.5, 1], 1 over 1 s
        2: _totals(3, 3, 30, 30, (3, 3, 3, 3)),  # restarted: its 3 since the restart count
        3: _totals(2, 2, 20, 20, (2, 2, 2, 2)),  # new since the last round
    }  # fmt: skip
    w = window(before, now)
    assert w.arrived == 10 + 3 + 2 and w.input_tokens == 100 + 30 + 20
    # 15 observations: 5 under 0.1 s, 9 in (0.5, 1], 1 above: p90 (13.5th) within (0.5, 1]
    assert 500.0 < w.ttft_p90_ms <= 1000.0
    assert window({}, {}).arrived == 0 and window(now, now).ttft_p90_ms == 0.0


def test_a_histogram_with_other_bounds_is_left_out_of_the_quantile() -> None:
    other = Totals(5, 5, 50, 50, ((0.2, math.inf), (0.0, 5.0)), ((math.inf,), (0.0,)))
    w = window({}, {1: _totals(5, 5, 50, 50, (5, 5, 5, 5)), 2: other})
    assert w.arrived == 10 and 0 < w.ttft_p90_ms <= 100.0  # frontend 2's slow answers are in other buckets


async def _runtime(discovery: MemoryDiscovery, secret: ClusterSecret | None = SECRET) -> DistributedRuntime:
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory", namespace="ns"), discovery, secret=secret)
    await runtime.start()
    return runtime


@pytest.mark.timeout(30)
async def test_the_distributed_planner_observes_the_frontends_arrivals_and_latencies() -> None:
    discovery = MemoryDiscovery()
    frontend_rt, planner_rt = await _runtime(discovery), await _runtime(discovery)
    try:
        metrics = FrontendMetrics()
        reporter = FrontendReporter(frontend_rt, metrics)
        fleet = DiscoveryFleet(planner_rt)
        assert await reporter.put_once()
        first = await fleet.observe()  # the baseline round
        assert first.arrived == 0 and first.interval_s == 0
        inflight, ttft = metrics.inflight.labels("m"), metrics.ttft.labels("m")
        for _ in range(4):  # four admitted, none finished yet: arrivals all the same
            inflight.inc()
            metrics.input_tokens.labels("m").inc(100)
            ttft.observe(0.3)
        metrics.itl.labels("m").observe(0.02)
        assert await reporter.put_once() and not await reporter.put_once()  # unchanged: not put again
        obs = await fleet.observe()
        assert obs.interval_s > 0 and obs.arrived == 4 and obs.arrived_input_tokens == 400
        assert 250.0 < obs.ttft_p90_ms <= 500.0 and 10.0 < obs.itl_p90_ms <= 25.0
        await fleet.close()
    finally:
        await frontend_rt.shutdown()
        await planner_rt.shutdown()


@pytest.mark.timeout(30)
async def test_reports_round_trip_signed_and_a_wrong_secret_reads_none() -> None:
    discovery = MemoryDiscovery()
    frontend_rt = await _runtime(discovery)
    stranger = await _runtime(discovery, ClusterSecret(b"another cluster, other key"))
    try:
        reporter = FrontendReporter(frontend_rt, FrontendMetrics())
        reporter.metrics.inflight.labels("m").inc()
        await reporter.put_once()
        key = report_key("ns", frontend_rt.lease_id)
        value = (await discovery.get_prefix(key))[key]
        got = check_report(SECRET, key, value)
        assert not isinstance(got, str) and got.admitted == 1
        assert list(await read_reports(frontend_rt)) == [frontend_rt.lease_id]
        assert await read_reports(stranger) == {}
        assert msgspec.json.decode(value)["mac"]
    finally:
        await frontend_rt.shutdown()
        await stranger.shutdown()


def test_the_embedded_fleet_counts_arrivals_when_admitted() -> None:
    """``kvmesh run --planner``: a request counts in the round it was admitted (in flight),
    not a lifetime later when it finishes."""
    from types import SimpleNamespace

    from kvmesh.assembly.embedded_fleet import EmbeddedFleet
    from kvmesh.planner.core import Role

    fleet = EmbeddedFleet(None, {0: Role.AGGREGATED}, None)  # type: ignore[arg-type]  # records/launch unused here
    metrics = FrontendMetrics()
    fleet.frontend = SimpleNamespace(metrics=metrics)  # type: ignore[assignment]
    assert fleet._arrivals(1.0) == (0.0, 0, 0, 0)  # noqa: SLF001 - the baseline
    metrics.inflight.labels("m").inc(5)  # five admitted, none finished
    metrics.input_tokens.labels("m").inc(500)
    assert fleet._arrivals(3.0) == (2.0, 5, 500, 0)  # noqa: SLF001
    metrics.inflight.labels("m").dec(5)  # they finish: no new arrivals
    metrics.requests.labels("m", "completions", "200").inc(5)
    assert fleet._arrivals(5.0)[1] == 0  # noqa: SLF001


def test_kvmesh_planner_sizes_from_its_capacity_profile_at_the_profiles_slos(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvmesh.assembly.planner import distributed_config
    from kvmesh.config import PlannerConfig as PlannerSettings
    from kvmesh.planner.profile import CapacityPoint, CapacityProfile, dump_profile

    path = tmp_path / "profile.json"
    dump_profile(CapacityProfile(1500.0, 40.0, 0.99, (CapacityPoint(100, 10, 5.0, 5.0, 5.0),)), path)
    config = distributed_config(PlannerSettings(capacity_profile=str(path), planner_headroom=0.7))
    assert config.profile is not None and (config.slo_ttft_ms, config.slo_itl_ms, config.headroom) == (1500.0, 40.0, 0.7)
    assert distributed_config(PlannerSettings()).profile is None
