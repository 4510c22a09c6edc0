"""Issue 32: the planner's load forecast (planner/forecast.py), the capacity profile and
the sizing from it (planner/profile.py), and the core sizing to a forecast."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.planner.core import Action, ActionKind, Observation, Planner, PlannerConfig, Role, WorkerView
from kvmesh.planner.forecast import METHODS, Holt, Kalman, LastValue, LoadForecast, LoadForecaster, forecast_errors
from kvmesh.planner.profile import CapacityPoint, CapacityProfile, dump_profile, load_profile, size_fleet

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- forecasters


@pytest.mark.parametrize("make", [Holt, Kalman])
def test_a_ramp_is_forecast_ahead_not_behind(make: type) -> None:
    f = make()
    for k in range(30):
        f.update(10.0 + 2.0 * k)  # the last value seen: 68; five rounds on: 78
    assert abs(f.forecast(5) - 78.0) < 0.1 * 78.0
    assert f.forecast(5) > f.forecast(1) > 68.0  # it extrapolates the trend
    last = LastValue()
    last.update(68.0)
    assert abs(last.forecast(5) - 78.0) >= 0.1 * 78.0  # the baseline lags: the bound has teeth


@pytest.mark.parametrize("method", ["holt", "kalman"])
def test_a_daily_sine_is_forecast_within_a_bound_and_better_than_the_last_value(method: str) -> None:
    day = [50.0 + 45.0 * math.sin(2 * math.pi * k / 100.0) for k in range(300)]  # arrivals per round, 10x
    err = forecast_errors(day, method, steps=3)
    assert err.wape < 0.08
    assert err.wape < forecast_errors(day, "last", steps=3).wape


def test_kalman_smooths_poisson_noise_better_than_the_last_value() -> None:
    rng = random.Random(7)
    series = []
    for k in range(400):
        lam = 20.0 + 15.0 * math.sin(2 * math.pi * k / 200.0)
        n, t = 0, rng.expovariate(lam)  # a Poisson count in one unit of time
        while t < 1.0:
            n, t = n + 1, t + rng.expovariate(lam)
        series.append(float(n))
    assert forecast_errors(series, "kalman").wape < 0.85 * forecast_errors(series, "last").wape


def _poisson(rng: random.Random, lam: float) -> float:
    """A Poisson count in one unit of time."""
    n, t = 0, rng.expovariate(lam)
    while t < 1.0:
        n, t = n + 1, t + rng.expovariate(lam)
    return float(n)


def test_a_start_ahead_the_kalman_forecast_of_a_steady_poisson_count_is_steadier_than_the_count() -> None:
    """120 arrivals a round on average: the forecast five rounds ahead (a worker's start)
    spreads less than the count itself (9 %); with the trend's process noise at 2 % of the
    level, its trend followed the noise and the forecast spread 13 %: the fleet was sized
    for noise."""
    rng = random.Random(1)
    f = Kalman()
    ahead = []
    for k in range(400):
        f.update(_poisson(rng, 120.0))
        if k >= 50:
            ahead.append(f.forecast(5))
    mean = sum(ahead) / len(ahead)
    spread = math.sqrt(sum((a - mean) ** 2 for a in ahead) / len(ahead)) / 120.0
    assert abs(mean / 120.0 - 1.0) < 0.05
    assert spread < 1 / math.sqrt(120.0), spread


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_kalman_filter_turns_at_the_trough_of_a_steep_poisson_sine(seed: int) -> None:
    """A load swinging 19x in 50 rounds: the filter's process noise scales with the series'
    slow mean, not with the level at the trough, so it follows the curve there (scaled by
    the level alone it did worse than the last value)."""
    rng = random.Random(seed)
    day = [_poisson(rng, 50.0 + 45.0 * math.sin(2 * math.pi * k / 100.0)) for k in range(300)]
    assert forecast_errors(day, "kalman", steps=3).wape < 0.9 * forecast_errors(day, "last", steps=3).wape


def test_forecasts_are_never_negative_and_bad_inputs_say_what_is_wrong() -> None:
    for method in METHODS:
        f = METHODS[method]()
        assert f.forecast(1) == 0.0
        for v in (10.0, 5.0, 1.0, 0.0):
            f.update(v)
        assert f.forecast(10) >= 0.0
    with pytest.raises(ValueError, match="unknown forecast method 'arima'"):
        LoadForecaster("arima")
    with pytest.raises(ValueError, match="too short"):
        forecast_errors([1.0, 2.0], "holt", steps=3)


def test_load_forecaster_forecasts_the_peak_rate_and_keeps_the_mix_through_quiet_rounds() -> None:
    f = LoadForecaster()
    for k in range(20):
        f.observe(10 + k, 1.0, (10 + k) * 4000, (10 + k) * 300)
    for _ in range(2):
        f.observe(0, 1.0, 0, 0)  # no arrivals: the rate falls, the mix stays
    got = f.predict(3)
    assert got.input_tokens == pytest.approx(4000, rel=0.01) and got.output_tokens == pytest.approx(300, rel=0.01)
    rising = LoadForecaster()
    for k in range(20):
        rising.observe(10 + 2 * k, 1.0, 1000, 100)
    assert rising.predict(5).rate_rps > rising.predict(1).rate_rps > 48.0


# ---------------------------------------------------------------------------- the profile


def _profile(prefill: float = 4.0) -> CapacityProfile:
    points = tuple(
        CapacityPoint(i, o, prefill * 1000 / i, 20.0 * 100 / o, prefill * 500 / i) for i in (1000, 8000) for o in (100, 800)
    )
    return CapacityProfile(2000.0, 35.0, 0.99, points)


def test_profile_is_exact_on_its_grid_log_linear_between_and_extrapolated_beyond() -> None:
    p = _profile()
    assert p.at(8000, 100).prefill_rps == pytest.approx(0.5)
    assert p.at(1000, 800).decode_rps == pytest.approx(2.5)
    mid = p.at(math.sqrt(1000 * 8000), 100).prefill_rps  # halfway in log: the geometric mean
    assert mid == pytest.approx(math.sqrt(4.0 * 0.5))
    assert p.at(16_000, 100).prefill_rps == pytest.approx(0.25)  # a longer prompt than measured: less, not the edge's


def test_profile_never_claims_more_than_measured_outside_its_grid() -> None:
    p = _profile()
    assert _rates(p.at(10, 10)) == pytest.approx(_rates(p.at(1000, 100)))  # shorter than measured: the edge's
    assert p.at(0.0, 100).prefill_rps == pytest.approx(4.0)
    # a worker whose measured capacity barely falls with the answer's length (prefill-bound
    # at short answers) still carries no more answer tokens/s beyond the grid than at its edge
    flat = CapacityProfile(2000.0, 35.0, 0.99, tuple(
        CapacityPoint(1000, o, 30.0, 30.0, 30.0 if o == 24 else 22.0) for o in (24, 600)))  # fmt: skip
    assert flat.at(1000, 3000).aggregated_rps == pytest.approx(22.0 * 600 / 3000)
    assert flat.at(1000, 600).aggregated_rps == pytest.approx(22.0)


def _rates(c: CapacityPoint) -> tuple[float, float, float]:
    return c.prefill_rps, c.decode_rps, c.aggregated_rps


def test_a_mix_forecast_is_never_shorter_than_the_last_round() -> None:
    f = LoadForecaster()
    for _ in range(20):
        f.observe(7, 1.0, 7 * 16_000, 7 * 40)
    for _ in range(3):  # the prompts shrink to 1000 tokens: Holt's trend runs below that
        f.observe(10, 1.0, 10 * 1000, 10 * 3000)
    forecast = f.predict(5)
    assert forecast.input_tokens >= 1000.0 and forecast.output_tokens >= 3000.0


def test_profile_round_trips_as_json_and_a_bad_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    dump_profile(_profile(), path)
    assert load_profile(path) == _profile()
    doc = json.loads(path.read_text())
    doc["points"] = doc["points"][:3]  # a hole in the grid
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="each input length with each output length"):
        load_profile(path)
    doc = json.loads(path.read_text())
    doc["points"][0]["prefill_rps"] = -1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="positive finite rates"):
        load_profile(path)
    path.write_bytes(b" " * (1 << 20) + b"{}")
    with pytest.raises(ValueError, match="larger than"):
        load_profile(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_size_fleet_divides_the_forecast_by_one_workers_capacity_with_headroom() -> None:
    p = _profile()  # at 1000/100: prefill 4, decode 20, aggregated 2 requests/s per worker
    s = size_fleet(p, LoadForecast(10.0, 1000, 100), headroom=1.0)
    assert (s.prefill, s.decode, s.aggregated) == (3, 1, 5)
    s = size_fleet(p, LoadForecast(10.0, 1000, 100), headroom=0.8)
    assert (s.prefill, s.decode, s.aggregated) == (4, 1, 7)
    assert size_fleet(p, LoadForecast(0.0, 0.0, 0.0)).aggregated == 1  # never below one


# ---------------------------------------------------------------------------- the core with a profile


def _obs(t: float, workers: dict[int, Role], rate: float, starting: tuple[Role, ...] = ()) -> Observation:
    views = tuple(WorkerView(i, r, True) for i, r in workers.items())
    n = round(rate)
    return Observation(t, views, starting, interval_s=1.0, arrived=n, arrived_input_tokens=n * 1000,
                       arrived_output_tokens=n * 100)  # fmt: skip


def test_with_a_profile_the_planner_starts_what_the_forecast_needs_at_once_and_stops_after_the_hold() -> None:
    cfg = PlannerConfig(min_workers=1, max_workers=6, profile=_profile(), headroom=1.0, hold_rounds=3, cooldown_s=5.0)
    planner = Planner(cfg)
    fleet = {0: Role.AGGREGATED}
    plan = planner.plan(_obs(0.0, fleet, 2.0))  # 2 req/s at 2 per worker: one is enough
    assert plan.actions == () and plan.targets == {Role.AGGREGATED: 1}
    starts: list[Action] = []
    for k in range(1, 6):  # the load jumps to 8 req/s: four workers, started in the round it is seen
        plan = planner.plan(_obs(float(k), fleet, 8.0, tuple(Role.AGGREGATED for _ in starts)))
        starts += [a for a in plan.actions if a.kind is ActionKind.START]
        if k == 1:
            assert starts, plan
    assert len(starts) >= 3 and all(a.role is Role.AGGREGATED for a in starts)
    assert plan.forecast is not None and plan.forecast.rate_rps > 6.0
    assert "forecast_rps" in starts[0].inputs and "target_aggregated" in starts[0].inputs
    fleet = {i: Role.AGGREGATED for i in range(1 + len(starts))}
    stops = []
    for k in range(6, 60):  # the load falls to 1 req/s (the started workers serve): one stop per hold
        plan = planner.plan(_obs(float(k), fleet, 1.0))
        for a in plan.actions:
            assert a.kind is ActionKind.STOP and a.worker_id is not None
            stops.append((k, a))
            del fleet[a.worker_id]
    assert len(fleet) == 1 and len(stops) == len(starts)
    gaps = [b[0] - a[0] for a, b in zip(stops, stops[1:])]
    assert all(3 <= g < 5 for g in gaps)  # a falling load sheds a worker per hold, not per cool-down
    assert stops[0][0] - 6 >= 2  # the target held (no cool-down after the last start: the hold paces stops)


def test_with_a_profile_a_full_disaggregated_fleet_moves_workers_to_the_forecast_split() -> None:
    cfg = PlannerConfig(min_workers=4, max_workers=4, profile=_profile(), headroom=1.0, hold_rounds=2, cooldown_s=0.0)
    planner = Planner(cfg)
    fleet = {0: Role.DECODE, 1: Role.DECODE, 2: Role.DECODE, 3: Role.PREFILL}
    moves = []
    for k in range(8):  # 10 req/s of 1000/100: prefill needs 3 (4/s each), decode 1 (20/s)
        plan = planner.plan(replace(_obs(float(k), fleet, 10.0), ttft_p90_ms=475.0))  # prefill TTFT at 0.95 of its SLO
        for a in plan.actions:
            assert a.kind is ActionKind.MOVE and a.worker_id is not None and a.role is Role.PREFILL
            moves.append(a)
            fleet[a.worker_id] = Role.PREFILL
    assert plan.targets == {Role.PREFILL: 3, Role.DECODE: 1}
    assert sorted(fleet.values(), key=lambda r: r.value) == [Role.DECODE, Role.PREFILL, Role.PREFILL, Role.PREFILL]
    assert len(moves) == 2


def test_without_a_profile_the_planner_makes_no_forecast() -> None:
    plan = Planner(PlannerConfig()).plan(_obs(0.0, {0: Role.AGGREGATED}, 50.0))
    assert plan.forecast is None and plan.targets == {}


def test_a_profile_without_reported_arrivals_falls_back_to_the_pressures() -> None:
    planner = Planner(PlannerConfig(profile=_profile(), hold_rounds=1))
    obs = Observation(0.0, (WorkerView(0, Role.AGGREGATED, True),))  # interval_s 0: the fleet reports no arrivals
    plan = planner.plan(obs)
    assert plan.forecast is None and plan.targets == {} and planner.forecaster.rounds == 0


class _OneWorkerFleet:
    def __init__(self) -> None:
        self.started: list[Role] = []
        self.k = 0

    async def settled(self) -> None:
        return None

    async def observe(self) -> Observation:
        self.k += 1
        return _obs(float(self.k), {0: Role.AGGREGATED}, 6.0, tuple(self.started))

    async def start(self, role: Role) -> None:
        self.started.append(role)

    async def promote(self, worker_id: int, role: Role) -> None:
        raise AssertionError("no spares")

    async def stop(self, worker_id: int) -> None:
        raise AssertionError("no stop")

    async def move(self, worker_id: int, role: Role) -> None:
        raise AssertionError("no move")


async def test_the_service_exports_the_forecast_and_targets_as_planner_inputs() -> None:
    from prometheus_client import CollectorRegistry

    from kvmesh.observability.metrics import PlannerMetrics
    from kvmesh.planner.service import PlannerService

    registry = CollectorRegistry()
    fleet = _OneWorkerFleet()
    cfg = PlannerConfig(min_workers=1, max_workers=4, profile=_profile(), headroom=1.0)
    service = PlannerService(Planner(cfg), fleet, 1.0, PlannerMetrics(registry))
    plan = await service.round()
    assert plan.targets == {Role.AGGREGATED: 3} and fleet.started == [Role.AGGREGATED, Role.AGGREGATED]

    def value(signal: str) -> float | None:
        return registry.get_sample_value("kvmesh_planner_input", {"signal": signal})

    assert value("forecast_rps") == pytest.approx(6.0) and value("target_aggregated") == 3.0
    assert value("forecast_input_tokens") == pytest.approx(1000.0)
    assert all(d.action.inputs["forecast_rps"] == pytest.approx(6.0) for d in service.history)  # logged with it


def test_counter_total_sums_every_label_set() -> None:
    from prometheus_client import CollectorRegistry, Counter

    from kvmesh.planner.signals import counter_total

    c = Counter("reqs", "r", ["status"], registry=CollectorRegistry())
    c.labels("200").inc(3)
    c.labels("500").inc(2)
    assert counter_total(c) == 5.0


def test_a_forecast_move_that_would_fill_the_donors_kv_is_vetoed() -> None:
    cfg = PlannerConfig(min_workers=4, max_workers=4, profile=_profile(), headroom=1.0, hold_rounds=2, cooldown_s=0.0)

    def run(kv: float) -> list[object]:
        planner = Planner(cfg)
        views = (WorkerView(0, Role.DECODE, True, kv), WorkerView(1, Role.DECODE, True, kv),
                 WorkerView(2, Role.PREFILL, True), WorkerView(3, Role.PREFILL, True))  # fmt: skip
        actions: list[object] = []
        for k in range(6):  # the forecast wants 3 prefill, 1 decode
            obs = Observation(float(k), views, ttft_p90_ms=475.0, interval_s=1.0, arrived=10,
                              arrived_input_tokens=10_000, arrived_output_tokens=1_000)  # fmt: skip
            plan = planner.plan(obs)
            assert plan.targets == {Role.PREFILL: 3, Role.DECODE: 1}
            actions += plan.actions
        return actions

    assert run(0.45) == []  # slack now (below low), but one decode worker would hold 90 % of its KV
    moved = run(0.3)  # 60 %: fine
    assert len(moved) == 1 and moved[0].kind is ActionKind.MOVE  # type: ignore[attr-defined]


def test_a_worker_added_on_held_pressure_is_kept_for_the_same_load_no_start_stop_flapping() -> None:
    cfg = PlannerConfig(min_workers=1, max_workers=4, profile=_profile(), headroom=1.0, hold_rounds=2, cooldown_s=1.0)
    planner = Planner(cfg)
    fleet = {0: Role.AGGREGATED}
    kinds = []
    sizes = []
    for k in range(60):  # 1.8 req/s: the profile says one worker (2/s); the measured TTFT says one is not enough
        pressed = len(fleet) == 1
        sizes.append(len(fleet))
        views = tuple(WorkerView(i, r, True) for i, r in fleet.items())
        n = 2 if k % 5 else 1
        obs = Observation(float(k), views, ttft_p90_ms=2000.0 if pressed else 100.0, interval_s=1.0, arrived=n,
                          arrived_input_tokens=n * 1000, arrived_output_tokens=n * 100)  # fmt: skip
        for a in planner.plan(obs).actions:
            kinds.append(a.kind)
            if a.kind is ActionKind.START:
                fleet[max(fleet) + 1] = Role.AGGREGATED
            elif a.worker_id is not None:
                del fleet[a.worker_id]
    assert kinds[0] is ActionKind.START and min(sizes[3:]) >= 2, (kinds, sizes)  # the worker it asked for is kept
    assert ActionKind.START not in kinds[kinds.index(ActionKind.STOP):] if ActionKind.STOP in kinds else True
