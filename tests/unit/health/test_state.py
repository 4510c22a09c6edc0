"""Health state machine transitions and weights; HealthTracker with breaker and EMA baseline."""

from __future__ import annotations

import pytest

from kvmesh.errors import Cancelled, CannotConnect, EngineShutdown, InvalidArgument
from kvmesh.health.breaker import BreakerConfig, BreakerState
from kvmesh.health.state import (
    CORRUPTION_KINDS,
    CheckKind,
    CheckResult,
    EmaBaseline,
    HealthConfig,
    HealthStateMachine,
    HealthStatus,
    HealthTracker,
)

OK = CheckResult(CheckKind.OK, 0.02)
BAD = CheckResult(CheckKind.ERROR, 0.02, "engine error")
CORRUPT = CheckResult(CheckKind.WRONG_TOKENS, 0.02)
H, S, U, D, X = (
    HealthStatus.HEALTHY,
    HealthStatus.SUSPICIOUS,
    HealthStatus.UNHEALTHY,
    HealthStatus.DRAINING,
    HealthStatus.DEAD,
)


def machine_at(status: HealthStatus) -> HealthStateMachine:
    m = HealthStateMachine(worker_id=7)
    if status is X:
        m.on_process_death(0.0)
        return m
    fails = {H: 0, S: 1, U: 3, D: 6}[status]
    for _ in range(fails):
        m.on_check(BAD, 0.0)
    assert m.status is status
    return m


def test_defaults_follow_the_design() -> None:
    cfg = HealthConfig()
    assert (cfg.suspicious_after_failures, cfg.unhealthy_after_failures, cfg.recover_after_successes) == (1, 3, 1)
    assert (cfg.latency_spike_factor, cfg.baseline_alpha, cfg.check_interval_s, cfg.canary_max_retries) == (
        3.0,
        0.1,
        30.0,
        2,
    )
    assert cfg.breaker == BreakerConfig()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"suspicious_after_failures": 0},
        {"unhealthy_after_failures": 0},
        {"latency_spike_factor": 1.0},
        {"baseline_alpha": 0.0},
        {"suspicious_weight": 0.0},
        {"check_interval_s": 0.0},
        {"canary_max_retries": -1},
    ],
)
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HealthConfig(**kwargs)  # type: ignore[arg-type]


def test_weights_and_gauge_values() -> None:
    cfg = HealthConfig()
    assert [cfg.weight(s) for s in HealthStatus] == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert [s.value for s in HealthStatus] == [0, 1, 2, 3, 4]


def test_failures_walk_healthy_suspicious_unhealthy_draining() -> None:
    m = HealthStateMachine(worker_id=7)
    t1 = m.on_check(BAD, 1.0)
    assert t1 is not None and (t1.worker_id, t1.src, t1.dst, t1.at) == (7, H, S, 1.0)
    assert "error" in t1.reason and m.weight == 0.5
    assert m.on_check(BAD, 2.0) is None
    t3 = m.on_check(CheckResult(CheckKind.TIMEOUT), 3.0)
    assert t3 is not None and (t3.src, t3.dst) == (S, U) and m.weight == 0.0
    # UNHEALTHY: each further failed check is a failed recovery attempt; 3 → DRAINING
    assert m.on_check(BAD, 4.0) is None and m.on_check(BAD, 5.0) is None
    t6 = m.on_check(BAD, 6.0)
    assert t6 is not None and (t6.src, t6.dst) == (U, D)


@pytest.mark.parametrize("kind", sorted(CORRUPTION_KINDS))
@pytest.mark.parametrize("status", [H, S])
def test_a_wrong_answer_takes_the_worker_out_at_once(kind: CheckKind, status: HealthStatus) -> None:
    """Corruption is never load: one canary with wrong tokens or logits out of range
    ejects (issue 34: a subtly corrupt worker that fails one check in two stayed in
    routing for 20 simulated minutes at p99 when it needed three in a row)."""
    m = machine_at(status)
    t = m.on_check(CheckResult(kind, 0.02), 1.0)
    assert t is not None and (t.src, t.dst) == (status, U) and m.weight == 0.0
    assert kind.value in t.reason
    # out of routing until a recovery trial passes, as for any ejection
    assert m.on_check(OK, 2.0) is not None and m.status is H


@pytest.mark.parametrize("status", [S, U])
def test_a_pass_brings_suspicious_or_unhealthy_back(status: HealthStatus) -> None:
    m = machine_at(status)
    t = m.on_check(OK, 9.0)
    assert t is not None and (t.src, t.dst) == (status, H)
    assert m.weight == 1.0 and m.consecutive_failures == 0


def test_recover_after_several_successes() -> None:
    m = HealthStateMachine(HealthConfig(recover_after_successes=2))
    m.on_check(BAD, 0.0)
    assert m.on_check(OK, 1.0) is None and m.status is S
    assert m.on_check(OK, 2.0) is not None and m.status is H


def test_failures_must_be_consecutive() -> None:
    m = machine_at(S)
    m.on_check(BAD, 0.0)
    m.on_check(OK, 0.0)  # back to healthy, count reset
    m.on_check(BAD, 0.0)
    m.on_check(BAD, 0.0)
    assert m.status is S


def test_draining_ignores_checks_until_recovered() -> None:
    m = machine_at(D)
    assert m.on_check(OK, 0.0) is None and m.status is D
    t = m.on_recovered(1.0)
    assert t is not None and (t.src, t.dst) == (D, H)


@pytest.mark.parametrize("status", [H, S, U, D])
def test_process_death_from_anywhere_is_terminal(status: HealthStatus) -> None:
    m = machine_at(status)
    t = m.on_process_death(5.0)
    assert t is not None and (t.src, t.dst) == (status, X)
    assert m.on_check(OK, 6.0) is None and m.on_recovered(6.0) is None and m.begin_drain(6.0) is None
    assert m.status is X and m.weight == 0.0


def test_stream_failures_count_and_a_fatal_one_skips_to_unhealthy() -> None:
    m = HealthStateMachine()
    assert m.on_stream_failure(0.0) is not None and m.status is S
    t = m.on_stream_failure(1.0, fatal=True)
    assert t is not None and (t.src, t.dst) == (S, U)
    # stragglers failing while UNHEALTHY are not failed recoveries
    for _ in range(5):
        assert m.on_stream_failure(2.0) is None
    assert m.status is U


def test_begin_drain() -> None:
    m = HealthStateMachine()
    t = m.begin_drain(3.0, "shutdown")
    assert t is not None and (t.src, t.dst, t.reason) == (H, D, "shutdown")
    assert m.begin_drain(4.0) is None


# ---------------------------------------------------------------------------- EMA


def test_ema_baseline() -> None:
    ema = EmaBaseline(0.1)
    assert ema.value is None and not ema.is_spike(100.0, 3.0)
    ema.update(0.020)
    assert ema.value == pytest.approx(0.020)
    ema.update(0.030)
    assert ema.value == pytest.approx(0.021)
    assert ema.is_spike(0.064, 3.0) and not ema.is_spike(0.063, 3.0)
    with pytest.raises(ValueError):
        EmaBaseline(0.0)


# ---------------------------------------------------------------------------- tracker


def ok(latency: float) -> CheckResult:
    return CheckResult(CheckKind.OK, latency)


def test_tracker_opens_breaker_with_unhealthy_and_recovers_through_half_open() -> None:
    tr = HealthTracker(3)
    assert tr.begin_check(0.0)
    for t in (0.0, 30.0, 60.0):
        tr.record_check(BAD, t)
    assert tr.status is U and tr.breaker.state is BreakerState.OPEN and tr.weight == 0.0
    assert not tr.begin_check(100.0)  # breaker holds checks for 60 s after the last failure
    assert tr.begin_check(120.0)  # the half-open trial
    assert not tr.begin_check(150.0)
    t = tr.record_check(ok(0.02), 121.0)
    assert t is not None and t.dst is H
    assert tr.breaker.state is BreakerState.CLOSED and tr.weight == 1.0


def test_tracker_drains_after_failed_recovery_trials() -> None:
    tr = HealthTracker(3)
    now = 0.0
    for _ in range(3):
        tr.record_check(BAD, now)
    for _ in range(3):
        now += 60.0
        assert tr.begin_check(now)
        tr.record_check(CheckResult(CheckKind.TIMEOUT, 5.0), now)
    assert tr.status is D
    assert not tr.begin_check(now + 1000.0)


def test_tracker_respects_the_check_interval() -> None:
    tr = HealthTracker(1, HealthConfig(check_interval_s=30.0))
    assert tr.begin_check(0.0)
    assert not tr.begin_check(29.9)
    assert tr.begin_check(30.0)


def test_tracker_detects_a_latency_spike_against_its_ema_baseline() -> None:
    tr = HealthTracker(1)
    for i in range(10):
        tr.record_check(ok(0.020), float(i))
    assert tr.baseline_s == pytest.approx(0.020)
    t = tr.record_check(ok(0.070), 10.0)  # a plain "ok" that is 3.5x the baseline
    assert t is not None and t.dst is S and "latency_spike" in t.reason
    assert tr.weight == 0.5
    assert tr.baseline_s == pytest.approx(0.020)  # spikes do not move the baseline
    tr.record_check(ok(0.030), 11.0)
    assert tr.status is H and tr.baseline_s == pytest.approx(0.021)


def test_baseline_only_moves_while_healthy() -> None:
    tr = HealthTracker(1, HealthConfig(recover_after_successes=2))
    tr.record_check(ok(0.02), 0.0)
    tr.record_check(BAD, 1.0)
    tr.record_check(ok(0.05), 2.0)  # still suspicious: not a baseline sample
    assert tr.baseline_s == pytest.approx(0.02)


def test_tracker_stream_errors() -> None:
    tr = HealthTracker(1)
    assert tr.record_stream_error(InvalidArgument("bad"), 0.0) is None
    assert tr.record_stream_error(Cancelled(), 0.0) is None
    assert tr.status is H
    t = tr.record_stream_error(CannotConnect("refused"), 1.0)
    assert t is not None and t.dst is S and tr.breaker.failure_count == 1
    tr.record_request_success(2.0)
    assert tr.breaker.failure_count == 0
    t = tr.record_stream_error(EngineShutdown("dead"), 3.0)
    assert t is not None and t.dst is U
    assert tr.breaker.state is BreakerState.OPEN and tr.weight == 0.0


def test_weight_is_zero_while_breaker_is_not_closed() -> None:
    cfg = HealthConfig(unhealthy_after_failures=5, breaker=BreakerConfig(failure_threshold=2))
    tr = HealthTracker(1, cfg)
    tr.record_check(BAD, 0.0)
    tr.record_check(BAD, 1.0)
    assert tr.status is S and tr.breaker.state is BreakerState.OPEN and tr.weight == 0.0


def test_tracker_death_and_recovery() -> None:
    tr = HealthTracker(1)
    tr.begin_drain(0.0)
    tr.record_check(BAD, 1.0)
    t = tr.record_recovered(2.0)
    assert t is not None and t.dst is H and tr.breaker.state is BreakerState.CLOSED and tr.baseline_s is None
    t = tr.record_process_death(3.0)
    assert t is not None and t.dst is X and tr.weight == 0.0
    assert tr.record_recovered(4.0) is None and not tr.begin_check(100.0)
