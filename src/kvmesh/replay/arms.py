"""Deployment arms on the virtual clock: aggregated, disaggregated splits, the planner.

``kvmesh replay --arms aggregated,disagg:3p1d,disagg:2p2d,planner`` replays one trace
slice on ``--workers`` mocker workers deployed each way, with the mocker's timing model
and the same router (over the workers that take requests: every worker when
aggregated, the decode workers otherwise).

**Disaggregated** (``disagg:<P>p<D>d``, P + D = workers): what
:class:`~kvmesh.disagg.engine.DisaggEngine` and :class:`~kvmesh.disagg.prefill.PrefillWorker`
do, in virtual time. A request routed to a decode worker reserves its prompt's blocks
there (prefix hits reused); the rule of :func:`~kvmesh.disagg.policy.place_prefill`
(``DisaggThresholds.wants_remote`` / ``admits``) decides with the queue's depth and
tokens, and the bounded queue takes the job or refuses it
(refused, short or uncacheable: the decode worker prefills it itself). A prefill worker
takes one job at a time, FIFO:

* it reads the prefix-hit blocks from the decode worker, then computes the rest with
  :meth:`MockerOptions.remote_prefill_ms` (the same step physics as an aggregated
  worker prefilling alone: passes of ``max_num_batched_tokens``);
* it writes the new blocks back; a transfer of B bytes takes B ÷ ``kv_bandwidth``
  (``kv_bytes_per_token`` × block size per block). Pipelined (default), the write goes
  on while the next job computes (one write at a time per prefill worker);
* when the write ends, the decode worker commits the tokens and schedules the request,
  which computes its last prompt token in its next pass (as on the real clock).

**Planner** (``planner`` or ``planner:<P>p<D>d`` for its starting split, default half
and half, P + D at most ``--workers``; ``planner:aggregated`` / ``planner:<N>agg``: an
aggregated fleet starting with 1 / N workers): the same fleet, with :class:`~kvmesh.planner.core.Planner`
(pure) fed an :class:`~kvmesh.planner.core.Observation` every ``interval_s`` of virtual
time: each worker's role, KV use and queue; the prefill queue's tokens; the p90 of the
TTFTs and of the mean ITLs seen in the last ``window_s``. A MOVE takes the worker out of
routing (decode → prefill) or out of pulling (prefill → decode); it changes role once
its in-flight work is done (no hand-off: a drain at the worker's own pace, which can
only make the planner slower than the real one). Every decision is logged with its
inputs. The fleet scales between ``PlannerSettings.min_workers`` and ``--workers``: a
START provisions a worker that serves ``start_s`` later (a fresh mocker: empty cache); a
STOP takes it out of routing (or pulling), and it is released once its work is done.
``worker_seconds`` counts every worker from its start order to its release (a fixed
arm: ``--workers`` × the makespan), over the makespan (first arrival → last finish).
With a capacity profile the planner sizes from its forecast (:mod:`kvmesh.planner.core`);
each tick's fleet, observed rate and forecast go to ``ArmRun.timeline`` for the plot.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord, TokenEvent, VirtualWorker, WorkerUsage
from kvmesh.planner.core import Action, ActionKind, Observation, Planner, PlannerConfig, Role, WorkerView
from kvmesh.protocol import DisaggThresholds, KvEvent, LoadReport, PreprocessedRequest
from kvmesh.replay.policies import KvPolicy, ReplayPolicy, make_policy
from kvmesh.replay.report import percentile
from kvmesh.replay.sim import fleet_options, simulate
from kvmesh.runtime.events import CallbackPublisher

__all__ = ["Arm", "ArmRun", "DisaggModel", "PlannerSettings", "parse_arms", "run_arm"]

_SPLIT = re.compile(r"^(\d+)p(\d+)d$")
_AGG = re.compile(r"^(\d+)agg$")


@dataclass(frozen=True, slots=True)
class Arm:
    """``prefill`` / ``decode``: the split (the planner's starting one); 0/0 when aggregated
    (``aggregated``: an aggregated planner's starting workers)."""

    name: str
    prefill: int = 0
    decode: int = 0
    planner: bool = False
    aggregated: int = 0


def parse_arms(text: str, workers: int) -> tuple[Arm, ...]:
    """``aggregated,disagg:3p1d,planner`` → arms; ValueError with a one-line reason."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--arms needs at least one arm")
    if len(set(names)) != len(names):
        raise ValueError(f"--arms names an arm twice: {text}")
    return tuple(_arm(name, workers) for name in names)


def _arm(name: str, workers: int) -> Arm:
    if name == "aggregated":
        return Arm(name)
    if name == "planner":
        p = max(1, workers // 2)
        _check_split(name, p, workers - p, workers)
        return Arm(name, p, workers - p, planner=True)
    kind, _, split = name.partition(":")
    m, agg = _SPLIT.match(split), _AGG.match(split)
    if kind == "planner" and (split == "aggregated" or agg is not None):
        n = int(agg.group(1)) if agg is not None else 1
        if not 1 <= n <= workers:
            raise ValueError(f"arm {name}: starts with 1 to --workers {workers} aggregated workers")
        return Arm(name, planner=True, aggregated=n)
    if kind not in ("disagg", "planner") or m is None:
        raise ValueError(
            f"unknown arm {name!r} (aggregated, disagg:<P>p<D>d, planner, planner:<P>p<D>d, planner:aggregated, planner:<N>agg)"
        )
    p, d = int(m.group(1)), int(m.group(2))
    _check_split(name, p, d, workers, at_most=kind == "planner")
    return Arm(name, p, d, planner=kind == "planner")


def _check_split(name: str, p: int, d: int, workers: int, at_most: bool = False) -> None:
    if p < 1 or d < 1 or (p + d > workers if at_most else p + d != workers):
        rule = "<=" if at_most else "="
        raise ValueError(f"arm {name}: needs at least 1 prefill and 1 decode worker, {p} + {d} {rule} --workers {workers}")


@dataclass(frozen=True, slots=True)
class DisaggModel:
    thresholds: DisaggThresholds = field(default_factory=DisaggThresholds)
    pipeline: bool = True


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """How often the planner looks (virtual seconds), over which window, with what config
    (its SLOs are set by the replay; its maximum is the arm's workers, its minimum
    ``min_workers``, None: a fixed fleet), and how long a started worker takes to serve."""

    interval_s: float = 1.0
    window_s: float = 10.0
    config: PlannerConfig = field(default_factory=PlannerConfig)
    min_workers: int | None = None
    start_s: float = 10.0

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.window_s > 0):
            raise ValueError("the planner's interval and window must be positive")
        if self.start_s < 0 or (self.min_workers is not None and self.min_workers < 1):
            raise ValueError("the planner's start time must be >= 0 and --min-workers >= 1")


@dataclass
class ArmRun:
    """``resources``: where the fleet's capacity went, as fractions of the makespan
    (first arrival → last finish): see :func:`_resources`."""

    records: list[RequestRecord]
    counters: dict[str, int]
    decisions: list[str]
    resources: dict[str, float] = field(default_factory=dict)
    worker_seconds: float = 0.0
    # per planner tick: (t_s, prefill, decode, aggregated workers serving, observed rps, forecast rps)
    timeline: list[tuple[float, int, int, int, float, float]] = field(default_factory=list)


def _span_ms(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """First arrival → last finish (the makespan worker-seconds are counted over)."""
    ends = [r.finish_ms for r in records if r.finish_ms is not None]
    if not records or not ends:
        return 0.0, 0.0
    return min(r.arrival_ms for r in records), max(ends)


def _resources(
    records: Sequence[RequestRecord], serving: Sequence[WorkerUsage], prefill_compute_ms: Sequence[float],
    link_ms: Sequence[float],
) -> dict[str, float]:
    """Per worker, averaged over the workers of each kind: ``serve_busy`` (passes of the
    workers that take requests: aggregated or decode), ``serve_prefill`` (the prefill
    part of those passes), ``prefill_busy`` (prefill workers computing jobs),
    ``link_busy`` (their KV writes); ``kv_max`` / ``kv_mean`` (KV pool use after each
    pass, max over workers / mean), ``running_max`` (most requests in one worker's batch)."""
    ends = [r.finish_ms for r in records if r.finish_ms is not None]
    span = (max(ends) - min(r.arrival_ms for r in records)) if ends else 0.0
    if span <= 0:
        return {}
    active = [u for u in serving if u.passes]

    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return {
        "makespan_s": span / 1000.0,
        "serve_busy": mean([u.busy_ms / span for u in active]),
        "serve_prefill": mean([u.prefill_ms / span for u in active]),
        "prefill_busy": mean([ms / span for ms in prefill_compute_ms]),
        "link_busy": mean([ms / span for ms in link_ms]),
        "kv_max": max((u.kv_usage_max for u in active), default=0.0),
        "kv_mean": mean([u.kv_usage_sum / u.passes for u in active]),
        "running_max": float(max((u.running_max for u in active), default=0)),
    }


def run_arm(
    arm: Arm,
    arrivals: Iterable[tuple[float, PreprocessedRequest]],
    options: MockerOptions,
    workers: int,
    make_router: Callable[[int], ReplayPolicy],
    model: DisaggModel | None = None,
    planner: PlannerSettings | None = None,
    on_done: Callable[[], None] | None = None,
) -> ArmRun:
    """Replay ``arrivals`` under one arm; ``make_router(n)`` builds the router over n workers."""
    if arm.prefill == 0 and not arm.planner:
        usage: list[WorkerUsage] = []
        records = simulate(arrivals, make_router(workers), fleet_options(options, workers), on_done, usage)
        t0, t1 = _span_ms(records)
        run = ArmRun(records, {"local_prefills": len(records)}, [], _resources(records, usage, [], []))
        run.worker_seconds = workers * (t1 - t0) / 1000.0
        return run
    fleet = _DisaggFleet(arm, options, workers, make_router, model or DisaggModel(), planner, on_done)
    return fleet.run(arrivals)


# ---------------------------------------------------------------------------- the fleet


@dataclass(slots=True)
class _Job:
    request: PreprocessedRequest
    arrival_ms: float
    node: int  # the decode worker holding the blocks
    cached: int
    upto: int

    @property
    def tokens(self) -> int:
        return self.upto - self.cached


@dataclass(slots=True)
class _Node:
    """One worker: a virtual mocker (its decode side) and its prefill-worker state."""

    index: int
    worker: VirtualWorker
    role: Role
    moving_to: Role | None = None
    on: bool = True  # provisioned (starting, serving or draining to stop)
    ready: bool = True  # a started worker serves once its start time has passed
    stopping: bool = False  # out of routing / pulling, released once idle
    up_ms: float = 0.0  # provisioned since
    spans: list[tuple[float, float]] = field(default_factory=list)  # (up, released) per provisioning
    computing: bool = False  # a prefill job in hand (compute; unpipelined: until written)
    link_free_ms: float = 0.0  # when its last KV write ends
    compute_ms: float = 0.0  # time spent computing prefill jobs
    link_ms: float = 0.0  # time spent writing KV
    writes: int = 0  # KV writes in flight from this worker
    awaiting: int = 0  # remote prefills this (decode) worker waits for

    @property
    def pulls(self) -> bool:
        return self.role is Role.PREFILL and self.moving_to is None and not self.computing and self.serving

    @property
    def serving(self) -> bool:
        return self.on and self.ready and not self.stopping

    @property
    def idle(self) -> bool:
        return not self.worker.busy and self.awaiting == 0 and not self.computing and self.writes == 0


class _Router:
    """The replay policy over the decode workers (node indices), following role changes."""

    def __init__(self, policy: ReplayPolicy, decode: Sequence[int]) -> None:
        self.policy = policy
        self.decode = list(decode)
        self._rr = 0
        if isinstance(policy, KvPolicy):
            for w in list(policy.core.workers):
                if w not in self.decode:
                    policy.core.remove_worker(w)

    def route(self, request: PreprocessedRequest, now_ms: float) -> int:
        if isinstance(self.policy, KvPolicy):
            return self.policy.route(request, now_ms)
        i = self.policy.route(request, now_ms)  # round_robin / random over len(decode)
        return self.decode[i % len(self.decode)]

    def remove(self, index: int) -> None:
        self.decode.remove(index)
        if isinstance(self.policy, KvPolicy):
            self.policy.core.remove_worker(index)

    def add(self, index: int) -> None:
        self.decode.append(index)
        if isinstance(self.policy, KvPolicy):
            self.policy.core.add_worker(index)


class _DisaggFleet:
    def __init__(
        self,
        arm: Arm,
        options: MockerOptions,
        workers: int,
        make_router: Callable[[int], ReplayPolicy],
        model: DisaggModel,
        planner: PlannerSettings | None,
        on_done: Callable[[], None] | None,
    ) -> None:
        self.options = options
        self.model = model
        self.on_done = on_done
        # the router's worker ids are node indices; decode (or aggregated) workers first, then
        # prefill ones, then those a planner may start
        routed = arm.aggregated or arm.decode
        self.router = _Router(make_router(workers), range(routed))
        first = Role.AGGREGATED if arm.aggregated else Role.DECODE
        self.nodes = [
            _Node(i, self._worker(i), first if i < routed else Role.PREFILL if i < routed + arm.prefill else first,
                  on=i < routed + arm.prefill)
            for i in range(workers)
        ]  # fmt: skip
        self.queue: deque[_Job] = deque()
        self.queue_tokens = 0
        self.records: dict[str, RequestRecord] = {}
        self.events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self.counters = dict.fromkeys(
            ("remote_prefills", "local_prefills", "local_by_queue", "queue_max", "kv_bytes", "moves", "starts", "stops"), 0
        )
        self.decisions: list[str] = []
        self.first_tokens: deque[tuple[float, float]] = deque()  # (time, TTFT)
        self.finishes: deque[tuple[float, float]] = deque()  # (time, mean ITL)
        self.arrived: deque[float] = deque()  # arrival times (the request rate)
        self.round_arrivals = [0, 0, 0]  # since the last tick: requests, prompt tokens, max_tokens
        self.timeline: list[tuple[float, int, int, int, float, float]] = []
        self._started: set[str] = set()
        self.now = 0.0
        self.planner: Planner | None = None
        self.planner_settings = planner
        if arm.planner:
            settings = planner or PlannerSettings()
            lowest = settings.min_workers if settings.min_workers is not None else routed + arm.prefill
            cfg = replace(settings.config, min_workers=min(lowest, workers), max_workers=workers, hot_spares=0)
            self.planner = Planner(cfg)
            self.planner_settings = replace(settings, config=cfg)

    def _worker(self, index: int) -> VirtualWorker:
        return VirtualWorker(replace(self.options, worker_id=index), CallbackPublisher(self._kv_event, _drop_load))

    def _kv_event(self, event: KvEvent) -> None:
        self.router.policy.on_kv_event(event)

    # ------------------------------------------------------------------ the loop

    def run(self, arrivals: Iterable[tuple[float, PreprocessedRequest]]) -> ArmRun:
        pending = iter(arrivals)
        nxt = next(pending, None)
        if self.planner is not None and self.planner_settings is not None:
            self._push(self.planner_settings.interval_s * 1000.0, "tick", None)
        while True:
            t_arrival = nxt[0] if nxt is not None else math.inf
            t_event = self.events[0][0] if self.events else math.inf
            t_step = min((t for t in (n.worker.next_event_time() for n in self.nodes) if t is not None), default=math.inf)
            self.now = min(t_arrival, t_event, t_step)
            if t_arrival <= t_event and t_arrival <= t_step and nxt is not None:
                self._arrive(*nxt)
                nxt = next(pending, None)
            elif t_event <= t_step and self.events:
                t, _, kind, data = heapq.heappop(self.events)
                if kind == "tick":
                    if nxt is None and not self._busy():
                        continue  # nothing left to plan for
                    self._tick(t)
                    assert self.planner_settings is not None
                    self._push(t + self.planner_settings.interval_s * 1000.0, "tick", None)
                elif kind == "ready":
                    assert isinstance(data, int)
                    self._ready(t, data)
                else:
                    assert isinstance(data, tuple)
                    self._prefill_event(t, kind, data)
            elif math.isfinite(t_step):
                for node in self.nodes:
                    self._feedback(node.worker.advance_to(t_step))
            else:
                break
            self._settle_moves()
        records = sorted(self.records.values(), key=lambda r: (r.arrival_ms, int(r.request_id[1:]) if r.request_id[1:].isdigit() else 0))
        # a worker counts where it spent its time (a planner's worker may be on both sides)
        serving = [n.worker.usage for n in self.nodes if n.worker.usage.passes]
        pulling = [n for n in self.nodes if n.compute_ms > 0]
        resources = _resources(records, serving, [n.compute_ms for n in pulling], [n.link_ms for n in pulling])
        t0, t1 = _span_ms(records)
        spans = [span for n in self.nodes for span in n.spans] + [(n.up_ms, math.inf) for n in self.nodes if n.on]
        worker_s = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans) / 1000.0
        return ArmRun(records, self.counters, self.decisions, resources, worker_s, self.timeline)

    def _busy(self) -> bool:
        return bool(self.queue) or any(
            n.worker.busy or n.computing or n.writes or n.awaiting for n in self.nodes
        ) or any(kind != "tick" for _, _, kind, _ in self.events)

    def _push(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self.events, (t, next(self._order), kind, data))

    # ------------------------------------------------------------------ decode side

    def _arrive(self, t: float, request: PreprocessedRequest) -> None:
        if self.planner is not None:
            self.arrived.append(t)
            r = self.round_arrivals
            r[0], r[1], r[2] = r[0] + 1, r[1] + len(request.token_ids), r[2] + (request.stop.max_tokens or 0)
        node = self.nodes[self.router.route(request, t)]
        if node.role is Role.AGGREGATED:
            self._local(node, request, t)
            return
        sched = node.worker.scheduler
        seq = sched.reserve_request(request)
        if seq is None:  # no room to hold the blocks now: the scheduler queues it
            self._local(node, request, t)
            return
        n, cached = len(request.token_ids), seq.num_computed
        t_ = self.model.thresholds  # the rule of kvmesh.disagg.policy.place_prefill
        remote = t_.wants_remote(n, cached)
        if not remote or not t_.admits(len(self.queue), self.queue_tokens):
            sched.release(request.request_id)
            self.counters["local_by_queue"] += remote
            self._local(node, request, t)
            return
        job = _Job(request, t, node.index, cached, n - 1)
        self.queue.append(job)  # the bound was checked at this instant: atomic
        self.queue_tokens += job.tokens
        self.counters["queue_max"] = max(self.counters["queue_max"], len(self.queue))
        node.awaiting += 1
        self._dispatch(t)

    def _local(self, node: _Node, request: PreprocessedRequest, t: float) -> None:
        self.counters["local_prefills"] += 1
        self.records[request.request_id] = node.worker.submit(request, t)

    # ------------------------------------------------------------------ prefill side

    def _dispatch(self, t: float) -> None:
        for node in self.nodes:
            if not self.queue:
                return
            if node.pulls:
                job = self.queue.popleft()
                self.queue_tokens -= job.tokens
                node.computing = True
                took = self._compute_ms(job)
                node.compute_ms += took
                self._push(t + took, "computed", (node.index, job))

    def _transfer_ms(self, blocks: int) -> float:
        o = self.options
        nbytes = blocks * o.block_size * o.kv_bytes_per_token
        self.counters["kv_bytes"] += nbytes
        return nbytes / o.kv_bandwidth * 1000.0 / o.speedup

    def _compute_ms(self, job: _Job) -> float:
        read = self._transfer_ms(job.cached // self.options.block_size)  # the prefix hit, from the decode worker
        return read + self.options.remote_prefill_ms(job.tokens)

    def _prefill_event(self, t: float, kind: str, data: tuple[int, _Job]) -> None:
        index, job = data
        node = self.nodes[index]
        if kind == "computed":
            bs = self.options.block_size
            start = max(t, node.link_free_ms)
            write = self._transfer_ms(-(-job.upto // bs) - job.cached // bs)
            node.link_ms += write
            node.link_free_ms = start + write
            node.writes += 1
            self._push(node.link_free_ms, "written", (index, job))
            if self.model.pipeline:
                node.computing = False
        else:  # written: the decode worker commits the tokens and schedules the request
            node.writes -= 1
            if not self.model.pipeline:
                node.computing = False
            decode = self.nodes[job.node]
            decode.awaiting -= 1
            decode.worker.scheduler.commit_reserved(job.request.request_id, job.upto)
            record = decode.worker.submit(job.request, t)
            record.arrival_ms = job.arrival_ms
            self.records[job.request.request_id] = record
            self.counters["remote_prefills"] += 1
        self._dispatch(t)

    # ------------------------------------------------------------------ feedback

    def _feedback(self, events: list[TokenEvent]) -> None:
        policy = self.router.policy
        for ev in events:
            rid = ev.request_id
            if ev.token_id is not None and rid not in self._started:
                self._started.add(rid)
                policy.on_first_token(rid, ev.time_ms)
                ttft = self.records[rid].ttft_ms
                self.first_tokens.append((ev.time_ms, ttft if ttft is not None else 0.0))
            if ev.finish_reason is not None:
                self._started.discard(rid)
                policy.on_finished(rid, ev.time_ms)
                times = self.records[rid].token_times_ms
                if len(times) >= 2:
                    self.finishes.append((ev.time_ms, (times[-1] - times[0]) / (len(times) - 1)))
                if self.on_done is not None:
                    self.on_done()

    # ------------------------------------------------------------------ the planner

    def _observe(self, t: float) -> Observation:
        assert self.planner_settings is not None
        horizon = t - self.planner_settings.window_s * 1000.0
        for q in (self.first_tokens, self.finishes):
            while q and q[0][0] < horizon:
                q.popleft()
        while self.arrived and self.arrived[0] < horizon:
            self.arrived.popleft()
        views = []
        for n in self.nodes:
            if not (n.on and n.ready):  # off, or starting (in ``starting``)
                continue
            s = n.worker.scheduler
            usage = s.blocks.active_blocks / self.options.num_blocks if n.role is not Role.PREFILL else 0.0
            waiting = s.num_waiting + (len(self.queue) if n.role is Role.PREFILL else 0)
            views.append(WorkerView(n.index, n.role, n.moving_to is None and not n.stopping, usage, s.num_running,
                                    waiting, self.options.max_num_seqs))  # fmt: skip
        arrived, tokens_in, tokens_out = self.round_arrivals
        return Observation(
            now_s=t / 1000.0,
            workers=tuple(views),
            starting=tuple(n.moving_to for n in self.nodes if n.moving_to is not None)
            + tuple(n.role for n in self.nodes if n.on and not n.ready),
            prefill_queue_tokens=self.queue_tokens,
            ttft_p90_ms=_p90([v for _, v in self.first_tokens]),
            itl_p90_ms=_p90([v for _, v in self.finishes]),
            request_rate_rps=len(self.arrived) / self.planner_settings.window_s,
            interval_s=self.planner_settings.interval_s,
            arrived=arrived,
            arrived_input_tokens=tokens_in,
            arrived_output_tokens=tokens_out,
        )

    def _tick(self, t: float) -> None:
        assert self.planner is not None
        obs = self._observe(t)
        self.round_arrivals = [0, 0, 0]
        plan = self.planner.plan(obs)
        for action in plan.actions:
            self._log(t, action, obs)
            self._act(action, t)
        serving = [n.role for n in self.nodes if n.serving]
        forecast = plan.forecast.rate_rps if plan.forecast is not None else 0.0
        self.timeline.append((t / 1000.0, serving.count(Role.PREFILL), serving.count(Role.DECODE),
                              serving.count(Role.AGGREGATED), obs.arrived / obs.interval_s, forecast))  # fmt: skip

    def _log(self, t: float, a: Action, obs: Observation) -> None:
        inputs = {**a.inputs, "ttft_p90_ms": obs.ttft_p90_ms, "itl_p90_ms": obs.itl_p90_ms,
                  "queue_tokens": float(obs.prefill_queue_tokens)}  # fmt: skip
        shown = ", ".join(f"{k}={v:.3g}" for k, v in inputs.items())
        who = "" if a.worker_id is None else f" worker {a.worker_id}"
        self.decisions.append(f"t={t / 1000.0:.1f}s {a.kind.value}{who} -> {a.role.value}: {a.reason} ({shown})")

    def _act(self, a: Action, t: float) -> None:
        if a.kind is ActionKind.START and a.role is not Role.SPARE:
            self._start(a.role, t)
            return
        if a.worker_id is None or a.kind not in (ActionKind.MOVE, ActionKind.STOP):
            return  # no hot spares on the virtual clock: nothing to promote
        node = self.nodes[a.worker_id]
        if node.moving_to is not None or node.stopping or not node.on:
            return
        if a.kind is ActionKind.STOP:
            node.stopping = True
            self.counters["stops"] += 1
        elif node.role is a.role:
            return
        else:
            node.moving_to = a.role
            self.counters["moves"] += 1
        if node.role is not Role.PREFILL and node.index in self.router.decode:
            self.router.remove(node.index)  # no new requests; it drains what it has

    def _start(self, role: Role, t: float) -> None:
        node = next((n for n in self.nodes if not n.on), None)
        if node is None:
            return  # every worker is provisioned (one may still be draining to stop)
        assert self.planner_settings is not None
        node.worker, node.role, node.on, node.ready, node.up_ms = self._worker(node.index), role, True, False, t
        self.counters["starts"] += 1
        self._push(t + self.planner_settings.start_s * 1000.0, "ready", node.index)

    def _ready(self, t: float, index: int) -> None:
        node = self.nodes[index]
        node.ready = True
        if node.role is Role.PREFILL:
            self._dispatch(t)
        else:
            self.router.add(index)

    def _settle_moves(self) -> None:
        for node in self.nodes:
            if node.stopping and node.idle:
                node.spans.append((node.up_ms, self.now))
                node.on = node.stopping = False
                continue
            if node.moving_to is None:
                continue
            if node.role is Role.DECODE and not node.worker.busy and node.awaiting == 0:
                node.role, node.moving_to = Role.PREFILL, None
                self._dispatch(self.now)
            elif node.role is Role.PREFILL and not node.computing and node.writes == 0:
                node.role, node.moving_to = node.moving_to, None
                self.router.add(node.index)


def _p90(values: Sequence[float]) -> float:
    return percentile(sorted(values), 90) if values else 0.0


def _drop_load(_report: LoadReport) -> None:
    pass


def default_router(name: str, options: MockerOptions, seed: int = 0) -> Callable[[int], ReplayPolicy]:
    """A router factory for :func:`run_arm` (``kv``, ``kv-approx``, ``round_robin``, ``random``)."""
    return lambda n: make_policy(name, n, block_size=options.block_size, seed=seed)
