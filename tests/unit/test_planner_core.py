"""The planner's decision core (kvmesh.planner.core): pure, the clock is an input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.planner.core import Action, ActionKind, Observation, Planner, PlannerConfig, Role, WorkerView

P, D, A, S = Role.PREFILL, Role.DECODE, Role.AGGREGATED, Role.SPARE


def fleet(*roles: Role, kv: float = 0.3, down: tuple[int, ...] = ()) -> tuple[WorkerView, ...]:
    return tuple(WorkerView(i, r, routable=i not in down, kv_usage=kv) for i, r in enumerate(roles))


def obs(t: float, workers: tuple[WorkerView, ...], **kw: object) -> Observation:
    return Observation(now_s=t, workers=workers, **kw)  # type: ignore[arg-type]  # test shorthand


def kinds(actions: tuple[Action, ...]) -> list[tuple[ActionKind, Role]]:
    return [(a.kind, a.role) for a in actions]


def test_a_need_must_hold_for_hold_rounds_before_anything_moves() -> None:
    planner = Planner(PlannerConfig(max_workers=8, hold_rounds=3, cooldown_s=0))
    workers = fleet(P, D, D, D, kv=0.1)
    pressed = {"ttft_p90_ms": 900.0, "itl_p90_ms": 5.0}  # TTFT 1.8x its SLO, decode idle
    assert planner.plan(obs(0, workers, **pressed)).actions == ()
    assert planner.plan(obs(1, workers, **pressed)).actions == ()
    (move,) = planner.plan(obs(2, workers, **pressed)).actions
    assert (move.kind, move.role) == (ActionKind.MOVE, P)
    assert move.worker_id in (1, 2, 3) and move.inputs["prefill_pressure"] == pytest.approx(1.8)


def test_one_calm_round_resets_the_streak() -> None:
    planner = Planner(PlannerConfig(hold_rounds=2, cooldown_s=0))
    workers = fleet(P, D, D, kv=0.1)
    assert planner.plan(obs(0, workers, ttft_p90_ms=900.0)).actions == ()
    assert planner.plan(obs(1, workers, ttft_p90_ms=300.0)).actions == ()
    assert planner.plan(obs(2, workers, ttft_p90_ms=900.0)).actions == ()
    assert planner.plan(obs(3, workers, ttft_p90_ms=900.0)).actions != ()


def test_the_cool_down_spaces_reshaping_actions() -> None:
    planner = Planner(PlannerConfig(max_workers=8, hold_rounds=1, cooldown_s=30))
    workers = fleet(A, A, kv=0.95)  # KV nearly full: decode pressed
    assert kinds(planner.plan(obs(0, workers)).actions) == [(ActionKind.START, A)]
    workers = fleet(A, A, A, kv=0.95)
    assert planner.plan(obs(10, workers)).actions == ()
    assert planner.plan(obs(29.9, workers)).actions == ()
    assert kinds(planner.plan(obs(30, workers)).actions) == [(ActionKind.START, A)]


def test_the_least_loaded_worker_of_the_slack_role_moves() -> None:
    planner = Planner(PlannerConfig(hold_rounds=1, cooldown_s=0))
    workers = (
        WorkerView(0, P, True, kv_usage=0.2),
        WorkerView(1, D, True, kv_usage=0.3, running=4),
        WorkerView(2, D, True, kv_usage=0.1, running=1),
    )
    (move,) = planner.plan(obs(0, workers, prefill_queue_tokens=40_000)).actions
    assert (move.kind, move.role, move.worker_id) == (ActionKind.MOVE, P, 2)
    assert planner.planned == {A: 0, P: 2, D: 1}


def test_full_decode_batches_read_as_decode_pressure_not_prefill() -> None:
    """Requests waiting on a decode worker make TTFT long; that is the decode side's need
    (a shifting load's decode-heavy phase), and the idle prefill side gives a worker."""
    planner = Planner(PlannerConfig(hold_rounds=1, cooldown_s=0))
    workers = (WorkerView(0, P, True), WorkerView(1, P, True), WorkerView(2, P, True),
               WorkerView(3, D, True, kv_usage=0.3, running=256, waiting=117, capacity=256))  # fmt: skip
    plan = planner.plan(obs(0, workers, ttft_p90_ms=10_000.0, itl_p90_ms=14.0))
    assert plan.prefill_pressure == 0.0 and plan.decode_pressure > 0.9
    (move,) = plan.actions
    assert (move.kind, move.role) == (ActionKind.MOVE, D) and move.worker_id in (0, 1, 2)
    # the same wait beside free slots is a wait for prefill compute: TTFT stays prefill's
    planner = Planner(PlannerConfig(hold_rounds=1, cooldown_s=0))
    roomy = workers[:3] + (WorkerView(3, D, True, kv_usage=0.3, running=40, waiting=117, capacity=256),)
    plan = planner.plan(obs(0, roomy, ttft_p90_ms=10_000.0, itl_p90_ms=14.0))
    assert plan.prefill_pressure == 20.0 and plan.decode_pressure < 0.9


def test_a_donor_that_would_be_pressed_after_the_move_keeps_its_worker() -> None:
    """Slack now is not enough: the side giving a worker must stay under ``high`` with one
    worker less, or the next rounds move it back (the flapping seen on the whole trace)."""
    planner = Planner(PlannerConfig(max_workers=4, hold_rounds=1, cooldown_s=0))
    workers = fleet(P, P, D, D, kv=0.48)  # decode slack (0.48 < low) but 0.96 with one decode worker
    assert planner.plan(obs(0, workers, ttft_p90_ms=900.0)).actions == ()  # at the ceiling: no start either
    roomy = fleet(P, P, D, D, D, kv=0.3)  # 0.3 x 3/2 = 0.45: the move is safe
    planner = Planner(PlannerConfig(max_workers=5, hold_rounds=1, cooldown_s=0))
    assert kinds(planner.plan(obs(0, roomy, ttft_p90_ms=900.0)).actions) == [(ActionKind.MOVE, P)]


def test_a_role_never_drops_below_its_floor_and_the_fleet_grows_instead() -> None:
    planner = Planner(PlannerConfig(max_workers=3, hold_rounds=1, cooldown_s=0))
    workers = fleet(P, D, kv=0.1)
    (start,) = planner.plan(obs(0, workers, ttft_p90_ms=2000.0)).actions  # the one decode worker stays
    assert (start.kind, start.role) == (ActionKind.START, P)
    # the ceiling: 3 planned of 3 -> nothing, degradation carries the rest
    assert planner.plan(obs(1, fleet(P, P, D, kv=0.1), ttft_p90_ms=2000.0)).actions == ()


def test_both_roles_slack_stops_the_least_loaded_down_to_min_workers() -> None:
    planner = Planner(PlannerConfig(min_workers=2, hold_rounds=1, cooldown_s=0))
    workers = (WorkerView(0, A, True, kv_usage=0.2, running=3), WorkerView(1, A, True), WorkerView(2, A, True, running=1))
    (stop,) = planner.plan(obs(0, workers, ttft_p90_ms=10.0, itl_p90_ms=1.0)).actions
    assert (stop.kind, stop.worker_id) == (ActionKind.STOP, 1)
    assert planner.plan(obs(1, workers[::2], ttft_p90_ms=10.0, itl_p90_ms=1.0)).actions == ()


def test_a_lost_worker_is_replaced_by_a_spare_at_once_even_in_the_cool_down() -> None:
    planner = Planner(PlannerConfig(max_workers=4, hot_spares=1, hold_rounds=1, cooldown_s=3600))
    assert planner.plan(obs(0, fleet(D, D, S))).actions == ()
    # worker 1 dies (left discovery): the spare takes its role, a new spare is started
    actions = planner.plan(obs(1, (WorkerView(0, D, True), WorkerView(2, S, True)))).actions
    assert kinds(actions) == [(ActionKind.PROMOTE, D), (ActionKind.START, S)]
    assert actions[0].worker_id == 2
    # the promotion in flight is reported as starting: nothing is done twice
    again = planner.plan(obs(2, (WorkerView(0, D, True), WorkerView(2, S, True)), starting=(D, S))).actions
    assert again == ()


def test_without_a_spare_a_lost_worker_is_cold_started_within_the_ceiling() -> None:
    planner = Planner(PlannerConfig(max_workers=3, cooldown_s=0))
    planner.plan(obs(0, fleet(A, A, A)))
    assert kinds(planner.plan(obs(1, fleet(A, A, A, down=(1,)))).actions) == []  # ejected, still holds a slot
    assert kinds(planner.plan(obs(2, fleet(A, A))).actions) == [(ActionKind.START, A)]


def test_an_unready_spare_is_not_promoted() -> None:
    planner = Planner(PlannerConfig(max_workers=5, hot_spares=1))
    planner.plan(obs(0, fleet(A, A, S)))
    workers = (WorkerView(0, A, True), WorkerView(2, S, routable=False))  # spare still canary-checking
    assert kinds(planner.plan(obs(1, workers)).actions) == [(ActionKind.START, A)]


def test_hot_spares_are_kept_but_never_past_max_workers() -> None:
    planner = Planner(PlannerConfig(max_workers=3, hot_spares=2))
    assert kinds(planner.plan(obs(0, fleet(A, A))).actions) == [(ActionKind.START, S)]
    assert planner.plan(obs(1, fleet(A, A), starting=(S,))).actions == ()


def test_degradation_counts_as_need_when_latency_looks_fine() -> None:
    planner = Planner(PlannerConfig(max_workers=4, hold_rounds=1, cooldown_s=0))
    workers = fleet(A, A, kv=0.6)
    assert planner.plan(obs(0, workers, degradation_level=1)).actions == ()
    assert kinds(planner.plan(obs(1, workers, degradation_level=2)).actions) == [(ActionKind.START, A)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_workers": 0},
        {"min_workers": 5, "max_workers": 4},
        {"low": 0.9, "high": 0.5},
        {"hold_rounds": 0},
        {"slo_ttft_ms": 0},
        {"hot_spares": -1},
    ],
)
def test_bad_settings_are_refused_with_the_reason(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        PlannerConfig(**kwargs)  # type: ignore[arg-type]  # parametrized mixed values


_roles = st.sampled_from([P, D, A, S])
_worker = st.builds(
    WorkerView,
    worker_id=st.integers(0, 30),
    role=_roles,
    routable=st.booleans(),
    kv_usage=st.floats(0, 1),
    running=st.integers(0, 64),
    waiting=st.integers(0, 64),
)
_round = st.fixed_dictionaries(
    {
        "workers": st.lists(_worker, max_size=10, unique_by=lambda w: w.worker_id).map(tuple),
        "ttft_p90_ms": st.floats(0, 5000),
        "itl_p90_ms": st.floats(0, 500),
        "prefill_queue_tokens": st.integers(0, 200_000),
        "degradation_level": st.integers(0, 4),
    }
)


@settings(max_examples=150, deadline=None)
@given(rounds=st.lists(_round, min_size=1, max_size=12), max_workers=st.integers(1, 8), spares=st.integers(0, 2))
def test_decisions_stay_within_bounds_and_name_real_workers(
    rounds: list[dict[str, object]], max_workers: int, spares: int
) -> None:
    config = PlannerConfig(min_workers=1, max_workers=max_workers, hot_spares=spares, hold_rounds=1, cooldown_s=0)
    planner = Planner(config)
    for t, r in enumerate(rounds):
        o = obs(float(t), **r)  # type: ignore[arg-type]  # hypothesis dict
        plan = planner.plan(o)
        ids = {w.worker_id: w for w in o.workers}
        starts = sum(1 for a in plan.actions if a.kind is ActionKind.START)
        reshaping = [a for a in plan.actions if a.kind in (ActionKind.MOVE, ActionKind.STOP)]
        assert len(reshaping) <= 1
        if starts:
            assert len(o.workers) + len(o.starting) + starts <= max(max_workers, len(o.workers))
        for a in plan.actions:
            if a.kind is ActionKind.PROMOTE:
                assert a.worker_id is not None and ids[a.worker_id].role is S and ids[a.worker_id].routable
            if a.kind in (ActionKind.MOVE, ActionKind.STOP):
                assert a.worker_id is not None and ids[a.worker_id].role is not S
            assert a.reason
        promoted = [a.worker_id for a in plan.actions if a.kind is ActionKind.PROMOTE]
        assert len(promoted) == len(set(promoted))
