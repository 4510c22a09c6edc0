"""Capacity model, degradation levels with hysteresis, and tier admission."""

from __future__ import annotations

import math

import pytest

from kvmesh.health.degradation import (
    ACTIONS,
    CapacityConfig,
    CapacityModel,
    Decision,
    DegradationController,
    DegradationLevel,
    Priority,
    admit,
    level_for_ratio,
    parse_priority,
)
from kvmesh.protocol import LoadReport

L = DegradationLevel


def report(worker_id: int, total_blocks: int = 8192) -> LoadReport:
    return LoadReport(worker_id=worker_id, active_blocks=0, total_blocks=total_blocks, num_waiting=0, num_running=0)


def test_defaults_follow_the_design() -> None:
    cfg = CapacityConfig()
    assert (cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.slo_throughput_rps, cfg.max_batch_size) == (500.0, 30.0, 100.0, 256)
    assert cfg.avg_seq_len == 2048 and cfg.thresholds == (1.0, 0.75, 0.5, 0.25) and cfg.retry_after_s == 30.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slo_ttft_ms": 0.0},
        {"slo_tpot_ms": -1.0},
        {"slo_throughput_rps": math.inf},
        {"max_batch_size": 0},
        {"block_size": 0},
        {"thresholds": (1.0, 0.5, 0.75, 0.25)},
        {"thresholds": (1.0, 0.5, 0.25)},
        {"hysteresis": -0.1},
    ],
)
def test_config_is_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CapacityConfig(**kwargs)  # type: ignore[arg-type]


def test_worker_capacity_is_concurrency_over_request_time() -> None:
    cfg = CapacityConfig(slo_ttft_ms=500, slo_tpot_ms=30, avg_output_tokens=100, avg_seq_len=1024, block_size=16)
    model = CapacityModel(cfg)
    assert cfg.request_time_s == pytest.approx(3.5)
    # KV-bound: 6400 blocks / 64 blocks per sequence = 100 sequences
    assert model.worker_rps(report(1, 6400)) == pytest.approx(100 / 3.5)
    # batch-bound: at most 256 sequences
    assert model.worker_rps(report(1, 10**6)) == pytest.approx(256 / 3.5)


def test_capacity_sums_healthy_workers_scaled_by_weight() -> None:
    model = CapacityModel()
    one = model.worker_rps(report(1))
    reports = [report(1), report(2), report(3)]
    assert model.capacity_rps(reports) == pytest.approx(3 * one)
    assert model.capacity_rps(reports, {2: 0.5, 3: 0.0}) == pytest.approx(1.5 * one)
    assert model.ratio(reports, demand_rps=one) == pytest.approx(3.0)
    assert model.ratio([], demand_rps=0.0) == math.inf


@pytest.mark.parametrize(
    ("ratio", "level"),
    [
        (2.0, L.NONE),
        (1.0, L.NONE),
        (0.99, L.REDUCE_BATCH),
        (0.75, L.REDUCE_BATCH),
        (0.6, L.SHED_BEST_EFFORT),
        (0.5, L.SHED_BEST_EFFORT),
        (0.3, L.RELAX_LATENCY),
        (0.25, L.RELAX_LATENCY),
        (0.1, L.REJECT_NEW),
        (0.0, L.REJECT_NEW),
    ],
)
def test_level_for_ratio(ratio: float, level: DegradationLevel) -> None:
    assert level_for_ratio(ratio) is level


def test_actions_per_level() -> None:
    assert ACTIONS[L.NONE].batch_multiplier == 1.0 and ACTIONS[L.NONE].accept_new
    assert ACTIONS[L.REDUCE_BATCH].batch_multiplier == 0.75 and not ACTIONS[L.REDUCE_BATCH].shed
    assert ACTIONS[L.SHED_BEST_EFFORT].shed == {Priority.BEST_EFFORT}
    assert ACTIONS[L.RELAX_LATENCY].latency_multiplier == 2.0 and ACTIONS[L.RELAX_LATENCY].batch_multiplier == 0.5
    assert not ACTIONS[L.REJECT_NEW].accept_new


def test_worse_applies_at_once_better_after_hysteresis_and_hold() -> None:
    ctl = DegradationController(CapacityConfig(hysteresis=0.05, recover_hold_s=30.0))
    change = ctl.update(0.6, 0.0)
    assert change is not None and (change.src, change.dst, change.ratio) == (L.NONE, L.SHED_BEST_EFFORT, 0.6)
    assert ctl.update(0.1, 1.0) is not None and ctl.level is L.REJECT_NEW
    # back above 0.25 but not by the margin: stays
    assert ctl.update(0.27, 2.0) is None and ctl.level is L.REJECT_NEW
    # clear by the margin: needs to hold for 30 s
    assert ctl.update(0.31, 10.0) is None
    assert ctl.update(0.31, 39.9) is None
    change = ctl.update(0.31, 40.0)
    assert change is not None and change.dst is L.RELAX_LATENCY


def test_a_dip_restarts_the_hold() -> None:
    ctl = DegradationController(CapacityConfig(recover_hold_s=30.0))
    ctl.update(0.6, 0.0)
    assert ctl.update(1.2, 10.0) is None
    assert ctl.update(0.52, 20.0) is None  # wants level 2 again: the hold restarts
    assert ctl.update(1.2, 35.0) is None
    assert ctl.update(1.2, 64.0) is None
    change = ctl.update(1.2, 65.0)
    assert change is not None and change.dst is L.NONE and ctl.actions.accept_new


def test_recovery_goes_straight_to_the_sustained_level() -> None:
    ctl = DegradationController(CapacityConfig(recover_hold_s=0.0))
    ctl.update(0.0, 0.0)
    change = ctl.update(1.1, 1.0)
    assert change is not None and (change.src, change.dst) == (L.REJECT_NEW, L.NONE)


def test_evaluate_from_load_reports() -> None:
    cfg = CapacityConfig(recover_hold_s=0.0)
    ctl = DegradationController(cfg)
    per_worker = CapacityModel(cfg).worker_rps(report(0))
    workers = [report(i) for i in range(4)]
    assert ctl.evaluate(workers, 0.0, demand_rps=4 * per_worker) is None and ctl.level is L.NONE
    change = ctl.evaluate(workers[:3], 1.0, demand_rps=4 * per_worker)  # one worker lost: 75 %
    assert change is not None and change.dst is L.REDUCE_BATCH and ctl.last_ratio == pytest.approx(0.75)
    ctl.evaluate(workers[:1], 2.0, demand_rps=4 * per_worker)
    assert ctl.level is L.RELAX_LATENCY


@pytest.mark.parametrize(
    ("level", "premium", "standard", "best_effort"),
    [
        (0, True, True, True),
        (1, True, True, True),
        (2, True, True, False),
        (3, True, True, False),
        (4, False, False, False),
    ],
)
def test_admission_by_tier(level: int, premium: bool, standard: bool, best_effort: bool) -> None:
    got = [admit(tier, level).allowed for tier in ("premium", "standard", "best_effort")]
    assert got == [premium, standard, best_effort]


def test_rejections_carry_retry_after() -> None:
    assert admit("premium", L.NONE) == Decision(True, None)
    assert admit(Priority.BEST_EFFORT, L.SHED_BEST_EFFORT) == Decision(False, 30.0)
    assert admit(None, L.REJECT_NEW, retry_after_s=5.0) == Decision(False, 5.0)


def test_priority_parsing() -> None:
    assert parse_priority(None) is Priority.STANDARD
    assert parse_priority("best_effort") is Priority.BEST_EFFORT
    with pytest.raises(ValueError):
        parse_priority("gold")
    with pytest.raises(ValueError):
        admit("gold", 0)
