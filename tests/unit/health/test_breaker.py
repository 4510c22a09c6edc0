"""CircuitBreaker: opening after consecutive failures, recovery timing, half-open trials."""

from __future__ import annotations

import pytest

from kvmesh.health.breaker import BreakerConfig, BreakerState, CircuitBreaker


def opened(at: float = 0.0, **kwargs: float) -> CircuitBreaker:
    breaker = CircuitBreaker(BreakerConfig(**kwargs))  # type: ignore[arg-type]
    for _ in range(breaker.config.failure_threshold):
        breaker.record_failure(at)
    assert breaker.state is BreakerState.OPEN
    return breaker


def test_defaults_follow_the_design() -> None:
    cfg = BreakerConfig()
    assert (cfg.failure_threshold, cfg.recovery_timeout_s, cfg.half_open_max_calls) == (3, 60.0, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"failure_threshold": 0},
        {"recovery_timeout_s": -1.0},
        {"recovery_timeout_s": float("nan")},
        {"half_open_max_calls": 0},
    ],
)
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerConfig(**kwargs)  # type: ignore[arg-type]


def test_opens_after_threshold_consecutive_failures() -> None:
    breaker = CircuitBreaker()
    breaker.record_failure(0.0)
    breaker.record_failure(1.0)
    assert breaker.state is BreakerState.CLOSED and breaker.allow(1.0)
    breaker.record_failure(2.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow(2.0)


def test_a_success_while_closed_resets_the_count() -> None:
    breaker = CircuitBreaker()
    breaker.record_failure(0.0)
    breaker.record_failure(0.0)
    breaker.record_success(0.0)
    breaker.record_failure(0.0)
    breaker.record_failure(0.0)
    assert breaker.state is BreakerState.CLOSED and breaker.failure_count == 2


def test_recovery_timeout_then_exactly_one_trial() -> None:
    breaker = opened(at=10.0)
    assert not breaker.allow(69.9)
    assert breaker.retry_after(40.0) == pytest.approx(30.0)
    assert breaker.allow(70.0)
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow(70.1)  # one trial call only


def test_trial_success_closes() -> None:
    breaker = opened()
    assert breaker.allow(60.0)
    breaker.record_success(60.5)
    assert breaker.state is BreakerState.CLOSED and breaker.failure_count == 0
    assert breaker.allow(60.6)


def test_trial_failure_reopens_for_another_timeout() -> None:
    breaker = opened()
    assert breaker.allow(60.0)
    breaker.record_failure(61.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow(120.0)
    assert breaker.allow(121.0)


def test_failure_while_open_restarts_the_wait() -> None:
    breaker = opened()
    breaker.record_failure(30.0)
    assert not breaker.allow(60.0)
    assert breaker.allow(90.0)


def test_success_while_open_is_ignored() -> None:
    breaker = opened()
    breaker.record_success(1.0)
    assert breaker.state is BreakerState.OPEN


def test_an_unanswered_trial_does_not_wedge_half_open() -> None:
    breaker = opened()
    assert breaker.allow(60.0)
    assert not breaker.allow(100.0)
    assert breaker.allow(120.0)  # a new trial window after another recovery timeout


def test_several_half_open_calls() -> None:
    breaker = opened(half_open_max_calls=2)
    assert breaker.allow(60.0) and breaker.allow(60.0)
    assert not breaker.allow(60.0)


def test_trip_opens_at_once() -> None:
    breaker = CircuitBreaker()
    breaker.trip(5.0)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow(64.0) and breaker.allow(65.0)


def test_state_values_are_the_gauge_values() -> None:
    assert [s.value for s in BreakerState] == [0, 1, 2]
