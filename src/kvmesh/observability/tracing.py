"""OpenTelemetry tracing: frontend → request plane → worker → ``engine.generate``.

Two states, chosen once per process:

* **off** (the default): nothing of OpenTelemetry is imported. Each HTTP request still
  gets a W3C trace id (the caller's ``traceparent`` when it sent one, else a random one),
  which travels in :attr:`PreprocessedRequest.trace_context`, appears in every log line
  of the request (frontend and worker) and in the ``traceparent`` response header; no
  span is recorded and no per-chunk work is done.
* **on** (``OTEL_EXPORT_ENABLED=1``, or a test's :func:`use_provider`): spans are
  recorded with the OpenTelemetry SDK and exported over OTLP/HTTP (protobuf) to
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
  ``OTEL_SERVICE_NAME`` and the other standard ``OTEL_*`` variables apply).

The span tree of one request (names as recorded)::

    POST /v1/chat/completions            frontend, SERVER (http.route, kvmesh.request_id, http.status_code)
      route                              chosen worker, overlap blocks, router mode
      request_plane.generate             CLIENT, one per hop (worker, transport, attempt)
        engine.generate                  worker: the seed's attributes (model, input_tokens, disagg_role,
                                         ttft_ms, output_tokens, finish_reason, cancelled, itl stats,
                                         error_kind); a Link to the predecessor on a migration retry
          remote_prefill                 decode worker: queue depth, wait, outcome
            engine.generate              prefill worker (disagg_role=prefill): queue wait, KV bytes/time
      migration                          from a worker failing to the next worker's first chunk

Links are written ``"{trace_id:032x}-{span_id:016x}"`` on the wire (``trace_link`` on
the first chunk of a stream, ``migration_link`` on the request that continues it).
"""

from __future__ import annotations

import contextvars
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.context import Context as OtelContext
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, Span, Tracer

    from kvmesh.protocol import OutputChunk, PreprocessedRequest

__all__ = [
    "enabled",
    "export_requested",
    "setup",
    "use_provider",
    "shutdown",
    "parse_traceparent",
    "format_traceparent",
    "trace_id_of",
    "new_trace",
    "start_span",
    "span_traceparent",
    "span_link",
    "parse_link",
    "GenerateSpan",
    "current_generate",
    "set_log_trace_id",
    "install_log_filter",
    "LOG_FORMAT",
]

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s [trace_id=%(trace_id)s] %(message)s"

AttrValue = str | int | float | bool


class _State:
    tracer: Tracer | None = None
    provider: TracerProvider | None = None


_state = _State()
_log_trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("kvmesh_trace_id", default="-")
_generate_span: contextvars.ContextVar[GenerateSpan | None] = contextvars.ContextVar("kvmesh_generate_span", default=None)
_rand = random.Random()  # ids need to be unique, not secret (W3C); no syscall per request


def enabled() -> bool:
    """Spans are recorded (export on, or a test's provider)."""
    return _state.tracer is not None


def export_requested(env: Mapping[str, str] = os.environ) -> bool:
    return env.get("OTEL_EXPORT_ENABLED", "").strip().lower() in ("1", "true", "yes", "on")


def setup(service_name: str) -> bool:
    """Once per process (the CLI): the log filter, and OTLP/HTTP export when
    ``OTEL_EXPORT_ENABLED=1``. True when spans will be exported."""
    install_log_filter()
    if not export_requested() or _state.tracer is not None:
        return _state.tracer is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, when set, wins over this default (Resource.create reads it)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    use_provider(provider)
    return True


def use_provider(provider: TracerProvider | None) -> None:
    """Record spans with ``provider`` (None: back to off). Tests pass one with an
    in-memory exporter."""
    _state.provider = provider
    _state.tracer = provider.get_tracer("kvmesh") if provider is not None else None


def shutdown() -> None:
    """Flush and stop the exporter (process exit)."""
    provider = _state.provider
    if provider is not None:
        try:
            provider.force_flush(5000)
            provider.shutdown()
        except Exception as exc:  # noqa: BLE001 - a collector that is gone must not fail the exit
            log.debug("trace export shutdown: %r", exc)


# ---------------------------------------------------------------------------- W3C trace context

_HEX = frozenset("0123456789abcdef")
_ZERO_TRACE = "0" * 32


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, flags)`` of a W3C ``traceparent`` (version 00), or None when
    malformed or all-zero (a bad header starts a new trace, it is not an error)."""
    if value is None or len(value) != 55:
        return None
    value = value.lower()
    if value[0:3] != "00-" or value[35] != "-" or value[52] != "-" or not _HEX.issuperset(value[3:35] + value[36:52] + value[53:]):
        return None
    trace_id, span_id, flags = int(value[3:35], 16), int(value[36:52], 16), int(value[53:], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, flags


def format_traceparent(trace_id: int, span_id: int, flags: int = 1) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def trace_id_of(traceparent: str | None) -> str:
    """The trace id of a ``traceparent`` for log lines (``"-"`` when there is none or
    it is not alphanumeric: nothing a peer sends can break a log line)."""
    if traceparent is None or len(traceparent) != 55:
        return "-"
    trace_id = traceparent[3:35]
    return trace_id if trace_id.isalnum() and trace_id.isascii() else "-"


def parse_link(link: str | None) -> tuple[int, int] | None:
    """``(trace_id, span_id)`` of a wire link ``"{trace:032x}-{span:016x}"``."""
    if link is None or len(link) != 49 or link[32] != "-" or not _HEX.issuperset(link[:32] + link[33:]):
        return None
    trace_id, span_id = int(link[:32], 16), int(link[33:], 16)
    return (trace_id, span_id) if trace_id and span_id else None


def new_trace(incoming: str | None) -> str:
    """A ``traceparent`` for a request with tracing off: the caller's trace continued
    (a new span id), or a new trace."""
    ids = _rand.randbytes(24).hex()  # (hex formatting of big ints costs microseconds; this does not)
    if incoming is not None and parse_traceparent(incoming) is not None:
        incoming = incoming.lower()
        return f"00-{incoming[3:35]}-{ids[32:]}-{incoming[53:]}"
    if ids[:32] == _ZERO_TRACE:  # all-zero ids are invalid (W3C); 2**-128
        ids = "1" + ids[1:]
    return f"00-{ids[:32]}-{ids[32:]}-00"


# ---------------------------------------------------------------------------- spans


def _parent_context(traceparent: str | None) -> OtelContext | None:
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return None
    from opentelemetry import trace

    span_context = trace.SpanContext(parsed[0], parsed[1], is_remote=True, trace_flags=trace.TraceFlags(parsed[2] | 1))
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def start_span(
    name: str,
    parent: Span | str | None = None,
    kind: str = "internal",
    attributes: Mapping[str, AttrValue] | None = None,
    links: Sequence[str] = (),
) -> Span | None:
    """A started span (end it yourself), or None when tracing is off. ``parent``: a
    span of this process or a ``traceparent`` from another; ``links``: wire links."""
    tracer = _state.tracer
    if tracer is None:
        return None
    from opentelemetry import trace

    if isinstance(parent, str) or parent is None:
        context = _parent_context(parent)
    else:
        context = trace.set_span_in_context(parent)
    otel_links = [_link(link) for link in links if parse_link(link) is not None]
    span_kind = getattr(trace.SpanKind, kind.upper())
    return tracer.start_span(name, context=context, kind=span_kind, attributes=dict(attributes or {}), links=otel_links)


def _link(link: str) -> Link:
    from opentelemetry import trace

    parsed = parse_link(link)
    assert parsed is not None
    ctx = trace.SpanContext(parsed[0], parsed[1], is_remote=True, trace_flags=trace.TraceFlags(1))
    return trace.Link(ctx, {"migration_trace_id": f"{parsed[0]:032x}", "migration_span_id": f"{parsed[1]:016x}"})


def span_traceparent(span: Span) -> str:
    ctx = span.get_span_context()
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


def span_link(span: Span) -> str:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}-{ctx.span_id:016x}"


def add_link(span: Span, link: str | None) -> None:
    """Link ``span`` to the span a wire link names (added after the span started:
    a remote prefill finishes while ``engine.generate`` is open)."""
    if link is None or parse_link(link) is None:
        return
    otel_link = _link(link)
    span.add_link(otel_link.context, otel_link.attributes)


def fail(span: Span, kind: str, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error_kind", kind)
    span.set_status(Status(StatusCode.ERROR, message))


# ---------------------------------------------------------------------------- engine.generate


class GenerateSpan:
    """The ``engine.generate`` span of one request on a worker, fed chunk by chunk."""

    __slots__ = ("span", "started", "first_at", "last_at", "gaps", "output_tokens", "finish_reason", "_stamped")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.started = time.perf_counter()
        self.first_at: float | None = None
        self.last_at = 0.0
        self.gaps: list[float] = []
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self._stamped = False

    @classmethod
    def start(cls, request: PreprocessedRequest, role: str) -> GenerateSpan | None:
        """None when tracing is off (then the worker does no per-chunk work)."""
        links = [request.migration_link] if request.migration_link else []
        attributes: dict[str, AttrValue] = {
            "model": request.model, "input_tokens": len(request.token_ids), "disagg_role": role,
            "request_id": request.request_id,
        }  # fmt: skip
        parsed = parse_link(request.migration_link)
        if parsed is not None:
            attributes["migration_trace_id"] = f"{parsed[0]:032x}"
            attributes["migration_span_id"] = f"{parsed[1]:016x}"
        span = start_span("engine.generate", request.trace_context, "server", attributes, links)
        if span is None or not span.is_recording():  # off, or sampled out (OTEL_TRACES_SAMPLER)
            return None
        return cls(span)

    def chunk(self, chunk: OutputChunk) -> None:
        n = len(chunk.token_ids)
        if n:
            now = time.perf_counter()
            if self.first_at is None:
                self.first_at = now
                self.span.set_attribute("ttft_ms", (now - self.started) * 1000.0)
            else:
                self.gaps.append((now - self.last_at) * 1000.0)
            self.last_at = now
            self.output_tokens += n
            if not self._stamped:
                self._stamped = True
                chunk.trace_link = span_link(self.span)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason

    def failed(self, kind: str, message: str) -> None:
        fail(self.span, kind, message)

    def end(self, cancelled: bool) -> None:
        span = self.span
        span.set_attribute("output_tokens", self.output_tokens)
        span.set_attribute("finish_reason", self.finish_reason or ("cancelled" if cancelled else "error"))
        span.set_attribute("cancelled", cancelled or self.finish_reason == "cancelled")
        gaps = sorted(self.gaps)
        if gaps:
            span.set_attribute("avg_itl_ms", sum(gaps) / len(gaps))
            span.set_attribute("itl_p50_ms", _pct(gaps, 0.50))
            span.set_attribute("itl_p99_ms", _pct(gaps, 0.99))
            span.set_attribute("itl_max_ms", gaps[-1])
        span.end()


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def current_generate() -> GenerateSpan | None:
    """The ``engine.generate`` span of the request this task serves (engines add
    child spans and links to it)."""
    return _generate_span.get()


def set_current_generate(span: GenerateSpan | None) -> None:
    _generate_span.set(span)


# ---------------------------------------------------------------------------- logs


def set_log_trace_id(trace_id: str) -> None:
    """The trace id the log lines of this task carry."""
    _log_trace_id.set(trace_id)


class _TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "trace_id"):
            record.trace_id = _log_trace_id.get()
        return True


_filter = _TraceIdFilter()


def install_log_filter() -> None:
    """Every handler of the root logger stamps ``trace_id`` on its records and writes
    it (``LOG_FORMAT``)."""
    for handler in logging.getLogger().handlers:
        if _filter not in handler.filters:
            handler.addFilter(_filter)
            handler.setFormatter(logging.Formatter(LOG_FORMAT))


# ---------------------------------------------------------------------------- frontend


class RequestTrace:
    """One HTTP request's trace in the frontend: its ``traceparent`` (what workers
    continue, what the response header says) and, when recording, its root span."""

    __slots__ = ("traceparent", "span", "trace_id")

    def __init__(self, incoming: str | None, method: str, path: str, request_id: str) -> None:
        if _state.tracer is None:
            self.span: Span | None = None
            self.traceparent = new_trace(incoming)
        else:
            attributes = {"http.method": method, "http.route": path, "kvmesh.request_id": request_id}
            self.span = span = start_span(f"{method} {path}", incoming, "server", attributes)
            self.traceparent = span_traceparent(span) if span is not None else new_trace(incoming)
        self.trace_id = self.traceparent[3:35]
        _log_trace_id.set(self.trace_id)

    def end(self, status: int | str) -> None:
        """End the root span (once) with the response's status."""
        span, self.span = self.span, None
        if span is None:
            return
        code = int(status) if str(status).isdigit() else 500
        span.set_attribute("http.status_code", code)
        if code >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, f"HTTP {code}"))
        span.end()
