"""Virtual-clock driver: mocker schedulers without asyncio, for replays and tests.

A :class:`VirtualWorker` owns one :class:`~kvmesh.engines.mocker.scheduler.Scheduler`
and a clock in milliseconds. Time only moves when the caller says so, so a trace of
thousands of requests simulates in seconds, and the same inputs give the same timings.

Timing model: a step starts when the worker is free and has work, is planned at its
start (requests submitted at or before that instant take part), and its tokens appear
at its end (start + the step's modelled duration). A request submitted while a step is
in flight joins the next one.

Driving it (what :func:`run_trace` does for several workers)::

    worker.submit(request, now_ms)              arrivals, in time order
    t = worker.next_event_time()                when the next step starts or ends (None: idle)
    events = worker.advance_to(t)               run up to t; TokenEvents in time order

KV events and load reports (timestamped with virtual time) go to the worker's
publisher as they happen, so a router's indexer can follow a replay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.engines.batching.tiers import TierStats
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.scheduler import Scheduler, StepOutput
from kvmesh.protocol import FinishReason, PreprocessedRequest
from kvmesh.runtime.events import EventPublisher, NullPublisher

__all__ = ["TokenEvent", "RequestRecord", "VirtualWorker", "WorkerUsage", "RoutePolicy", "round_robin", "run_trace"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token (``token_id``) and/or a finish (``finish_reason``) of one request at ``time_ms``."""

    request_id: str
    time_ms: float
    token_id: int | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestRecord:
    """Everything observed about one request on a virtual worker."""

    request_id: str
    worker_id: int
    arrival_ms: float
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    token_times_ms: list[float] = field(default_factory=list)
    finish_ms: float | None = None
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token, or None if no token came."""
        return self.token_times_ms[0] - self.arrival_ms if self.token_times_ms else None

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between consecutive tokens."""
        t = self.token_times_ms
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency_ms(self) -> float | None:
        return self.finish_ms - self.arrival_ms if self.finish_ms is not None else None


@dataclass(slots=True)
class WorkerUsage:
    """Where a virtual worker's time went: model milliseconds of passes, of their
    prefill part, prefill tokens computed, and the KV pool's use after each pass;
    ``tiers``: its block manager's counts of prefix hits and moves by KV tier."""

    busy_ms: float = 0.0
    prefill_ms: float = 0.0
    prefill_tokens: int = 0
    passes: int = 0
    kv_usage_max: float = 0.0
    kv_usage_sum: float = 0.0  # over passes: ÷ passes is the mean
    running_max: int = 0
    tiers: TierStats = field(default_factory=TierStats)  # the KV pool's, live (prefix hits, moves by tier)

    def add(self, out: StepOutput, options: MockerOptions, kv_usage: float, running: int) -> None:
        self.busy_ms += out.duration_ms
        if out.prefill_tokens:
            self.prefill_ms += options.prefill_ms(out.prefill_tokens) / options.speedup
            self.prefill_tokens += out.prefill_tokens
        self.passes += 1
        self.kv_usage_max = max(self.kv_usage_max, kv_usage)
        self.kv_usage_sum += kv_usage
        self.running_max = max(self.running_max, running)


class VirtualWorker:
    """One simulated worker on a virtual clock; see the module docstring."""

    def __init__(self, options: MockerOptions | None = None, publisher: EventPublisher | None = None) -> None:
        self.options = options if options is not None else MockerOptions()
        self._publisher: EventPublisher = publisher if publisher is not None else NullPublisher()
        self.scheduler = Scheduler(self.options, self._publisher)
        self.records: dict[str, RequestRecord] = {}
        self._by_seq: dict[int, RequestRecord] = {}
        self._clock = 0.0
        self._inflight: StepOutput | None = None
        self._inflight_end = 0.0
        self._last_load: tuple[int, int, int] | None = None
        self.usage = WorkerUsage(tiers=self.scheduler.blocks.tiers.stats)

    @property
    def worker_id(self) -> int:
        return self.options.worker_id

    @property
    def now_ms(self) -> float:
        """The worker's clock: the end of its last step, or the last time it was idle at."""
        return self._clock

    @property
    def busy(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work

    def submit(self, request: PreprocessedRequest, now_ms: float) -> RequestRecord:
        """Queue ``request`` arriving at ``now_ms``; returns its (live) record."""
        if request.request_id in self.records and not self.records[request.request_id].done:
            raise ValueError(f"request {request.request_id!r} is already running on worker {self.worker_id}")
        if self._inflight is None and not self.scheduler.has_work:
            self._clock = max(self._clock, now_ms)
        record = RequestRecord(request.request_id, self.worker_id, now_ms, len(request.token_ids))
        self.records[request.request_id] = record
        self._by_seq[self.scheduler.submit(request)] = record
        return record

    def next_event_time(self) -> float | None:
        """When the in-flight step ends, or the next one starts; None when idle."""
        if self._inflight is not None:
            return self._inflight_end
        return self._clock if self.scheduler.has_work else None

    def advance_to(self, t_ms: float) -> list[TokenEvent]:
        """Run every step that starts and ends by ``t_ms``; return their token events."""
        events: list[TokenEvent] = []
        while True:
            if self._inflight is None:
                if not self.scheduler.has_work:
                    self._clock = max(self._clock, t_ms) if math.isfinite(t_ms) else self._clock
                    return events
                if self._clock > t_ms:
                    return events
                self._inflight = self.scheduler.step()
                self._inflight_end = self._clock + self._inflight.duration_ms
            if self._inflight_end > t_ms:
                return events
            out, self._inflight = self._inflight, None
            self._clock = self._inflight_end
            sched = self.scheduler
            self.usage.add(out, self.options, sched.blocks.active_blocks / self.options.num_blocks, sched.num_running)
            self._record(out, self._clock, events)
            self._publish_load()

    def run_until_idle(self) -> list[TokenEvent]:
        """Advance until every submitted request has finished."""
        return self.advance_to(math.inf)

    def _record(self, out: StepOutput, now: float, events: list[TokenEvent]) -> None:
        by_seq = self._by_seq
        for sid, token in out.tokens.items():
            rec = by_seq[sid]
            rec.token_ids.append(token)
            rec.token_times_ms.append(now)
            events.append(TokenEvent(rec.request_id, now, token_id=token))
        for fin in out.finished:
            rec = by_seq.pop(fin.seq_id)
            rec.finish_ms = now
            rec.finish_reason = fin.reason
            rec.cached_tokens = fin.usage.cached_tokens
            rec.error = fin.error
            events.append(TokenEvent(rec.request_id, now, finish_reason=fin.reason))

    def _publish_load(self) -> None:
        sched = self.scheduler
        key = (sched.blocks.active_blocks, sched.num_waiting, sched.num_running)
        if key != self._last_load:
            self._last_load = key
            self._publisher.publish_load(sched.load_report(self._clock))


RoutePolicy = Callable[[PreprocessedRequest, float, Sequence[VirtualWorker]], int]
"""Picks the index of the worker a request arriving at a time goes to."""


def round_robin() -> RoutePolicy:
    """A policy sending requests to workers in turn."""
    counter = 0

    def route(_request: PreprocessedRequest, _now_ms: float, workers: Sequence[VirtualWorker]) -> int:
        nonlocal counter
        counter += 1
        return (counter - 1) % len(workers)

    return route


def run_trace(
    arrivals: Iterable[tuple[float, PreprocessedRequest]],
    workers: Sequence[VirtualWorker],
    route: RoutePolicy | None = None,
    on_events: Callable[[list[TokenEvent]], None] | None = None,
) -> dict[str, RequestRecord]:
    """Replay ``arrivals`` (time-ordered ``(arrival_ms, request)``) across ``workers``,
    routing each with ``route`` (default round robin); returns every request's record.
    ``on_events`` hears each worker's token events as its steps run (feedback).

    Arrivals at an instant are submitted before any step starting at that instant.
    """
    if not workers:
        raise ValueError("run_trace needs at least one worker")
    route = route if route is not None else round_robin()
    records: dict[str, RequestRecord] = {}
    pending = iter(arrivals)
    nxt = next(pending, None)
    last_arrival = -math.inf
    while True:
        t_step = _next_step_time(workers)
        if nxt is not None and (t_step is None or nxt[0] <= t_step):
            t_arrival, request = nxt
            if t_arrival < last_arrival:
                raise ValueError(f"arrivals must be in time order: {t_arrival} after {last_arrival}")
            last_arrival = t_arrival
            records[request.request_id] = workers[route(request, t_arrival, workers)].submit(request, t_arrival)
            nxt = next(pending, None)
        elif t_step is not None:
            for worker in workers:
                events = worker.advance_to(t_step)
                if on_events is not None:
                    on_events(events)
        else:
            return records


def _next_step_time(workers: Sequence[VirtualWorker]) -> float | None:
    times = [t for t in (w.next_event_time() for w in workers) if t is not None]
    return min(times) if times else None
