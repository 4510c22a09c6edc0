"""A day of a large fleet on the virtual clock, decided by kvmesh's live policy objects.

What is simulated how (so that 24 hours of 10,000 groups take seconds, not days):

* **Traffic is a fluid, faults are individual.** Arrivals are Poisson counts per slice
  (``slice_s``, 1 s) on a daily load curve; the healthy fleet serves them from one
  backlog at the capacity the mocker's timing model gives a group (prefill and decode
  polynomials at the configured batch). A request that a fault touches is simulated on
  its own: the ones in flight on a group when it fails (Poisson around Little's law),
  and those the router sends to a hung, partitioned or corrupt group before health
  checks take it out (its share of the slices' arrivals).
* **Workers are idle-skipped.** A healthy group's canary passes change nothing in its
  health state (a pass while HEALTHY is no transition), so canary rounds visit only the
  groups that have a fault or are not HEALTHY; the planner runs at once on a change of
  routability (as the live one does on a loss) and otherwise every ``planner_interval_s``
  only when something changed since its last round (an unchanged fleet gives it nothing
  to do: its fleet size is pinned, its spares are kept).
* **Every decision is a live object's.** Health: one
  :class:`~kvmesh.health.state.HealthTracker` per group (state machine, breaker,
  latency judged in a :class:`~kvmesh.health.state.LatencyContext`), fed the canary
  outcomes the monitor would record (each retry one result). Migration:
  :func:`~kvmesh.health.migration.next_step` and
  :class:`~kvmesh.health.migration.MigrationBudget` per touched request, the method from
  :func:`~kvmesh.health.migration.estimate_migration` (KV transfer only from a group
  that still answers, as today: on a drain). Targets: the router's
  :func:`~kvmesh.router.cost.score_all` + :func:`~kvmesh.router.cost.select` over a
  sample of groups with their health weights. Degradation:
  :class:`~kvmesh.health.degradation.DegradationController` on the live capacity
  model's ratio, and :func:`~kvmesh.health.degradation.admit` per priority tier.
  Replacement and spares: :class:`~kvmesh.planner.core.Planner`. They come in through
  :class:`Policies`, so a test can break one and see the day change.

Pure: no I/O, no asyncio; the same config and seed give the same report.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.errors import Disconnected, EngineShutdown, KvmeshError, ResponseTimeout
from kvmesh.health.degradation import CapacityConfig, Decision, DegradationController, DegradationLevel, Priority, admit
from kvmesh.health.migration import MigrationBudget, MigrationCost, estimate_migration, next_step
from kvmesh.health.state import CheckKind, CheckResult, HealthConfig, HealthStatus, HealthTracker, LatencyContext
from kvmesh.planner.core import Action, ActionKind, Observation, Planner, PlannerConfig, Role, WorkerView
from kvmesh.protocol import LoadReport
from kvmesh.router.cost import CostInputs, score_all, select
from kvmesh.simulate.faults import Fault, FaultKind, FaultRates, draw_schedule

__all__ = ["SimConfig", "Policies", "WorkerTiming", "FleetSim", "Outcome"]

TIERS = (Priority.PREMIUM, Priority.STANDARD, Priority.BEST_EFFORT)
VIEW_REFRESH_S = 600.0  # how often the planner's views of the groups take the fleet's load


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int = 10_000  # serving groups at the start
    tp: int = 8  # GPUs per group
    hours: float = 24.0
    seed: int = 0
    failure_scale: float = 1.0
    rates: FaultRates = field(default_factory=FaultRates)
    peak_utilisation: float = 0.6  # peak demand over the fleet's capacity
    trough_ratio: float = 10.0  # peak over trough of the daily curve
    peak_hour: float = 14.0
    prompt_tokens: int = 2048
    output_tokens: int = 256
    premium_share: float = 0.1
    best_effort_share: float = 0.2
    hot_spares: int | None = None  # None: 0.5 % of the fleet, at least 2
    promote_s: float = 10.0
    cold_start_s: float = 600.0
    canary_interval_s: float = 30.0
    canary_s: float = 0.5  # one canary on a healthy group
    canary_timeout_s: float = 10.0
    keepalive_s: float = 5.0  # a cut-off peer is found dead in ~5 s (runtime/sockets.py)
    slice_s: float = 1.0
    planner_interval_s: float = 60.0
    shed_interval_s: float = 5.0
    rack_size: int = 16
    slo_ttft_ms: float = 500.0  # the live defaults (--slo-ttft-ms, --slo-tpot-ms): the
    slo_tpot_ms: float = 30.0  # degradation's capacity model sizes the fleet from them
    max_num_seqs: int = 64
    num_blocks: int = 16_384
    block_size: int = 16
    migration_limit: int = 3
    kv_bytes_per_token: int = 40 * 1024  # per shard, the seed's 70B figure
    request_plane: str = "tcp"
    plane_wait_s: float = 15.0  # runtime/nats/client.py's PLANE_WAIT_S
    subtle_detect: float = 0.5  # chance one canary check sees a subtle (logits) corruption
    subtle_wrong_share: float = 0.02  # share of a subtly corrupt group's tokens that differ
    route_sample: int = 64  # groups the router's selection is run over for a moved request

    def __post_init__(self) -> None:
        if self.workers < 1 or self.tp < 1 or self.hours <= 0 or self.slice_s <= 0:
            raise ValueError("workers and tp must be >= 1, hours and slice_s > 0")
        if not 0 < self.peak_utilisation or self.trough_ratio < 1:
            raise ValueError("peak_utilisation must be > 0 and trough_ratio >= 1")
        if self.request_plane not in ("tcp", "nats"):
            raise ValueError(f"request_plane must be tcp or nats, got {self.request_plane!r}")

    @property
    def spares(self) -> int:
        return self.hot_spares if self.hot_spares is not None else max(2, math.ceil(0.005 * self.workers))


@dataclass(slots=True)
class Policies:
    """The live policy objects the simulated fleet decides with (tests swap one out)."""

    health: HealthConfig
    next_step: Callable[..., str] = next_step
    estimate_migration: Callable[..., MigrationCost] = estimate_migration
    degradation: Callable[[CapacityConfig], DegradationController] = DegradationController
    admit: Callable[..., Decision] = admit
    planner: Callable[[PlannerConfig], Planner] = Planner

    @classmethod
    def live(cls, config: SimConfig) -> Policies:
        return cls(HealthConfig(check_interval_s=config.canary_interval_s))


@dataclass(frozen=True, slots=True)
class WorkerTiming:
    """One group's speed from the mocker's timing model (engines/mocker/options.py)."""

    prefill_ms: float
    step_ms: float
    rps: float  # requests per second at a full batch
    prefill_coeffs: tuple[float, float, float]

    @classmethod
    def of(cls, config: SimConfig) -> WorkerTiming:
        from kvmesh.engines.mocker.options import MockerOptions

        opts = MockerOptions(num_blocks=config.num_blocks, max_num_seqs=config.max_num_seqs)
        a, b, c = opts.prefill_coeffs
        n = config.prompt_tokens
        prefill = a * n * n + b * n + c
        seq_tokens = config.prompt_tokens + config.output_tokens / 2
        p = min(1.0, config.max_num_seqs * seq_tokens / (config.num_blocks * config.block_size))
        da, db, dc = opts.decode_coeffs
        step = da * p * p + db * p + dc
        per_request_ms = prefill + config.output_tokens * step / config.max_num_seqs
        return cls(prefill, step, 1000.0 / per_request_ms, opts.prefill_coeffs)

    def prefill_ms_fn(self, tokens: int) -> float:
        a, b, c = self.prefill_coeffs
        return a * tokens * tokens + b * tokens + c


@dataclass(slots=True)
class Outcome:
    """Everything the report is made of."""

    arrived: int = 0
    served: int = 0
    admitted: float = 0.0
    shed: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # by tier: 429/503 at admission
    lost: Counter[str] = field(default_factory=Counter)  # by cause: accepted, never completed
    slo_met: list[float] = field(default_factory=list)  # per hour
    slo_total: list[float] = field(default_factory=list)
    corrupted_tokens: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    corruption_bound_tokens: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    detect_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    recover_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    migrations: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    undetected: Counter[str] = field(default_factory=Counter)
    capacity_lost: list[float] = field(default_factory=list)  # per hour, share of groups out
    planner_actions: Counter[str] = field(default_factory=Counter)
    level_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    events: int = 0


_Payload = Fault | int | Role | tuple[int, Role]  # what a queued event is about


@dataclass(slots=True)
class _Group:
    gid: int
    tracker: HealthTracker
    role: Role = Role.AGGREGATED
    fault: Fault | None = None
    since: float = 0.0  # fault onset
    stuck: float = 0.0  # requests routed to it while it cannot serve them
    retired: bool = False
    unreachable: bool = False


class FleetSim:
    def __init__(self, config: SimConfig, policies: Policies | None = None) -> None:
        self.c = config
        self.p = policies or Policies.live(config)
        self.rng = random.Random(config.seed)
        self.timing = WorkerTiming.of(config)
        self.out = Outcome()
        self.groups: list[_Group] = []
        self.weight_sum = 0.0  # Σ routing weights of serving groups
        self.good_cap = 0.0  # Σ rps of serving groups that really serve
        self.watch: set[int] = set()  # groups with a fault or not HEALTHY
        self.spares: list[int] = []
        self.starting: list[Role] = []
        self.heap: list[tuple[float, int, str, _Payload]] = []
        self._seq = 0
        self._dirty = False
        self._etcd_down_until = 0.0
        self._nats_down_until = 0.0
        self.backlog = 0.0
        self.level = DegradationLevel.NONE
        self._now = 0.0
        self._rate = 0.0
        self._losses: deque[tuple[str, float]] = deque()  # capacity lost, waiting for a replacement
        self._view_of: list[WorkerView | None] = []  # what the planner sees of each group
        self._util = 0.0  # the load its views show (refreshed every VIEW_REFRESH_S)
        cap_cfg = CapacityConfig(
            slo_ttft_ms=config.slo_ttft_ms, slo_tpot_ms=config.slo_tpot_ms, max_batch_size=config.max_num_seqs,
            avg_seq_len=config.prompt_tokens + config.output_tokens, avg_output_tokens=config.output_tokens,
            block_size=config.block_size,
        )  # fmt: skip
        self.degradation = self.p.degradation(cap_cfg)
        self._report = LoadReport(0, 0, config.num_blocks, 0, 0)
        spares = config.spares
        self.planner = self.p.planner(PlannerConfig(
            min_workers=config.workers, max_workers=config.workers + spares, hot_spares=spares,
            cooldown_s=config.planner_interval_s,
        ))  # fmt: skip
        for _ in range(config.workers):
            self._add_group(Role.AGGREGATED)
        for _ in range(spares):
            self.spares.append(self._add_group(Role.SPARE).gid)
        self.peak_rps = config.peak_utilisation * config.workers * self.timing.rps

    # ----------------------------------------------------------------- the fleet
    def _add_group(self, role: Role) -> _Group:
        g = _Group(len(self.groups), HealthTracker(len(self.groups), self.p.health), role)
        self.groups.append(g)
        self._view_of.append(None)
        if role is not Role.SPARE:
            self._count(g, +1)
        self._refresh_view(g)
        return g

    def _refresh_view(self, g: _Group) -> None:
        if g.retired:
            view = None
        elif g.role is Role.SPARE:
            view = WorkerView(g.gid, Role.SPARE, True)
        else:
            running = int(self._util * self.c.max_num_seqs)
            view = WorkerView(g.gid, g.role, g.tracker.weight > 0, self._util, running, 0, self.c.max_num_seqs)
        self._view_of[g.gid] = view

    def _serves(self, g: _Group) -> bool:
        f = g.fault
        return not g.unreachable and (f is None or f.kind not in (FaultKind.HANG, FaultKind.CRASH))

    def _speed(self, g: _Group) -> float:
        f = g.fault
        return 1.0 / self.c.rates.slow_factor if f is not None and f.kind is FaultKind.SLOW else 1.0

    def _count(self, g: _Group, sign: int) -> None:
        """Add (+1) or take out (-1) a serving group's routing weight and capacity."""
        if g.role is Role.SPARE or g.retired:
            return
        w = g.tracker.weight
        self.weight_sum += sign * w
        if w > 0 and self._serves(g):
            self.good_cap += sign * w * self._speed(g) * self.timing.rps

    def _change(self, g: _Group, fn: Callable[[], object]) -> object:
        """Run ``fn`` (it may change ``g``'s health or fault) with the sums kept right."""
        before = g.tracker.weight
        self._count(g, -1)
        result = fn()
        self._count(g, +1)
        after = g.tracker.weight
        if before > 0 and after == 0:
            self._ejected(g)
        if (before > 0) != (after > 0):
            self._dirty = True
        if g.fault is not None or g.tracker.status is not HealthStatus.HEALTHY:
            self.watch.add(g.gid)
        else:
            self.watch.discard(g.gid)
        if (before > 0) != (after > 0):
            self._refresh_view(g)
        return result

    def _push(self, at: float, kind: str, payload: _Payload) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (at, self._seq, kind, payload))

    # ----------------------------------------------------------------- traffic
    def demand_rps(self, t: float) -> float:
        """The daily curve: a cosine from trough to peak (``peak_hour``)."""
        c = self.c
        trough = self.peak_rps / c.trough_ratio
        phase = math.cos(2 * math.pi * (t / 3600.0 - c.peak_hour) / 24.0)
        return trough + (self.peak_rps - trough) * (1 + phase) / 2

    def _in_flight(self) -> float:
        """Requests in flight on one serving group (Little's law at the current rate)."""
        t = self.timing
        per_request_s = (t.prefill_ms + self.c.output_tokens * t.step_ms) / 1000.0
        per_group = self._rate / max(self.weight_sum, 1.0)
        return per_group * per_request_s

    # ----------------------------------------------------------------- moving requests
    def _route(self) -> _Group | None:
        """The router's choice among a sample of serving groups (health weights, equal loads)."""
        pool = [g for g in self.rng.sample(self.groups, min(len(self.groups), self.c.route_sample))
                if g.role is not Role.SPARE and not g.retired]  # fmt: skip
        if not pool:
            return None
        by_id = {g.gid: g for g in pool}
        weights = {g.gid: g.tracker.weight for g in pool}
        inputs = CostInputs({}, self.c.prompt_tokens, {}, {}, self.c.block_size, 1.0)
        pick = select(score_all(by_id, inputs, weights), 0.0, self.rng)
        return by_id[pick.worker_id]

    def _move(self, cause: str, failure: KvmeshError, *, waited_s: float = 0.0) -> None:
        """One request whose group failed: the live migration steps until it finishes or fails.
        Its KV is never copied: these groups crashed, hung, were cut off or were ejected with
        their connection closed (no link given: the live cost model re-prefills)."""
        c = self.c
        delivered = self.rng.randrange(c.output_tokens)
        budget = MigrationBudget(c.migration_limit)
        attempts = 1
        while True:
            step = self.p.next_step(failure, stopped=False, delivered=delivered, max_tokens=c.output_tokens,
                                    attempts=attempts, migrations_left=budget.remaining)  # fmt: skip
            if step == "fail":
                self.out.lost[cause] += 1
                return
            if step == "finish":
                self.out.migrations["finish"] += 1
                self._slo(1, waited_s <= c.slo_ttft_ms / 1000)
                return
            if step == "migrate":
                budget.try_spend()
                cost = self.p.estimate_migration(c.prompt_tokens, delivered, c.kv_bytes_per_token, None,
                                                 self.timing.prefill_ms_fn)  # fmt: skip
                self.out.migrations[cost.method] += 1
            else:
                self.out.migrations["retry"] += 1
            target = self._route()
            if target is None:
                self.out.lost[cause] += 1
                return
            if self._serves(target):
                self._slo(1, waited_s <= c.slo_ttft_ms / 1000)
                return
            # landed on another group that cannot serve it (not yet found out): fails again
            attempts += 1
            self.out.migrations["landed_on_faulty"] += 1
            failure = Disconnected("worker failed")
            waited_s += c.canary_interval_s

    def _slo(self, n: float, met: bool) -> None:
        hour = min(int(self._now // 3600), len(self.out.slo_total) - 1)
        self.out.slo_total[hour] += n
        if met:
            self.out.slo_met[hour] += n

    def _ejected(self, g: _Group) -> None:
        """Taken out of routing: the monitor closes its connection and the streams it
        still holds move (a crashed or cut-off group's streams failed already)."""
        now = self._now
        f = g.fault
        kind = "partition" if g.unreachable else f.kind.value if f is not None else "none"
        self.out.detect_s[kind].append(now - g.since)
        self._losses.append((kind, g.since))
        answers = self._serves(g)
        n = int(round(g.stuck))
        g.stuck = 0.0
        if f is not None and f.kind is not FaultKind.CRASH and not g.unreachable:
            n += self._poisson(self._in_flight())  # hung, corrupt, slow: it holds its streams
        failure: KvmeshError = Disconnected("evicted") if answers else ResponseTimeout("no answer")
        for _ in range(n):
            self._move(kind, failure, waited_s=0.0 if answers else now - g.since)
        if f is not None and f.kind is not FaultKind.SLOW:
            self._push(now, "replaced", g.gid)  # broken for good: the operator takes it away

    def _poisson(self, mean: float) -> int:
        if mean <= 0:
            return 0
        if mean > 50:
            return max(0, int(round(self.rng.gauss(mean, math.sqrt(mean)))))
        limit, k, prod = math.exp(-mean), 0, self.rng.random()
        while prod > limit:
            k += 1
            prod *= self.rng.random()
        return k

    # ----------------------------------------------------------------- faults
    def _onset(self, f: Fault) -> None:
        self.out.faults[f.kind.value] += 1
        now = self._now
        if f.kind is FaultKind.ETCD_OUTAGE:
            self._etcd_down_until = max(self._etcd_down_until, now + f.duration_s)
            return
        if f.kind is FaultKind.NATS_RESTART:
            self._nats_down_until = max(self._nats_down_until, now + f.duration_s)
            return
        if f.kind is FaultKind.PARTITION:
            for gid in range(f.worker, min(f.worker + self.c.rack_size, len(self.groups))):
                self._partition(self.groups[gid], f)
            return
        g = self._target(f.worker)
        if g is None:
            return
        g.since = now

        def strike() -> None:
            g.fault = f
            if f.kind is FaultKind.CRASH:
                g.tracker.record_process_death(now)

        if f.kind is FaultKind.CRASH:  # its streams fail at once (the process is gone)
            for _ in range(self._poisson(self._in_flight())):
                self._move("crash", EngineShutdown("engine died"))
        self._change(g, strike)
        if f.kind is FaultKind.SLOW:
            self._push(now + f.duration_s, "slow_end", g.gid)

    def _target(self, drawn: int) -> _Group | None:
        """The serving group a GPU fault lands on: the drawn one, or (when that one was
        replaced, is a spare or is already faulty) another drawn uniformly; the same
        rate keeps hitting the fleet however many groups it has replaced."""
        g = self.groups[drawn]
        for _ in range(64):
            if not g.retired and g.fault is None and g.role is not Role.SPARE and not g.unreachable:
                return g
            g = self.groups[self.rng.randrange(len(self.groups))]
        return None

    def _partition(self, g: _Group, f: Fault) -> None:
        if g.retired or g.role is Role.SPARE or g.unreachable:
            return
        now = self._now
        g.unreachable = True
        g.since = now
        self._change(g, lambda: None)
        # its streams are found cut after the keep-alive: they move, and the worker is blamed
        n = self._poisson(self._in_flight())
        for _ in range(n):
            self._move("partition", Disconnected("peer cut off"), waited_s=self.c.keepalive_s)
        self._change(g, lambda: g.tracker.record_stream_error(Disconnected("peer cut off"), now))
        self._push(now + f.duration_s, "heal", g.gid)

    # ----------------------------------------------------------------- canaries
    def _canary_round(self) -> None:
        now = self._now
        for gid in sorted(self.watch):
            g = self.groups[gid]
            if g.retired or g.role is Role.SPARE:
                self.watch.discard(gid)
                continue
            if g.tracker.status in (HealthStatus.DRAINING, HealthStatus.DEAD):
                self._retire(g)
                continue
            if not g.tracker.begin_check(now):
                continue
            self._check(g, now)

    def _outcome(self, g: _Group) -> tuple[CheckResult, LatencyContext | None]:
        c, f = self.c, g.fault
        if g.unreachable or (f is not None and f.kind is FaultKind.HANG):
            return CheckResult(CheckKind.TIMEOUT, c.canary_timeout_s, "no answer"), None
        if f is not None and f.kind is FaultKind.SDC_TOKENS:
            return CheckResult(CheckKind.WRONG_TOKENS, c.canary_s), None
        if f is not None and f.kind is FaultKind.SDC_LOGITS and self.rng.random() < c.subtle_detect:
            return CheckResult(CheckKind.LOGIT_OUT_OF_RANGE, c.canary_s), None
        judged = c.canary_s * (c.rates.slow_factor if f is not None and f.kind is FaultKind.SLOW else 1.0)
        context = LatencyContext(expected_s=c.canary_s, may_eject=self._may_eject_for_latency())
        return CheckResult(CheckKind.OK, judged, compute_s=judged), context

    def _may_eject_for_latency(self) -> bool:
        out = sum(1 for gid in self.watch if self.groups[gid].tracker.out_for_latency)
        return out < self.p.health.latency_ejection_budget(self.c.workers)

    def _check(self, g: _Group, now: float) -> None:
        """One canary check as the monitor runs it: a failed attempt retried, each counted."""
        for attempt in range(self.p.health.canary_max_retries + 1):
            result, context = self._outcome(g)
            t = now + (attempt + 1) * result.latency_s
            self._now_at(t, lambda: self._change(g, lambda: g.tracker.record_check(result, t, context)))
            if result.ok:
                return

    def _now_at(self, t: float, fn: Callable[[], object]) -> None:
        saved, self._now = self._now, t
        try:
            fn()
        finally:
            self._now = saved

    def _retire(self, g: _Group) -> None:
        self._count(g, -1)
        g.retired = True
        self.watch.discard(g.gid)
        self._refresh_view(g)
        self._dirty = True

    # ----------------------------------------------------------------- planner
    def _views(self) -> tuple[WorkerView, ...]:
        return tuple(v for v in self._view_of if v is not None)

    def _refresh_load(self) -> None:
        """The load every view shows: the fleet's utilisation now (all groups alike)."""
        self._util = min(1.0, self._rate / max(self.good_cap, 1e-9))
        for g in self.groups:
            self._refresh_view(g)

    def _plan(self) -> None:
        self._dirty = False
        obs = Observation(self._now, self._views(), tuple(self.starting), degradation_level=int(self.level),
                          request_rate_rps=self._rate)  # fmt: skip
        for action in self.planner.plan(obs).actions:
            self.out.planner_actions[action.kind.value] += 1
            self._act(action)

    def _act(self, a: Action) -> None:
        ready = max(self._now, self._etcd_down_until)  # orders and registrations go through discovery
        if a.kind is ActionKind.PROMOTE:
            gid = self.spares.pop(0) if self.spares else None
            if gid is None:
                return
            self.groups[gid].retired = True  # leaves the spare pool now, serves once promoted
            self._refresh_view(self.groups[gid])
            self.starting.append(a.role)
            self._push(ready + self.c.promote_s, "promoted", (gid, a.role))
        elif a.kind is ActionKind.START:
            self.starting.append(a.role)
            self._push(ready + self.c.cold_start_s, "started", a.role)

    def _arrive(self, payload: _Payload) -> None:
        """A promoted spare (``(gid, role)``) or a started group (its role) is ready."""
        if self._losses and payload is not Role.SPARE:
            cause, since = self._losses.popleft()
            self.out.recover_s[cause].append(self._now - since)
        if isinstance(payload, tuple):
            gid, role = payload
            g = self.groups[gid]
            self.starting.remove(role)
            g.retired, g.role = False, role
            self._count(g, +1)
            self._refresh_view(g)
        elif isinstance(payload, Role):
            self.starting.remove(payload)
            g = self._add_group(payload)
            if g.role is Role.SPARE:
                self.spares.append(g.gid)
        self._dirty = True

    # ----------------------------------------------------------------- the day
    def run(self) -> Outcome:
        c = self.c
        hours = math.ceil(c.hours)
        self.out.slo_met = [0.0] * hours
        self.out.slo_total = [0.0] * hours
        self.out.capacity_lost = [0.0] * hours
        self._now, self._rate = 0.0, self.demand_rps(0.0)
        for f in draw_schedule(self.rng, c.rates, workers=c.workers, tp=c.tp, hours=c.hours,
                               scale=c.failure_scale, rack_size=c.rack_size):  # fmt: skip
            self._push(f.at_s, "fault", f)
        arrivals_rng = random.Random(c.seed + 1)
        horizon = c.hours * 3600.0
        next_canary = c.canary_interval_s
        next_plan = c.planner_interval_s
        next_shed = 0.0
        next_views = 0.0
        steps = int(horizon / c.slice_s)
        for i in range(steps):
            t = i * c.slice_s
            self._events_until(t)
            if t >= next_canary:
                self._now = next_canary
                self._canary_round()
                next_canary += c.canary_interval_s
            if self._dirty and t >= next_plan:
                self._now = t
                self._plan()
                next_plan = t + c.planner_interval_s
            self._now = t
            self._rate = self.demand_rps(t)
            if t >= next_shed:
                self._shed(t)
                next_shed = t + c.shed_interval_s
            if t >= next_views:
                self._refresh_load()
                next_views = t + VIEW_REFRESH_S
            self._slice(t, arrivals_rng)
        self._events_until(horizon)
        self._now = horizon
        self._finish()
        return self.out

    def _events_until(self, t: float) -> None:
        loss = False
        while self.heap and self.heap[0][0] <= t:
            at, _, kind, payload = heapq.heappop(self.heap)
            self._now = at
            self.out.events += 1
            if isinstance(payload, Fault):
                self._onset(payload)
            elif isinstance(payload, int):
                self._on_group(kind, self.groups[payload])
            else:
                self._arrive(payload)
            loss = loss or (self._dirty and kind in ("fault", "replaced", "heal"))
        if loss:
            self._plan()  # at once on a loss (those of one slice together), as the live service does

    def _on_group(self, kind: str, g: _Group) -> None:
        if kind == "heal":
            self._heal(g)
        elif kind == "slow_end":
            if g.fault is not None and g.fault.kind is FaultKind.SLOW and not g.retired:
                self._change(g, lambda: setattr(g, "fault", None))
        elif kind == "replaced" and not g.retired:
            self._retire(g)

    def _heal(self, g: _Group) -> None:
        if g.unreachable:
            g.unreachable = False  # routable again once a canary (a half-open trial) passes
            self._change(g, lambda: None)

    def _shed(self, t: float) -> None:
        live_capacity = self.degradation.model.worker_rps(self._report) * self.weight_sum
        change = self.degradation.update(live_capacity / max(self._rate, 1e-9), t)
        self.level = self.degradation.level if change is None else change.dst

    def _slice(self, t: float, rng: random.Random) -> None:
        c = self.c
        hour = min(int(t // 3600), len(self.out.slo_total) - 1)
        self.out.level_s[int(self.level)] += c.slice_s
        lost_share = max(0.0, 1.0 - self.good_cap / (c.workers * self.timing.rps))
        self.out.capacity_lost[hour] += lost_share * c.slice_s / 3600.0
        arrived = self._poisson_big(rng, self._rate * c.slice_s)
        self.out.arrived += arrived
        shares = (c.premium_share, 1 - c.premium_share - c.best_effort_share, c.best_effort_share)
        admitted = 0.0
        for tier, share in zip(TIERS, shares):
            n = arrived * share
            if self.p.admit(tier, self.level).allowed:
                admitted += n
            else:
                self.out.shed[tier.name.lower()] += n
        if t < self._nats_down_until and c.request_plane == "nats":
            admitted = self._plane_wait(admitted, self._nats_down_until - t)
        self.out.admitted += admitted
        self._serve(admitted)

    def _poisson_big(self, rng: random.Random, mean: float) -> int:
        return max(0, int(round(rng.gauss(mean, math.sqrt(mean))))) if mean > 50 else self._poisson(mean)

    def _plane_wait(self, n: float, wait_s: float) -> float:
        """Requests sent while the NATS plane is down wait for it (PLANE_WAIT_S per send),
        then the frontend sends them again: the live next_step decides how often."""
        attempts = 1 + int(wait_s // self.c.plane_wait_s)
        step = self.p.next_step(ResponseTimeout("plane down"), stopped=False, delivered=0,
                                max_tokens=self.c.output_tokens, attempts=attempts, migrations_left=self.c.migration_limit)  # fmt: skip
        if step == "fail":
            self.out.lost["nats_restart"] += int(round(n))
            return 0.0
        self._slo(n, wait_s <= self.c.slo_ttft_ms / 1000)
        self.backlog += n  # served once the plane is back, from the same capacity
        return 0.0

    def _serve(self, admitted: float) -> None:
        c = self.c
        if admitted <= 0:
            return
        bad_share = 0.0
        for gid in self.watch:
            g = self.groups[gid]
            w = g.tracker.weight
            if w <= 0 or g.retired:
                continue
            share = w / max(self.weight_sum, 1e-9)
            routed = admitted * share
            f = g.fault
            if not self._serves(g):
                g.stuck += routed
                bad_share += share
            elif f is not None and f.kind in (FaultKind.SDC_TOKENS, FaultKind.SDC_LOGITS):
                wrong = 1.0 if f.kind is FaultKind.SDC_TOKENS else c.subtle_wrong_share
                self.out.corrupted_tokens[f.kind.value] += routed * c.output_tokens * wrong
            elif f is not None and f.kind is FaultKind.SLOW:
                slow_tpot = self.timing.step_ms * c.rates.slow_factor
                self._slo(routed, slow_tpot <= c.slo_tpot_ms)
                bad_share += share
        good = admitted * (1 - bad_share)
        capacity = self.good_cap * c.slice_s
        queue = self.backlog + good
        served = min(queue, capacity)
        wait_s = self.backlog / max(self.good_cap, 1e-9)
        self.backlog = queue - served
        base_ttft_s = self.timing.prefill_ms / 1000
        self._slo(good, base_ttft_s + wait_s <= c.slo_ttft_ms / 1000)

    def _finish(self) -> None:
        out = self.out
        out.served = int(round(out.admitted)) - sum(out.lost.values())
        due = self.c.canary_interval_s + (self.p.health.canary_max_retries + 1) * self.c.canary_timeout_s
        for g in self.groups:
            if g.fault is not None and not g.retired and g.tracker.weight > 0:
                # a fault younger than one round and its check was not due to be found yet
                key = "not_yet_checked" if self._now - g.since <= due else g.fault.kind.value
                out.undetected[key] += 1
        # the seed's budget: a corrupt group serves until the next round finds it, so at
        # most one check interval (+ the check) of its token rate per event
        per_group_tokens_s = self.timing.rps * self.c.output_tokens * self.c.peak_utilisation
        window = self.c.canary_interval_s + (self.p.health.canary_max_retries + 1) * self.c.canary_s
        for kind in (FaultKind.SDC_TOKENS, FaultKind.SDC_LOGITS):
            n = out.faults[kind.value]
            wrong = 1.0 if kind is FaultKind.SDC_TOKENS else self.c.subtle_wrong_share
            rounds = 1.0 if kind is FaultKind.SDC_TOKENS else 1.0 / max(self.c.subtle_detect, 1e-9)
            out.corruption_bound_tokens[kind.value] = n * per_group_tokens_s * window * rounds * wrong
