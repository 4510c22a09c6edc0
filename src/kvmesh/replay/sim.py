"""Replay on the virtual clock: mocker :class:`~kvmesh.engines.mocker.sim.VirtualWorker`\\ s
driven in virtual time, with a routing policy in the loop.

This is :func:`kvmesh.engines.mocker.sim.run_trace`'s loop plus feedback: each worker's
KV events go to ``policy.on_kv_event`` the moment the worker emits them, and its token
events become ``on_first_token`` / ``on_finished`` calls, so the policy sees exactly
what a router would have seen by then. Order at one instant: arrivals first (routed
with what happened strictly before), then the steps ending or starting at it.

Deterministic: the same arrivals, options and policy (seed) give the same records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord, RoutePolicy, TokenEvent, VirtualWorker, WorkerUsage, run_trace
from kvmesh.protocol import LoadReport, PreprocessedRequest
from kvmesh.replay.policies import ReplayPolicy
from kvmesh.runtime.events import CallbackPublisher

__all__ = ["fleet_options", "kv_feed", "simulate"]


def _drop_load(_report: LoadReport) -> None:
    pass


def fleet_options(options: MockerOptions, workers: int) -> list[MockerOptions]:
    """``options`` for each of ``workers`` mocker workers (``worker_id`` 0 .. n-1)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    return [replace(options, worker_id=i) for i in range(workers)]


def kv_feed(policy: ReplayPolicy) -> CallbackPublisher:
    """A worker's publisher: its KV events reach ``policy`` at once; load reports nowhere."""
    return CallbackPublisher(policy.on_kv_event, _drop_load)


def simulate(
    arrivals: Iterable[tuple[float, PreprocessedRequest]],
    policy: ReplayPolicy,
    fleet: Sequence[MockerOptions],
    on_done: Callable[[], None] | None = None,
    usage: list[WorkerUsage] | None = None,
    route: RoutePolicy | None = None,
) -> list[RequestRecord]:
    """Replay time-ordered ``arrivals`` on one mocker worker per ``fleet`` entry (see
    :func:`fleet_options`); returns every request's record in arrival order.
    ``on_done`` is called once per finished request (a progress bar); ``usage`` gets
    each worker's :class:`WorkerUsage` at the end. ``route`` replaces ``policy.route``
    (it sees the workers: the peer arm, :mod:`kvmesh.replay.peer_arm`)."""
    workers = [VirtualWorker(options, kv_feed(policy)) for options in fleet]
    feedback = _Feedback(policy, on_done)
    if route is None:
        route = lambda request, t, _workers: policy.route(request, t)  # noqa: E731
    records = run_trace(arrivals, workers, route, feedback.deliver)
    if usage is not None:
        usage.extend(w.usage for w in workers)
    return list(records.values())  # arrival order


class _Feedback:
    """Turns token events into the policy's first-token / finished calls."""

    def __init__(self, policy: ReplayPolicy, on_done: Callable[[], None] | None) -> None:
        self.policy = policy
        self.on_done = on_done
        self.started: set[str] = set()

    def deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            rid = ev.request_id
            if ev.token_id is not None and rid not in self.started:
                self.started.add(rid)
                self.policy.on_first_token(rid, ev.time_ms)
            if ev.finish_reason is not None:
                self.started.discard(rid)
                self.policy.on_finished(rid, ev.time_ms)
                if self.on_done is not None:
                    self.on_done()
