"""What one request reports to metrics and tracing, as hooks its owner calls.

The owner (:mod:`kvmesh.frontend.owner`) says what happened — routed, an attempt
opened, failed, the request moved, tokens arrived, it ended — and this object turns
that into the model's metrics and, when tracing records, the request's spans::

    root (RequestTrace, ended by ``finished``)
      route                       picking()/picked()/pick_failed()
      request_plane.generate      attempt() ... attempt_failed() / attempt_closed(); one per worker tried
      migration                   moving() ... answered() (the next worker's first chunk)

Every span the observer opened is closed by ``finished`` at the latest. With tracing
off, each span hook is one ``is None`` test.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvmesh.errors import KvmeshError
from kvmesh.observability import tracing
from kvmesh.protocol import PreprocessedRequest
from kvmesh.runtime.instances import Instance

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kvmesh.frontend.deltas import Usage
    from kvmesh.frontend.models import ModelEntry
    from kvmesh.router.core import Decision

__all__ = ["RequestObserver"]


class RequestObserver:
    """Metrics and spans of one request (not shared between requests)."""

    __slots__ = ("entry", "metrics", "trace", "endpoint", "started", "first_token_at", "recording", "_last", "_root", "_route",
                 "_hop", "_moving", "_moved")  # fmt: skip

    def __init__(self, entry: ModelEntry, endpoint: str, trace: tracing.RequestTrace | None) -> None:
        self.entry = entry
        self.metrics = entry.metrics
        self.trace = trace
        self.endpoint = endpoint  # the ``requests`` counter's label
        self.started = self._last = time.perf_counter()
        self.first_token_at: float | None = None
        self._root = trace.span if trace is not None else None  # None: not recording
        self.recording = self._root is not None  # spans are recorded: the span hooks do something
        self._route: Span | None = None
        self._hop: Span | None = None
        self._moving: Span | None = None
        self._moved: tuple[str, float] | None = None  # (method, when the worker failed) until the next answers
        self.metrics.inflight.inc()

    # ---------------------------------------------------------------- routing
    def picking(self) -> None:
        if self._root is not None:
            policy = type(self.entry.router.policy).__name__
            self._route = tracing.start_span("route", self._root, attributes={"router.policy": policy})

    def pick_failed(self, exc: BaseException) -> None:
        span, self._route = self._route, None
        if span is not None:
            if isinstance(exc, KvmeshError):
                tracing.fail(span, exc.kind, exc.message)
            span.end()

    def picked(self, instance: Instance, request_id: str) -> None:
        span, self._route = self._route, None
        if span is None:
            return
        span.set_attribute("worker_id", f"{instance.worker_id:x}")
        decision = _recent_decision(self.entry.router.policy, request_id)
        if decision is not None:
            span.set_attribute("overlap_blocks", decision.overlap_blocks)
            span.set_attribute("candidates", len(decision.candidates))
        span.end()

    # ---------------------------------------------------------------- attempts
    def attempt(self, instance: Instance, request: PreprocessedRequest, attempt: int) -> None:
        """A stream opens on ``instance``; the hop's trace context travels in ``request``."""
        self.metrics.routed(instance.worker_id)
        if self._root is None:
            return
        attributes: dict[str, str | int] = {
            "worker_id": f"{instance.worker_id:x}", "attempt": attempt, "transport": instance.info.transport,
        }  # fmt: skip
        self._hop = tracing.start_span("request_plane.generate", self._root, "client", attributes)
        if self._hop is not None:
            request.trace_context = tracing.span_traceparent(self._hop)

    def attempt_failed(self, exc: KvmeshError) -> None:
        if self._hop is not None:
            tracing.fail(self._hop, exc.kind, exc.message)

    def attempt_closed(self) -> None:
        hop, self._hop = self._hop, None
        if hop is not None:
            hop.end()

    # ---------------------------------------------------------------- migration
    def moving(self, method: str, source: int, tokens: int, exc: KvmeshError) -> None:
        """The request leaves worker ``source`` after ``tokens`` tokens, by ``method``."""
        self._moved = (method, time.perf_counter())
        if self._root is not None:
            self._moving = tracing.start_span("migration", self._root, attributes={
                "method": method, "source_worker": f"{source:x}", "tokens_so_far": tokens, "error_kind": exc.kind,
            })  # fmt: skip

    def moved(self, source: int, target: int) -> None:
        """Counted once the target is known."""
        if self._moved is not None:
            self.metrics.migrated(self._moved[0], f"{source:x}", f"{target:x}")

    def answered(self, worker_id: int) -> None:
        """The worker the request moved to sent its first chunk: the move is done."""
        moved, self._moved = self._moved, None
        if moved is not None:
            self.metrics.migration_took(moved[0], time.perf_counter() - moved[1])
        span, self._moving = self._moving, None
        if span is not None:
            span.set_attribute("target_worker", f"{worker_id:x}")
            span.end()

    # ---------------------------------------------------------------- tokens and the end
    def tokens(self, n: int) -> bool:
        """``n`` tokens arrived in one chunk; True for the request's first."""
        now = time.perf_counter()
        metrics = self.metrics
        first = self.first_token_at is None
        if first:
            self.first_token_at = now
            metrics.ttft.observe(now - self.started)
        else:  # the tokens that came together share the wait: one observation each
            metrics.itl.observe_many((now - self._last) / n, n)
        self._last = now
        return first

    def refused(self, status: str) -> None:
        """The request ended before a worker was booked (the route span is ended)."""
        self.metrics.inflight.dec()
        self.metrics.finished(self.endpoint, status)

    def finished(self, status: str, usage: Usage) -> None:
        """The request ended (once): status ``200``, an error's HTTP status, ``499``."""
        m = self.metrics
        m.inflight.dec()
        m.output_tokens.inc(usage.completion_tokens)
        m.cached_tokens.inc(usage.cached_tokens)
        m.duration.observe(time.perf_counter() - self.started)
        m.finished(self.endpoint, status)
        if self.recording:
            for span in (self._route, self._hop, self._moving):  # a span left open by an error path
                if span is not None:
                    span.end()
            self._route = self._hop = self._moving = None
        if self.trace is not None:
            self.trace.end(status)


def _recent_decision(policy: object, request_id: str) -> Decision | None:
    """The KV router's decision for ``request_id`` if it is among its recent ones."""
    recent = getattr(policy, "recent", None)
    if not recent:
        return None
    for rid, decision in reversed(recent):
        if rid == request_id:
            return decision  # type: ignore[no-any-return]  # KvPolicy.recent holds (str, Decision)
    return None
