"""Telling load from failure: a canary judged against the worker's load and its
peers at the same moment, and the fleet's latency-ejection budget (pure parts)."""

from __future__ import annotations

import pytest

from kvmesh.health.state import (
    CheckKind,
    CheckResult,
    FleetLatency,
    HealthConfig,
    HealthStatus,
    HealthTracker,
    LoadSample,
    latency_ejection_allowed,
)

H, S, U = HealthStatus.HEALTHY, HealthStatus.SUSPICIOUS, HealthStatus.UNHEALTHY
CFG = HealthConfig(check_interval_s=1.0)
IDLE = LoadSample()


def ok(compute: float) -> CheckResult:
    return CheckResult(CheckKind.OK, compute + 0.001, compute_s=compute, wait_s=0.001)


def step_time(load: LoadSample) -> float:
    """A made-up engine whose step time follows the load differently from the
    health model (steeper at small batches): peers cancel the model's error."""
    return 0.005 * (1.0 + 4.0 * min(1.0, load.batch_tokens / 50.0) + load.batch_tokens / 300.0 + 6.0 * load.kv_usage)


class Fleet:
    """Rounds of canaries over N workers, as the monitor runs them."""

    def __init__(self, n: int, config: HealthConfig = CFG) -> None:
        self.config = config
        self.trackers = {w: HealthTracker(w, config) for w in range(n)}
        self.fleet = FleetLatency(config)
        self.now = 0.0

    def round(self, loads: dict[int, LoadSample], slow: dict[int, float] | None = None, fleet_factor: float = 1.0) -> None:
        self.now += self.config.check_interval_s
        slow = slow or {}
        samples = {w: ok(8 * step_time(loads[w]) * slow.get(w, 1.0) * fleet_factor) for w in self.trackers}
        for w, result in samples.items():
            self.fleet.record(w, result.judged_s, loads[w], self.now)
        for w, result in samples.items():
            tracker = self.trackers[w]
            allowed = latency_ejection_allowed(self.trackers.values(), w, self.config)
            context = self.fleet.context(w, loads[w], tracker.baseline_s, self.now, may_eject=allowed)
            tracker.record_check(result, self.now, context)

    def statuses(self) -> list[HealthStatus]:
        return [t.status for t in self.trackers.values()]


def test_load_multiplier_and_heavier() -> None:
    assert IDLE.multiplier(CFG) == 1.0
    busy = LoadSample(running=40, waiting=3, kv_usage=0.5, batch_tokens=512)
    assert busy.multiplier(CFG) == pytest.approx(1 + 2 + 2.5)
    assert LoadSample.heavier(IDLE, busy) == busy and LoadSample.heavier(None, busy) == busy
    assert LoadSample.heavier(LoadSample(1, 9, 0.1, 5), LoadSample(2, 0, 0.0, 7)) == LoadSample(2, 9, 0.1, 7)


def test_ejection_budget_is_a_third_rounded_down() -> None:
    assert [CFG.latency_ejection_budget(n) for n in (1, 2, 3, 4, 5, 6, 9)] == [0, 0, 1, 1, 1, 2, 3]
    with pytest.raises(ValueError):
        HealthConfig(max_latency_ejection_share=1.5)


def test_peer_reference_is_the_median_of_fresh_peers() -> None:
    fl = FleetLatency(CFG)
    fl.record(1, 0.010, None, 0.0)
    fl.record(2, 0.030, None, 0.0)
    fl.record(3, 0.020, LoadSample(batch_tokens=256), 0.0)  # normalised: 0.010
    assert fl.peer_reference(1, 0.5) == pytest.approx(0.020)  # median of 0.030 and 0.010
    assert fl.peer_reference(9, 0.5) == pytest.approx(0.010)
    assert fl.peer_reference(1, 10.0) is None  # stale: not the same moment
    fl.forget(2)
    assert fl.peer_reference(1, 0.5) == pytest.approx(0.010)


def test_a_loaded_worker_is_not_a_spike_against_its_idle_baseline() -> None:
    tr = HealthTracker(1, CFG)
    fl = FleetLatency(CFG)
    for i in range(5):
        tr.record_check(ok(0.040), float(i), fl.context(1, IDLE, tr.baseline_s, float(i), may_eject=True))
    busy = LoadSample(running=200, waiting=50, kv_usage=0.9, batch_tokens=8192)
    slow_but_loaded = ok(0.040 * 30)  # 30x the idle latency
    assert tr.classify_latency(slow_but_loaded).kind is CheckKind.LATENCY_SPIKE  # the old, idle-only rule
    context = fl.context(1, busy, tr.baseline_s, 6.0, may_eject=True)
    assert tr.record_check(slow_but_loaded, 6.0, context) is None and tr.status is H


def test_saturated_fleet_with_uneven_load_flags_no_one() -> None:
    fleet = Fleet(4)
    for _ in range(3):
        fleet.round({w: IDLE for w in range(4)})
    loads = [LoadSample(0, 0, 0.0, 2), LoadSample(30, 10, 0.4, 400), LoadSample(250, 80, 0.95, 8192), LoadSample(5, 0, 0.1, 40)]
    for r in range(20):
        fleet.round({w: loads[(w + r) % 4] for w in range(4)})
    assert fleet.statuses() == [H] * 4


def test_fleet_wide_slowness_evicts_no_one_and_shows_as_lost_capacity() -> None:
    fleet = Fleet(3)
    for _ in range(3):
        fleet.round({w: IDLE for w in range(3)})
    speeds = [fleet.fleet.speed(w, fleet.trackers[w].baseline_s, fleet.now) for w in range(3)]
    assert speeds == [pytest.approx(1.0)] * 3
    for _ in range(10):
        fleet.round({w: IDLE for w in range(3)}, fleet_factor=10.0)  # e.g. every GPU throttled
    assert fleet.statuses() == [H] * 3
    # graceful degradation sees a tenth of the capacity (the baseline creeps up slowly)
    speeds = [fleet.fleet.speed(w, fleet.trackers[w].baseline_s, fleet.now) for w in range(3)]
    assert all(0.1 <= s < 0.7 for s in speeds), speeds
    assert fleet.fleet.speed(0, fleet.trackers[0].baseline_s, fleet.now + 100.0) == 1.0  # stale: unknown


@pytest.mark.parametrize("n", [3, 4])
def test_a_truly_slow_worker_is_caught_relative_to_its_peers(n: int) -> None:
    fleet = Fleet(n)
    busy = LoadSample(20, 0, 0.3, 300)
    for _ in range(3):
        fleet.round({w: busy for w in range(n)})
    for _ in range(4):  # one round to confirm, three failures
        fleet.round({w: busy for w in range(n)}, slow={0: 5.0})
    assert fleet.statuses() == [U] + [H] * (n - 1)
    assert fleet.trackers[0].weight == 0.0 and fleet.trackers[0].out_for_latency


def test_one_slow_round_is_not_a_failure() -> None:
    # a burst of CPU work on one worker for one round: unconfirmed, so nothing happens
    fleet = Fleet(3)
    for _ in range(3):
        fleet.round({w: IDLE for w in range(3)})
    for _ in range(5):
        fleet.round({w: IDLE for w in range(3)}, slow={1: 10.0})
        fleet.round({w: IDLE for w in range(3)})
    assert fleet.statuses() == [H] * 3
    assert fleet.trackers[1].machine.consecutive_failures == 0


def test_a_worker_slow_from_the_start_is_caught_too() -> None:
    fleet = Fleet(3)
    for _ in range(4):
        fleet.round({w: IDLE for w in range(3)}, slow={2: 5.0})
    assert fleet.statuses() == [H, H, U]


def test_two_worker_fleet_latency_only_marks_suspicious() -> None:
    fleet = Fleet(2)
    for _ in range(2):
        fleet.round({0: IDLE, 1: IDLE})
    for _ in range(10):
        fleet.round({0: IDLE, 1: IDLE}, slow={1: 6.0})
    t = fleet.trackers[1]
    assert fleet.statuses() == [H, S] and t.weight == 0.5 and not t.out_for_latency
    # hangs and corruption are not limited by the budget
    t.record_check(CheckResult(CheckKind.TIMEOUT, 1.0), fleet.now + 0.1)
    assert t.status is U and t.weight == 0.0


def test_latency_removes_at_most_a_third_of_the_fleet() -> None:
    fleet = Fleet(6)
    for _ in range(2):
        fleet.round({w: IDLE for w in range(6)})
    slow = {0: 8.0, 1: 8.0, 2: 8.0}
    for _ in range(4):
        fleet.round({w: IDLE for w in range(6)}, slow=slow)
    assert fleet.statuses() == [U, U, S, H, H, H]
    # a removed worker that recovers frees its share of the budget
    fleet.round({w: IDLE for w in range(6)})
    assert fleet.statuses() == [H] * 6 and not any(t.out_for_latency for t in fleet.trackers.values())
    # given up on (DRAINING after failed recovery trials) still counts as removed
    for _ in range(10):
        fleet.round({w: IDLE for w in range(6)}, slow=slow)
    statuses = fleet.statuses()
    assert statuses[:3].count(HealthStatus.DRAINING) == 2 and statuses[:3].count(S) == 1 and statuses[3:] == [H] * 3
