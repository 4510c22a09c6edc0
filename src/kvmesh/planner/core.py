"""The planner's decision core: pure, no I/O, no clock (time is in the observation).

Each round the glue hands :meth:`Planner.plan` an :class:`Observation` of the fleet
(workers with role, routability and load; the prefill queue in tokens; TTFT and ITL
against the SLO; the degradation level) and gets back the :class:`Action` list to
carry out. Two pressures drive it::

    prefill = max(ttft_p90 / slo_ttft, queue_tokens / (queue_tokens_per_prefill × prefill workers))
    decode  = max(itl_p90 / slo_itl, mean KV use of the decode (or aggregated) workers)

except that when requests wait on decode workers whose batches are full (``capacity``
known and reached: a request waiting beside free slots waits for prefill compute), a
disaggregated fleet reads TTFT as the wait for a decode slot: decode ≥ high × (1 +
waiting / running) and prefill is judged by its queue alone.

A pressure at or above ``high`` is a need, below ``low`` is slack. In order:

1. **Replace lost capacity, at once.** When fewer workers of a role are routable than
   the plan holds (a crash, an ejection), a ready hot spare is promoted into that
   role; without one, a replacement is started. No hold, no cool-down.
2. **Keep the hot spares**: start one spare per round while ready + starting spares
   are fewer than ``hot_spares`` and the fleet is below ``max_workers``.
3. **Reshape, with hysteresis and a cool-down**: a signal must hold for
   ``hold_rounds`` consecutive rounds, and ``cooldown_s`` must have passed since the
   last reshaping action. Disaggregated fleets move the least-loaded worker from the
   slack role to the needy one (keeping at least ``min_prefill`` / ``min_decode``),
   only when the slack role stays below ``high`` with one worker less (no flapping);
   when no role has slack, a worker is started (up to ``max_workers``); when both
   roles are slack, the least-loaded worker is stopped (down to ``min_workers``).
   Not in a round that replaces lost capacity.
   Aggregated fleets only start and stop. Degradation at level 2 or worse counts as
   need on the more pressed side (the fleet cannot carry its SLO target).

**With a capacity profile** (``PlannerConfig.profile``) and a fleet that reports its
arrivals (``Observation.interval_s`` > 0), step 3 sizes the fleet from a forecast instead of the pressures' streaks. Each round feeds the round's arrivals
(``Observation.arrived`` and their token totals) to a
:class:`~kvmesh.planner.forecast.LoadForecaster`; the forecast of the next
``forecast_rounds`` rounds (the peak rate, the mix) over one worker's capacity at that
mix (:func:`~kvmesh.planner.profile.size_fleet`) gives each role's target, within
``min_workers`` .. ``max_workers``. What is measured comes first:

* a pressure held at ``high`` for ``hold_rounds`` adds a worker to its role's target
  (one: not while a worker is on its way to the role) and raises the role's correction
  (the profile's error, as measured: later forecasts of the same load keep that worker;
  it relaxes 1 % a round), and a role at ``high`` is not shrunk;
* a disaggregated fleet's targets beyond ``max_workers`` are the split whose busier role
  is the least over its need (the bottleneck: 3.7 prefill + 2.1 decode needed on 4
  workers is 2 + 2), the present one unless another is 10 % better; except that a role
  whose pressure has held at ``high`` gets a worker more than it has, whatever the
  forecast says of the other (both pressed: the split stays);
* a MOVE or STOP takes a worker only from a role measured slack (its SLO measure below
  ``low``: see the next rule; a STOP: through ``hold_rounds``, a MOVE: now, the hold
  being the starving receiver's) that stays below ``high`` with one worker less by what
  scales with its workers (KV use; the prefill queue): a forecast does not starve a role;
* a MOVE feeds only a role whose own SLO measure has held at ``high`` for ``hold_rounds``
  (decode: its pressure; prefill: TTFT, not its queue, which a bounded queue fills by
  design while the overflow prefills on the decode workers within the SLO). A move
  takes longer than the forecast looks ahead, so a need only forecast is not worth a
  donor's drain: on the whole conversation trace forecast-driven moves went back and
  forth (0.90x the best fixed split's goodput); with room in the fleet the forecast
  starts workers instead.

Then, in order: roles below target start workers at once (a ramp does not wait: no
hold, no cool-down); with no room left, a role above target gives a worker to a starving
one below it (MOVE: ``cooldown_s`` after the last reshaping action, one move at a time:
until its worker has left the old role; the time that took is logged); the fleet above
its total target for ``hold_rounds`` stops one (STOP: paced by that hold alone, so a
falling load sheds a worker every ``hold_rounds``: a cool-down after the last start kept
the fleet at the forecast noise's peaks, each start on a noisy round blocking the stops
for ``cooldown_s``; never while a worker of the role is on its way, which would swap a
serving worker for one that serves later; and only when one worker less still leaves
the role 5 % above its need: a band against the forecast's noise).

Every action carries the reason and the inputs it was decided on, for the log and
the metrics; a plan carries the forecast and the targets it was made with.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.planner.forecast import LoadForecast, LoadForecaster
from kvmesh.planner.profile import CapacityProfile, size_fleet
from kvmesh.protocol import InstanceInfo, LoadReport

__all__ = ["Role", "WorkerView", "worker_view", "Observation", "PlannerConfig", "Action", "ActionKind", "Plan", "Planner"]


class Role(enum.Enum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"
    SPARE = "spare"  # started, canary-checked, not routed to


SERVING = (Role.AGGREGATED, Role.PREFILL, Role.DECODE)


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: int
    role: Role
    routable: bool  # healthy and in routing (a spare: ready to be promoted)
    kv_usage: float = 0.0  # active / total KV blocks, 0..1
    running: int = 0
    waiting: int = 0
    capacity: int = 0  # the most sequences its batch holds (0: unknown); its card's max_num_seqs

    @property
    def batch_full(self) -> bool:
        return 0 < self.capacity <= self.running

    @property
    def load(self) -> float:
        return self.kv_usage + self.running + 2 * self.waiting


def worker_view(worker_id: int, role: Role, routable: bool, r: LoadReport | None, info: InstanceInfo | None) -> WorkerView:
    """What the planner sees of a live worker: its load report (None: none yet) and its
    card, whose ``max_num_seqs`` is the batch capacity (the full-decode-batch rule)."""
    kv = r.active_blocks / r.total_blocks if r is not None and r.total_blocks > 0 else 0.0
    capacity = info.engine.max_num_seqs if info is not None else 0
    return WorkerView(worker_id, role, routable, kv, r.num_running if r else 0, r.num_waiting if r else 0, max(0, capacity))


@dataclass(frozen=True, slots=True)
class Observation:
    now_s: float
    workers: tuple[WorkerView, ...]
    # roles of workers on their way into a role: launched, being promoted or moving (a
    # moving worker is also in ``workers`` under its old role until it re-registers)
    starting: tuple[Role, ...] = ()
    prefill_queue_tokens: int = 0
    ttft_p90_ms: float = 0.0
    itl_p90_ms: float = 0.0
    degradation_level: int = 0
    request_rate_rps: float = 0.0  # for the record (the decision log); no rule reads it
    # the round's arrivals, for the forecast (with a capacity profile): how many requests
    # arrived in the ``interval_s`` seconds since the last round, their prompt tokens and
    # the output tokens they asked for (max_tokens)
    interval_s: float = 0.0
    arrived: int = 0
    arrived_input_tokens: int = 0
    arrived_output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    min_workers: int = 1
    max_workers: int = 8
    hot_spares: int = 0
    slo_ttft_ms: float = 500.0
    slo_itl_ms: float = 50.0
    high: float = 0.9
    low: float = 0.5
    queue_tokens_per_prefill: int = 16_384
    hold_rounds: int = 3
    cooldown_s: float = 30.0
    min_prefill: int = 1
    min_decode: int = 1
    # forecast-driven sizing (module docstring): without a profile, the pressures alone
    profile: CapacityProfile | None = None
    forecast_rounds: int = 5  # rounds ahead the fleet is sized for (a start's time, and some)
    headroom: float = 0.85  # run each worker at most at this share of its profiled capacity
    rate_forecast: str = "kalman"
    mix_forecast: str = "holt"

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self.min_workers} and {self.max_workers}")
        if self.hot_spares < 0 or self.hold_rounds < 1 or self.cooldown_s < 0:
            raise ValueError("hot_spares and cooldown_s must be >= 0 and hold_rounds >= 1")
        if not 0 < self.low < self.high:
            raise ValueError(f"need 0 < low < high, got low={self.low} high={self.high}")
        if min(self.slo_ttft_ms, self.slo_itl_ms, self.queue_tokens_per_prefill) <= 0:
            raise ValueError("SLOs and queue_tokens_per_prefill must be positive")
        if self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError("a disaggregated fleet keeps at least one prefill and one decode worker")
        if self.forecast_rounds < 1 or not 0 < self.headroom <= 1:
            raise ValueError(f"need forecast_rounds >= 1 and 0 < headroom <= 1, got {self.forecast_rounds}, {self.headroom}")


class ActionKind(enum.Enum):
    PROMOTE = "promote"  # a ready spare takes ``role``
    START = "start"  # start a worker in ``role`` (SPARE: a hot spare)
    STOP = "stop"  # drain and stop ``worker_id``
    MOVE = "move"  # drain ``worker_id`` and re-register it in ``role``


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    role: Role
    reason: str
    worker_id: int | None = None
    inputs: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...]
    prefill_pressure: float
    decode_pressure: float
    forecast: LoadForecast | None = None  # with a capacity profile: what the targets were sized for
    targets: dict[Role, int] = field(default_factory=dict)  # serving workers wanted per role


class Planner:
    """Decisions with memory: the planned size of each role, signal streaks and the
    time of the last reshaping action. Feed it one observation per round."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._planned: dict[Role, int] | None = None
        # rounds in a row: each role at or above high (prefill: by TTFT or queue; "ttft": by
        # the TTFT the prefill workers answer for alone), each below low (prefill: by that
        # TTFT; its queue is weighed by the move's one-worker-less check), both below low
        self._streaks: dict[str, int] = dict.fromkeys(("prefill", "decode", "ttft", "prefill_slack", "decode_slack", "down"), 0)
        self._last_reshape_s = -math.inf
        self.forecaster = LoadForecaster(config.rate_forecast, config.mix_forecast)
        self._target_streak = 0  # rounds the targets have asked to move or shrink
        # how long the last move took until its worker left the old role (drain, and a
        # restart where the fleet starts the new worker first), for the decision log
        self._move_cost_s = 0.0
        self._moving: tuple[int, Role, float] | None = None  # a move under way: worker, old role, since
        # per role: how much more than the profile says the fleet has been seen to need (a
        # pressure held at high raised it); decays back toward 1 by ``_RELAX`` a round
        self._correction: dict[Role, float] = dict.fromkeys(SERVING, 1.0)
        self._needs: dict[Role, float] = dict.fromkeys(SERVING, 0.0)  # this round's corrected fractional needs

    @property
    def planned(self) -> dict[Role, int]:
        return dict(self._planned or {})

    def plan(self, obs: Observation) -> Plan:
        if self._planned is None:
            # the sizes the fleet was started with: its workers and those on their way
            self._planned = {r: sum(1 for w in obs.workers if w.role is r) + obs.starting.count(r) for r in SERVING}
        prefill, decode = self._pressures(obs)
        inputs = {
            "prefill_pressure": prefill, "decode_pressure": decode, "workers": float(len(obs.workers)),
            "queue_tokens": float(obs.prefill_queue_tokens), "ttft_p90_ms": obs.ttft_p90_ms,
            "itl_p90_ms": obs.itl_p90_ms, "level": float(obs.degradation_level), "rps": obs.request_rate_rps,
        }  # fmt: skip
        actions = self._replace_lost(obs, inputs)
        replacing = bool(actions)
        actions += self._keep_spares(obs, actions, inputs)
        self._count_streaks(prefill, decode, obs.degradation_level, self._prefill_slo(obs))
        if self.config.profile is not None and obs.interval_s > 0:  # a fleet that reports its arrivals
            return self._plan_to_targets(obs, actions, replacing, prefill, decode, inputs)
        # a round that replaces lost capacity does not also reshape (its signals are stale)
        if not replacing and obs.now_s - self._last_reshape_s >= self.config.cooldown_s:
            reshape = self._reshape(obs, actions, prefill, decode, inputs)
            if reshape is not None:
                actions.append(reshape)
                self._last_reshape_s = obs.now_s
                self._streaks = dict.fromkeys(self._streaks, 0)
        return Plan(tuple(actions), prefill, decode)

    # --------------------------------------------------------------------- signals

    def _disaggregated(self) -> bool:
        p = self._planned or {}
        return p.get(Role.PREFILL, 0) > 0 and p.get(Role.DECODE, 0) > 0

    def _pressures(self, obs: Observation) -> tuple[float, float]:
        c = self.config
        prefill = obs.ttft_p90_ms / c.slo_ttft_ms
        kv_roles = (Role.DECODE,) if self._disaggregated() else (Role.AGGREGATED, Role.DECODE)
        views = [w for w in obs.workers if w.role in kv_roles and w.routable]
        kv = [w.kv_usage for w in views]
        decode = max(obs.itl_p90_ms / c.slo_itl_ms, sum(kv) / len(kv) if kv else 0.0)
        if self._disaggregated():
            n_prefill = sum(1 for w in obs.workers if w.role is Role.PREFILL and w.routable)
            queue = obs.prefill_queue_tokens / (c.queue_tokens_per_prefill * max(n_prefill, 1))
            waiting = sum(w.waiting for w in views if w.batch_full)
            if waiting:  # full decode batches: TTFT measures the wait for a decode slot, not prefill
                decode = max(decode, c.high * (1.0 + waiting / max(sum(w.running for w in views), 1)))
                prefill = queue
            else:
                prefill = max(prefill, queue)
        return prefill, decode

    def _count_streaks(self, prefill: float, decode: float, level: int, ttft: float = 0.0) -> None:
        c = self.config
        need_prefill = prefill >= c.high or (level >= 2 and prefill >= decode)
        need_decode = decode >= c.high or (level >= 2 and decode > prefill)
        down = prefill < c.low and decode < c.low and level == 0
        on = {"prefill": need_prefill, "decode": need_decode, "ttft": ttft >= c.high, "prefill_slack": ttft < c.low,
              "decode_slack": decode < c.low, "down": down}  # fmt: skip
        for name, now in on.items():
            self._streaks[name] = self._streaks[name] + 1 if now else 0

    def _prefill_slo(self, obs: Observation) -> float:
        """The prefill workers' own SLO measure: TTFT over its SLO, unless requests wait
        beside full decode batches (then TTFT is the wait for a decode slot). Their queue
        is not in it: a bounded queue runs full by design while its overflow prefills on
        the decode workers within the SLO (the whole conversation trace at 1 prefill worker)."""
        if self._disaggregated() and any(w.waiting and w.batch_full for w in obs.workers if w.role is Role.DECODE):
            return 0.0
        return obs.ttft_p90_ms / self.config.slo_ttft_ms

    # --------------------------------------------------------------------- actions

    def _replace_lost(self, obs: Observation, inputs: dict[str, float]) -> list[Action]:
        assert self._planned is not None
        spares = sorted((w for w in obs.workers if w.role is Role.SPARE and w.routable), key=lambda w: w.worker_id)
        actions: list[Action] = []
        routable = Counter(w.role for w in obs.workers if w.routable)  # one pass: fleets of 10,000 (kvmesh simulate)
        for role in SERVING:
            have = routable[role] + obs.starting.count(role)
            for _ in range(self._planned[role] - have):
                if spares:
                    spare = spares.pop(0)
                    actions.append(Action(ActionKind.PROMOTE, role, f"{role.value} worker lost", spare.worker_id, inputs))
                elif self._fleet_size(obs, actions) < self.config.max_workers:
                    actions.append(Action(ActionKind.START, role, f"{role.value} worker lost, no spare ready", None, inputs))
        return actions

    def _keep_spares(self, obs: Observation, taken: Sequence[Action], inputs: dict[str, float]) -> list[Action]:
        promoted = sum(1 for a in taken if a.kind is ActionKind.PROMOTE)
        spares = sum(1 for w in obs.workers if w.role is Role.SPARE) - promoted + obs.starting.count(Role.SPARE)
        if spares >= self.config.hot_spares or self._fleet_size(obs, taken) >= self.config.max_workers:
            return []
        return [Action(ActionKind.START, Role.SPARE, f"{spares} of {self.config.hot_spares} hot spares", None, inputs)]

    def _fleet_size(self, obs: Observation, taken: Sequence[Action]) -> int:
        started = sum(1 for a in taken if a.kind is ActionKind.START)
        return len(obs.workers) + len(obs.starting) + started

    def _reshape(
        self, obs: Observation, taken: Sequence[Action], prefill: float, decode: float, inputs: dict[str, float]
    ) -> Action | None:
        hold = self.config.hold_rounds
        need = [r for r, s in (("prefill", prefill), ("decode", decode)) if self._streaks[r] >= hold]
        if need:
            role = max(need, key=lambda r: prefill if r == "prefill" else decode)
            return self._grow(obs, taken, role, prefill, decode, inputs)
        if self._streaks["down"] >= hold:
            return self._shrink(obs, prefill, decode, inputs)
        return None

    def _grow(
        self, obs: Observation, taken: Sequence[Action], need: str, prefill: float, decode: float, inputs: dict[str, float]
    ) -> Action | None:
        assert self._planned is not None
        c = self.config
        if self._disaggregated():
            to, frm = (Role.PREFILL, Role.DECODE) if need == "prefill" else (Role.DECODE, Role.PREFILL)
            # slack now, and not pressed once it has one worker less (else the next rounds move it back)
            left = self._planned[frm]
            donor_pressure = decode if need == "prefill" else prefill
            slack = donor_pressure < c.low and donor_pressure * left / max(left - 1, 1) < c.high
            floor = c.min_decode if frm is Role.DECODE else c.min_prefill
            donor = _least_loaded(obs, frm)
            if slack and donor is not None and self._planned[frm] > floor:
                self._planned[frm] -= 1
                self._planned[to] += 1
                return Action(ActionKind.MOVE, to, f"{need} pressed, {frm.value} slack", donor.worker_id, inputs)
        else:
            to = Role.AGGREGATED
        planned = self._serving_planned() + self._spares_and_starting(obs, taken)
        if max(planned, self._fleet_size(obs, taken)) >= c.max_workers:
            return None  # at the ceiling: degradation and shedding carry it
        self._planned[to] += 1
        return Action(ActionKind.START, to, f"{need} pressed", None, inputs)

    def _shrink(self, obs: Observation, prefill: float, decode: float, inputs: dict[str, float]) -> Action | None:
        assert self._planned is not None
        c = self.config
        if self._serving_planned() <= c.min_workers:
            return None
        if self._disaggregated():
            role = Role.PREFILL if prefill <= decode else Role.DECODE
            floor = c.min_prefill if role is Role.PREFILL else c.min_decode
            if self._planned[role] <= floor:
                return None
        else:
            role = Role.AGGREGATED
        victim = _least_loaded(obs, role)
        if victim is None:
            return None
        self._planned[role] -= 1
        return Action(ActionKind.STOP, role, "prefill and decode slack", victim.worker_id, inputs)

    def _serving_planned(self) -> int:
        return sum((self._planned or {}).values())

    def _spares_and_starting(self, obs: Observation, taken: Sequence[Action]) -> int:
        spares = sum(1 for w in obs.workers if w.role is Role.SPARE) + obs.starting.count(Role.SPARE)
        return spares + sum(1 for a in taken if a.kind is ActionKind.START and a.role is Role.SPARE)


    # --------------------------------------------------------------------- forecast-driven

    def _plan_to_targets(
        self, obs: Observation, actions: list[Action], replacing: bool, prefill: float, decode: float,
        inputs: dict[str, float],
    ) -> Plan:
        c = self.config
        assert c.profile is not None and self._planned is not None
        self.forecaster.observe(obs.arrived, obs.interval_s, obs.arrived_input_tokens, obs.arrived_output_tokens)
        forecast = self.forecaster.predict(c.forecast_rounds)
        targets = self._targets(obs, actions, forecast, prefill, decode)
        inputs = {**inputs, "forecast_rps": forecast.rate_rps, "forecast_input_tokens": forecast.input_tokens,
                  "forecast_output_tokens": forecast.output_tokens, **{f"target_{r.value}": float(n) for r, n in targets.items()}}  # fmt: skip
        if not replacing and self.forecaster.rounds > 0:
            actions += self._toward(obs, actions, targets, prefill, decode, inputs)
        return Plan(tuple(actions), prefill, decode, forecast, targets)

    def _targets(
        self, obs: Observation, taken: Sequence[Action], forecast: LoadForecast, prefill: float, decode: float
    ) -> dict[Role, int]:
        """Workers per serving role for the forecast, corrected by held pressures, within the bounds."""
        c = self.config
        assert c.profile is not None and self._planned is not None
        cap = size_fleet(c.profile, forecast, c.headroom).capacity
        room = c.max_workers - self._spares_and_starting(obs, taken)
        # a pressure held at high asks for one worker more, unless one is already on its way
        # to that role (it serves only after its start: asking again each round overshoots)
        coming = set(obs.starting)
        if not self._disaggregated():
            pressed = self._streaks["prefill"] >= c.hold_rounds or self._streaks["decode"] >= c.hold_rounds
            pressed = pressed and Role.AGGREGATED not in coming
            want = self._corrected(Role.AGGREGATED, forecast.rate_rps / (cap.aggregated_rps * c.headroom), pressed)
            return {Role.AGGREGATED: min(max(want, c.min_workers), max(room, 1))}
        held_p, held_d = (self._streaks[r] >= c.hold_rounds for r in ("prefill", "decode"))
        pressed_p, pressed_d = held_p and Role.PREFILL not in coming, held_d and Role.DECODE not in coming
        p = self._corrected(Role.PREFILL, forecast.rate_rps / (cap.prefill_rps * c.headroom), pressed_p)
        d = self._corrected(Role.DECODE, forecast.rate_rps / (cap.decode_rps * c.headroom), pressed_d)
        p, d = max(p, c.min_prefill), max(d, c.min_decode)
        room = max(room, c.min_prefill + c.min_decode)
        if p + d > room:
            p, d = self._share(room, held_p or held_d, pressed_p, pressed_d)
        while p + d < c.min_workers:
            if prefill > decode:
                p += 1
            else:
                d += 1
        return {Role.PREFILL: p, Role.DECODE: d}

    def _share(self, room: int, held: bool, pressed_p: bool, pressed_d: bool) -> tuple[int, int]:
        """More wanted than the fleet may hold: the split whose busier role is the least
        over its need (each role's need over its workers: the bottleneck decides what the
        fleet carries, so 3.7 prefill + 2.1 decode needed on 4 workers is 2 + 2, not the
        proportional 3 + 1), the present split unless another is ``_SPLIT_GAIN`` better (a
        move costs its drain). What is measured comes first: a role whose pressure has held
        at high gets a worker more than it has, whatever the forecast says of the other
        (both pressed, or the pressed role's worker still on its way: the split stays)."""
        c = self.config
        assert self._planned is not None
        have_p = min(max(self._planned[Role.PREFILL], c.min_prefill), room - c.min_decode)
        if held:
            share = have_p + (pressed_p and not pressed_d) - (pressed_d and not pressed_p)
        else:
            need_p, need_d = self._needs[Role.PREFILL], self._needs[Role.DECODE]

            def load(n: int) -> float:  # the busier role's need over its workers with n prefill workers
                return max(need_p / n, need_d / (room - n))

            best = min(range(c.min_prefill, room - c.min_decode + 1), key=lambda n: (load(n), abs(n - have_p)))
            share = best if load(best) * _SPLIT_GAIN < load(have_p) else have_p
        p = min(max(share, c.min_prefill), room - c.min_decode)
        return p, room - p

    def _corrected(self, role: Role, need: float, pressed: bool) -> int:
        """Workers for a fractional ``need``, times what has been seen to be missing: a
        pressure held at high while the role had its planned workers makes the role's
        correction at least (planned + 1) ÷ need, so the next forecast of the same load
        does not take that worker away again (no start/stop flapping); it relaxes a
        little each round."""
        assert self._planned is not None
        self._correction[role] = 1.0 + (self._correction[role] - 1.0) * (1.0 - _RELAX)
        if pressed and need > 0:
            self._correction[role] = min(_MAX_CORRECTION, max(self._correction[role], (self._planned[role] + 1) / need))
        self._needs[role] = need * self._correction[role]
        want = max(1, math.ceil(self._needs[role] - 1e-9))
        return max(want, self._planned[role] + 1) if pressed else want

    def _toward(
        self, obs: Observation, taken: Sequence[Action], targets: dict[Role, int], prefill: float, decode: float,
        inputs: dict[str, float],
    ) -> list[Action]:
        assert self._planned is not None
        c, planned = self.config, self._planned
        self._track_move(obs)
        short = [r for r, n in targets.items() if planned[r] < n]
        # what is measured vetoes: a donor is slack now (a stop also waits for the target,
        # slack donor included, to hold) and stays below high with one worker less by what
        # scales with its workers
        over = [r for r, n in targets.items() if planned[r] > n and self._slack(r) and self._keeps_up_without_one(obs, r)]
        actions: list[Action] = []
        for role in short:  # at once: a start takes time, the forecast has said it is needed
            while planned[role] < targets[role] and self._fleet_size(obs, [*taken, *actions]) < c.max_workers:
                planned[role] += 1
                actions.append(Action(ActionKind.START, role, f"forecast needs {targets[role]} {role.value}", None, inputs))
        if actions:
            self._last_reshape_s = obs.now_s
        still_short = [r for r in short if planned[r] < targets[r]]
        if actions or still_short or not over:
            self._target_streak = 0
        if still_short and not actions:
            # no room to start: a move. It outlasts the forecast's horizon, so only a role
            # whose own SLO measure has held at high is fed (a forecast alone moved workers
            # back and forth on the whole conversation trace)
            starving = [r for r in still_short if self._starving(r)]
            move = self._move(obs, over, starving[0], targets, inputs) if starving and over else None
            return [move] if move is not None else []
        if actions or not over:
            return actions
        self._target_streak += 1  # rounds the fleet has been above its target with a slack donor
        if self._target_streak < c.hold_rounds:
            return actions
        stop = self._stop(obs, over, targets, inputs)
        return [stop] if stop is not None else []

    def _move(
        self, obs: Observation, over: Sequence[Role], to: Role, targets: dict[Role, int], inputs: dict[str, float]
    ) -> Action | None:
        """A worker of an over-provisioned role to ``to``: after the cool-down, one move at
        a time (until its worker has left the old role)."""
        assert self._planned is not None
        if obs.now_s - self._last_reshape_s < self.config.cooldown_s or self._moving is not None:
            return None
        planned = self._planned
        frm = max(over, key=lambda r: planned[r] - targets[r], default=None)
        donor = _least_loaded(obs, frm) if frm is not None else None
        if frm is None or donor is None:
            return None
        self._planned[frm] -= 1
        self._planned[to] += 1
        self._last_reshape_s = obs.now_s
        self._moving = (donor.worker_id, frm, obs.now_s)
        why = f"{to.value} pressed, forecast needs {targets[to]} {to.value}, {targets[frm]} {frm.value}"
        return Action(ActionKind.MOVE, to, why, donor.worker_id, {**inputs, "last_move_s": self._move_cost_s})

    def _starving(self, role: Role) -> bool:
        """The role's own SLO measure has held at high (prefill: its TTFT)."""
        return self._streaks["ttft" if role is Role.PREFILL else "decode"] >= self.config.hold_rounds

    def _slack(self, role: Role) -> bool:
        return self._streaks[{Role.PREFILL: "prefill_slack", Role.DECODE: "decode_slack"}.get(role, "down")] > 0

    def _stop(self, obs: Observation, over: Sequence[Role], targets: dict[Role, int], inputs: dict[str, float]) -> Action | None:
        """Stop a worker of the role most above its target (the caller has held that for
        ``hold_rounds``; no cool-down: a falling load sheds a worker every ``hold_rounds``):
        not while a worker of the role is on its way (it would swap a serving worker for
        one that serves later), and only when one worker less still leaves the role
        ``_STOP_BAND`` above its need (no flapping on the forecast's noise)."""
        assert self._planned is not None
        planned = self._planned
        frm = max(over, key=lambda r: planned[r] - targets[r], default=None)
        donor = _least_loaded(obs, frm) if frm is not None else None
        if frm is None or donor is None or frm in obs.starting or self._needs[frm] * _STOP_BAND > planned[frm] - 1:
            return None
        self._planned[frm] -= 1
        self._last_reshape_s = obs.now_s
        self._target_streak = 0
        return Action(ActionKind.STOP, frm, f"forecast needs {targets[frm]} {frm.value}", donor.worker_id, inputs)

    def _track_move(self, obs: Observation) -> None:
        """A move is done when its worker no longer serves in its old role (re-registered
        in the new one, or drained and gone): how long that took is the next moves' cost.
        One still routable in its old role with nothing starting was not carried out."""
        if self._moving is None:
            return
        worker_id, old, since = self._moving
        view = next((w for w in obs.workers if w.worker_id == worker_id and w.role is old), None)
        if view is None:
            self._move_cost_s = obs.now_s - since
            self._moving = None
        elif view.routable and not obs.starting:  # the fleet did not carry it out: nothing measured
            self._moving = None

    def _keeps_up_without_one(self, obs: Observation, role: Role) -> bool:
        """Whether ``role`` stays below ``high`` with one worker less by what scales with its
        workers (KV use for decode and aggregated workers, the queue for prefill): the
        measured veto on a forecast that would starve a role (a lone decode worker's full KV)."""
        views = [w for w in obs.workers if w.role is role and w.routable]
        if len(views) < 2:
            return True  # the floors and min_workers keep the last ones
        if role is Role.PREFILL:
            used = obs.prefill_queue_tokens / (self.config.queue_tokens_per_prefill * len(views))
        else:
            used = sum(w.kv_usage for w in views) / len(views)
        return used * len(views) / (len(views) - 1) < self.config.high


_RELAX = 0.01  # of the correction's excess over 1, per round
_STOP_BAND = 1.05  # a stop leaves the role at least 5 % above its need (no flapping on the forecast's noise)
_MAX_CORRECTION = 4.0
_SPLIT_GAIN = 1.1  # at the ceiling, another split must cut the bottleneck's load by 10 % to be worth a move


def _pressure(role: Role, prefill: float, decode: float) -> float:
    return prefill if role is Role.PREFILL else decode if role is Role.DECODE else max(prefill, decode)


def _least_loaded(obs: Observation, role: Role) -> WorkerView | None:
    candidates = [w for w in obs.workers if w.role is role and w.routable]
    return min(candidates, key=lambda w: (w.load, w.worker_id), default=None)
