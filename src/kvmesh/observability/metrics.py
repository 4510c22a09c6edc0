"""Every metric kvmesh exports, defined in one place.

The frontend's metrics live in their own registry (no process-wide globals), exposed
at ``GET /metrics``; registry, types and text are :mod:`kvmesh.observability.metrics_core`'s
(what ``prometheus_client`` writes, without importing it). Per-model children are
resolved once per model and cached, so the hot path never looks up labels.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence

from kvmesh.observability.metrics_core import (
    CONTENT_TYPE,
    Counter,
    Family,
    Gauge,
    Histogram,
    MetricsRegistry,
    counter_family,
    gauge_family,
    go_float,
    histogram_family,
    render,
)

# the registries, metric types and text exposition are kvmesh's own (metrics_core):
# the frontend does not import prometheus_client (issue 36), and writes the same text
CONTENT_TYPE_LATEST = CONTENT_TYPE

__all__ = ["FrontendMetrics", "ModelMetrics", "RouterMetrics", "PlannerMetrics", "CONTENT_TYPE_LATEST", "count_discovery_refusals",
           "export_tenant_usage", "LoopHistogram", "LoopBuckets", "LoopCounter", "LoopValue"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


# fine below 1 ms, where decisions are expected (bench/fleet.py reads p50/p99 from them)
# (fine between 0.25 and 2.5 ms, where a p99 against a 1 ms goal falls: a quantile is
# interpolated within its bucket, and a 1-2.5 ms bucket made any p99 past 1 ms read ~2 ms)
_DECISION_BUCKETS = (
    0.00002, 0.00005, 0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.0004, 0.0005, 0.0006, 0.00075, 0.001,
    0.00125, 0.0015, 0.002, 0.0025, 0.005, 0.01, 0.025,
)  # fmt: skip
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class LoopBuckets:
    """One label set of a :class:`LoopHistogram`: plain (non-cumulative) bucket counts
    and a sum, with no lock: observed and read on the event loop's thread only."""

    __slots__ = ("counts", "sum", "_bounds")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # le: a value on a bound counts in its bucket
        self.sum += value

    def observe_many(self, value: float, n: int) -> None:
        """``n`` observations of ``value`` (tokens that arrived together)."""
        self.counts[bisect_left(self._bounds, value)] += n
        self.sum += value * n


class LoopHistogram:
    """A histogram exported like ``prometheus_client.Histogram`` (same name, samples and
    labels) for the request path's per-token and per-request latencies: an observation
    is a bisect and two additions, where ``Histogram.observe`` takes two locks (issue
    36). Not thread-safe: every observation and every scrape is on the event loop."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: MetricsRegistry) -> None:  # fmt: skip
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._les = [go_float(b) for b in self.bounds] + ["+Inf"]  # the ``le`` label as Histogram writes it
        self._children: dict[tuple[str, ...], LoopBuckets] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopBuckets:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            child = self._children[values] = LoopBuckets(self.bounds)
        return child

    def collect(self) -> Iterator[Family]:
        family = histogram_family(self.name, self.documentation, self.labelnames)
        for values, child in self._children.items():
            total = 0
            cumulative = []
            for le, count in zip(self._les, child.counts):
                total += count
                cumulative.append((le, float(total)))
            family.add_buckets(values, cumulative, child.sum)
        yield family

    def describe(self) -> Iterator[Family]:
        yield histogram_family(self.name, self.documentation, self.labelnames)


class LoopValue:
    """One label set of a :class:`LoopCounter`: a number, with no lock (loop thread only)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount


class LoopCounter:
    """A counter (or, ``gauge=True``, a gauge) exported like ``prometheus_client``'s
    (same name, samples and labels), for the values every request changes: ``inc`` is
    an addition where ``Counter.inc`` takes a lock (issue 36). Not thread-safe: every
    change and every scrape is on the event loop."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: MetricsRegistry,
                 gauge: bool = False) -> None:  # fmt: skip
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._family = gauge_family if gauge else counter_family
        self._children: dict[tuple[str, ...], LoopValue] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopValue:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            child = self._children[values] = LoopValue()
        return child

    def collect(self) -> Iterator[Family]:
        family = self._family(self.name, self.documentation, self.labelnames)
        for values, child in self._children.items():
            family.add_value(values, child.value)
        yield family

    def describe(self) -> Iterator[Family]:
        yield self._family(self.name, self.documentation, self.labelnames)


class RouterMetrics:
    """The KV router's metrics for one model (children bound once)."""

    def __init__(self, parent: FrontendMetrics, model: str) -> None:
        self.decision_seconds = parent.router_decision.labels(model)
        self.decision_cpu_seconds = parent.router_decision_cpu.labels(model)
        self.overlap = parent.router_overlap.labels(model)
        self.events_applied = parent.router_events.labels(model)
        self.event_gaps = parent.router_gaps.labels(model)
        self.shard_late = parent.router_shard_late.labels(model)
        self.queue_depth = parent.router_queue.labels(model)
        self.rejected = parent.router_rejected.labels(model)
        self.block_size_mismatch = parent.router_block_mismatch.labels(model)
        self.repairs = {m: parent.router_repairs.labels(model, m) for m in ("buffer", "dump")}
        self.event_backlog = parent.router_backlog.labels(model)
        self.events_dropped = parent.router_inbox_dropped.labels(model)
        self._events_rejected = parent.router_events_rejected
        self._model = model

    def event_rejected(self, reason: str) -> None:
        """One KV event skipped: ``reason`` is a short fixed label (see router/service.py)."""
        self._events_rejected.labels(self._model, reason).inc()


class ModelMetrics:
    """The per-model children of the frontend's metrics."""

    __slots__ = (
        "inflight",
        "ttft",
        "itl",
        "duration",
        "input_tokens",
        "output_tokens",
        "_requests",
        "_finished",
        "_model",
        "_decisions",
        "_routed",
        "cached_tokens",
        "router",
        "_migrations",
        "_migration_duration",
    )

    def __init__(self, parent: FrontendMetrics, model: str) -> None:
        self._model = model
        self._requests = parent.requests
        self._finished: dict[tuple[str, str], LoopValue] = {}
        self.inflight = parent.inflight.labels(model)
        self.ttft = parent.ttft.labels(model)
        self.itl = parent.itl.labels(model)
        self.duration = parent.duration.labels(model)
        self.input_tokens = parent.input_tokens.labels(model)
        self.output_tokens = parent.output_tokens.labels(model)
        self._decisions = parent.decisions
        self._routed: dict[int, LoopValue] = {}
        self.cached_tokens = parent.cached_tokens.labels(model)
        self.router = RouterMetrics(parent, model)
        self._migrations = parent.migrations
        self._migration_duration = parent.migration_duration

    def migrated(self, method: str, source: str = "", target: str = "") -> None:
        """One request moved (seed 003: by method, with source and target worker)."""
        self._migrations.labels(self._model, method, source, target).inc()

    def migration_took(self, method: str, seconds: float) -> None:
        self._migration_duration.labels(method).observe(seconds)

    def routed(self, worker_id: int) -> None:
        child = self._routed.get(worker_id)
        if child is None:
            child = self._routed[worker_id] = self._decisions.labels(self._model, f"{worker_id:x}")
        child.inc()

    def finished(self, endpoint: str, status: str) -> None:
        child = self._finished.get((endpoint, status))
        if child is None:
            child = self._finished[(endpoint, status)] = self._requests.labels(self._model, endpoint, status)
        child.inc()


class _DiscoveryRefusals:
    """``kvmesh_discovery_records_refused_total{reason}``, read from a discovery
    backend's counts at each scrape (runtime/discovery/base.py: the read bounds)."""

    def __init__(self, refused: Mapping[str, int]) -> None:
        self.refused = refused

    def collect(self) -> Iterator[Family]:
        family = counter_family(
            "kvmesh_discovery_records_refused",
            "Discovery records refused before they were decoded: too_large (a value over the bound), too_many (a prefix"
            " past its count of records)",
            ["reason"],
        )
        for reason, count in sorted(self.refused.items()):
            family.add_value([reason], count)
        yield family

    def describe(self) -> Iterator[Family]:  # its name, so a second registration is refused
        return self.collect()


class _TenantUsage:
    """Per-tenant usage (issue 30), read from the frontend's tenant limiter at each scrape:
    ``read()`` gives ``{tenant: {field: count}}``, tenant names from the keys file (never a
    key), at most a bounded number of them (the rest folded into ``other`` by the reader)."""

    _FIELDS = (
        ("requests", "kvmesh_tenant_requests", "Requests admitted, by tenant (API keys file)"),
        ("prompt_tokens", "kvmesh_tenant_prompt_tokens", "Prompt tokens of finished requests, by tenant"),
        ("completion_tokens", "kvmesh_tenant_completion_tokens", "Tokens generated for finished requests, by tenant"),
    )

    def __init__(self, read: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Family]:
        usage = self.read()
        for field, name, doc in self._FIELDS:
            family = counter_family(name, doc, ["tenant"])
            for tenant, counts in sorted(usage.items()):
                family.add_value([tenant], counts[field])
            yield family
        limited = counter_family(
            "kvmesh_tenant_rate_limited", "Requests refused with 429, by tenant and limit", ["tenant", "limit"]
        )
        inflight = gauge_family("kvmesh_tenant_inflight_requests", "Requests being served, by tenant", ["tenant"])
        for tenant, counts in sorted(usage.items()):
            for limit in ("requests", "tokens", "concurrent"):
                limited.add_value([tenant, limit], counts[f"limited_{limit}"])
            inflight.add_value([tenant], counts["in_flight"])
        yield limited
        yield inflight

    def describe(self) -> Iterator[Family]:
        return self.collect()


def export_tenant_usage(registry: MetricsRegistry, read: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
    """Export per-tenant usage (``read``: see :class:`_TenantUsage`) in ``registry``."""
    registry.register(_TenantUsage(read))


def count_discovery_refusals(registry: MetricsRegistry, refused: Mapping[str, int]) -> None:
    """Export ``refused`` (a discovery backend's ``refused``) in ``registry``, once."""
    try:
        registry.register(_DiscoveryRefusals(refused))
    except ValueError:  # "duplicated timeseries": exported already (one discovery per process)
        pass


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = MetricsRegistry()
        r = self.registry
        # changed by every request, on the loop: lock-free (LoopCounter, LoopHistogram)
        self.requests = LoopCounter(
            "kvmesh_frontend_requests", "Requests by model, endpoint and final status", ["model", "endpoint", "status"], r
        )
        self.inflight = LoopCounter("kvmesh_frontend_inflight_requests", "Requests being served", ["model"], r, gauge=True)
        # observed on every request (ITL: every token) from the loop: lock-free (LoopHistogram)
        self.ttft = LoopHistogram(
            "kvmesh_frontend_time_to_first_token_seconds", "Time to first token", ["model"], _LATENCY_BUCKETS, r
        )
        self.itl = LoopHistogram(
            "kvmesh_frontend_inter_token_latency_seconds", "Time between output tokens", ["model"], _ITL_BUCKETS, r
        )
        self.duration = LoopHistogram(
            "kvmesh_frontend_request_duration_seconds", "Whole request time", ["model"], _DURATION_BUCKETS, r
        )
        self.input_tokens = LoopCounter("kvmesh_frontend_input_tokens", "Prompt tokens", ["model"], r)
        self.output_tokens = LoopCounter("kvmesh_frontend_output_tokens", "Generated tokens", ["model"], r)
        self.disconnects = Counter("kvmesh_frontend_client_disconnects", "Streams the client left early", registry=r)
        self.decisions = LoopCounter("kvmesh_router_decisions", "Requests routed, by worker (hex lease id)", ["model", "worker"], r)
        self.cached_tokens = LoopCounter("kvmesh_frontend_cached_tokens", "Prompt tokens served from the prefix cache", ["model"], r)
        # observed once per KV decision, on the loop: LoopHistogram (issue 36, KV mode)
        self.router_decision = LoopHistogram(
            "kvmesh_router_decision_seconds", "Time to make one routing decision", ["model"], _DECISION_BUCKETS, r
        )
        self.router_decision_cpu = LoopHistogram(
            "kvmesh_router_decision_cpu_seconds",
            "CPU time of one routing decision (this thread's; without the time other processes held the core)",
            ["model"], _DECISION_BUCKETS, r,
        )  # fmt: skip
        self.router_overlap = LoopHistogram(
            "kvmesh_router_overlap_ratio", "Share of the prompt the chosen worker had cached", ["model"], _RATIO_BUCKETS, r
        )
        self.router_events = LoopCounter("kvmesh_router_kv_events_applied", "KV events applied to the index", ["model"], r)
        self.router_events_rejected = Counter(
            "kvmesh_router_kv_events_rejected",
            "KV events skipped: undecodable, invalid, or from a publisher that is not the worker they name",
            ["model", "reason"],
            registry=r,
        )
        self.router_gaps = Counter("kvmesh_router_kv_event_gaps", "Gaps detected in workers' KV event ids", ["model"], registry=r)
        self.router_shard_late = Counter(
            "kvmesh_router_shard_late_answers", "Overlap queries a KV index shard did not answer in time (--router-shards)",
            ["model"], registry=r,
        )  # fmt: skip
        self.router_repairs = Counter(
            "kvmesh_router_kv_repairs", "Index repairs by method (buffer or dump)", ["model", "method"], registry=r
        )
        self.router_backlog = Gauge(
            "kvmesh_router_kv_event_backlog", "KV events received and not yet applied (the router's inbox)", ["model"],
            registry=r,
        )  # fmt: skip
        self.router_inbox_dropped = Gauge(
            "kvmesh_router_kv_events_dropped", "KV events dropped on arrival since start: the router's inbox was full"
            " (each later shows as a gap, repaired)", ["model"], registry=r,
        )  # fmt: skip
        self.router_queue = Gauge("kvmesh_router_queue_depth", "Requests waiting for admission", ["model"], registry=r)
        self.router_rejected = Counter("kvmesh_router_rejected", "Requests refused: admission queue full", ["model"], registry=r)
        self.router_block_mismatch = Counter(
            "kvmesh_router_block_size_mismatch", "Workers refused: KV block size differs from the router's", ["model"], registry=r
        )
        self.migrations = Counter(
            "kvmesh_migration", "Requests moved to another worker after a mid-stream failure, by method, source and target worker",
            ["model", "method", "source", "target"], registry=r,
        )
        self.check_duration = Histogram(
            "kvmesh_health_check_duration_seconds", "Canary checks by worker, type and result",
            ["worker_id", "check_type", "result"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.worker_status = Gauge(
            "kvmesh_worker_status", "Health: 0 healthy, 1 suspicious, 2 unhealthy, 3 draining, 4 dead", ["worker_id"], registry=r
        )
        self.breaker_state = Gauge(
            "kvmesh_circuit_breaker_state", "Circuit breaker: 0 closed, 1 open, 2 half-open", ["worker_id"], registry=r
        )
        self.health_transitions = Counter(
            "kvmesh_health_transitions", "Worker health status changes, by worker, new status and cause",
            ["worker_id", "to", "cause"], registry=r,
        )  # fmt: skip
        self.canary_wait = Histogram(
            "kvmesh_health_canary_wait_seconds", "Canary time to first token (queueing + its own prefill), not judged",
            ["worker_id"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.shed = Counter("kvmesh_frontend_shed", "Requests refused by graceful degradation, by tier", ["priority"], registry=r)
        self.degradation_level = Gauge("kvmesh_degradation_level", "0 normal … 4 reject new requests", registry=r)
        self.migration_duration = Histogram(
            "kvmesh_migration_duration_seconds", "From a worker failing mid-stream to the next worker's first token",
            ["method"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.workers = Gauge("kvmesh_frontend_workers", "Live worker instances", ["model"], registry=r)
        self._models: dict[str, ModelMetrics] = {}

    def model(self, name: str) -> ModelMetrics:
        m = self._models.get(name)
        if m is None:
            m = self._models[name] = ModelMetrics(self, name)
        return m

    def render(self) -> bytes:
        return render(self.registry)


_REPLACE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class PlannerMetrics:
    """The planner's decisions and their inputs (``kvmesh run --planner``: in the
    frontend's registry, at its ``/metrics``; ``kvmesh planner``: its own)."""

    def __init__(self, registry: MetricsRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else MetricsRegistry()
        self.decisions = Counter(
            "kvmesh_planner_decisions", "Planner decisions by action and role", ["action", "role"], registry=r
        )
        self.pressure = Gauge("kvmesh_planner_pressure", "The planner's last prefill / decode pressure (1: at the SLO)",
                              ["side"], registry=r)  # fmt: skip
        self.inputs = Gauge("kvmesh_planner_input", "What the planner's last round saw", ["signal"], registry=r)
        self.workers = Gauge("kvmesh_planner_workers", "Workers by role as the planner saw them (spare: ready)",
                             ["role"], registry=r)  # fmt: skip
        self.replacement = Histogram(
            "kvmesh_planner_replacement_seconds",
            "From a serving worker's loss to its replacement being routable (promote: a hot spare; cold: a new start)",
            ["how"], buckets=_REPLACE_BUCKETS, registry=r,
        )  # fmt: skip
        self.failed = Counter("kvmesh_planner_actions_failed", "Planner actions that could not be carried out",
                              ["action"], registry=r)  # fmt: skip

    def render(self) -> bytes:
        return render(self.registry)
