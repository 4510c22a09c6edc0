"""A worker's metrics: counted where the worker runs ``engine.generate``, sampled from
the engine on demand, and rendered for Prometheus, labelled by worker.

* :class:`WorkerCounters`: per-request counts kept by :func:`kvmesh.engines.adapter.run_generate`
  (no per-chunk work: the terminal chunk's usage gives the token counts);
* :func:`sample`: the :class:`~kvmesh.protocol.WorkerMetrics` of one worker now (its
  ``metrics`` endpoint on the request plane);
* :func:`families`: those samples as Prometheus metric families, one ``worker`` label
  per worker: the frontend's ``/metrics`` in embedded mode (every worker), a worker's
  own ``/metrics`` in distributed mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.protocol import DisaggStats, LoadReport, OutputChunk, WorkerMetrics

if TYPE_CHECKING:
    from kvmesh.observability.metrics_core import Family

__all__ = ["WorkerCounters", "sample", "families", "render", "DISAGG_COUNTERS"]


class WorkerCounters:
    """Requests this worker served (cumulative), and those in flight."""

    __slots__ = ("requests", "in_flight", "prompt_tokens", "cached_tokens", "output_tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.in_flight = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0

    def terminal(self, chunk: OutputChunk) -> None:
        usage = chunk.usage
        if usage is not None:
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_tokens
            self.output_tokens += usage.completion_tokens


def sample(
    worker_id: int,
    report: LoadReport | None,
    counters: WorkerCounters,
    disagg: Callable[[], DisaggStats | None] | None = None,
    preemptions: int = 0,
) -> WorkerMetrics:
    """This worker's metrics now (cheap: counters and the engine's load report, None
    from an engine that reports none; the worker reads both of its engine)."""
    stats = disagg() if disagg is not None else None
    return WorkerMetrics(
        worker_id=worker_id,
        mode=stats.mode if stats is not None else "aggregated",
        running=report.num_running if report is not None else 0,
        waiting=report.num_waiting if report is not None else 0,
        kv_blocks_used=report.active_blocks if report is not None else 0,
        kv_blocks_total=report.total_blocks if report is not None else 0,
        in_flight=counters.in_flight,
        requests=counters.requests,
        prompt_tokens=counters.prompt_tokens,
        cached_tokens=counters.cached_tokens,
        output_tokens=counters.output_tokens,
        preemptions=preemptions,
        disagg=stats,
    )


# name → (kind, help, field): what every worker exports, prefixed kvmesh_worker_
_WORKER = (
    ("running_requests", "gauge", "Requests the engine is running", "running"),
    ("waiting_requests", "gauge", "Requests waiting in the engine's queue", "waiting"),
    ("kv_blocks_used", "gauge", "KV blocks in use", "kv_blocks_used"),
    ("kv_blocks_total", "gauge", "KV blocks of the engine", "kv_blocks_total"),
    ("inflight_requests", "gauge", "Streams open on the worker", "in_flight"),
    ("requests", "counter", "Requests the worker served", "requests"),
    ("prompt_tokens", "counter", "Prompt tokens of finished requests", "prompt_tokens"),
    ("prefix_cache_hit_tokens", "counter", "Prompt tokens served from the prefix cache", "cached_tokens"),
    ("output_tokens", "counter", "Generated tokens", "output_tokens"),
    ("preemptions", "counter", "Sequences preempted (KV blocks freed, recomputed later)", "preemptions"),
)

DISAGG_COUNTERS = {
    "remote_prefills": "prefills done on a prefill worker",
    "local_prefills": "prefills done here",
    "local_by_queue": "prefills done here because the prefill queue was full",
    "remote_fallbacks": "remote prefills that failed or timed out and were done here",
    "prefill_jobs_done": "prefill jobs this worker completed (prefill mode)",
    "prefill_jobs_failed": "prefill jobs this worker failed (prefill mode)",
    "kv_bytes_sent": "KV bytes sent",
    "kv_bytes_received": "KV bytes received",
    "kv_transfer_s": "seconds spent moving KV",
    "kv_migrations_in": "requests received with their KV",
    "kv_migrations_out": "requests handed off with their KV on drain",
    "kv_migration_fallbacks": "KV migrations that fell back to re-prefill",
    "peer_fetches": "prompts whose prefix was read from a peer worker instead of prefilled",
    "peer_fetch_blocks": "KV blocks read from peer workers' prefixes",
    "peer_fetch_fallbacks": "peer fetches that failed or found fewer blocks (prefilled here)",
    "peer_prefixes_served": "prefix reads this worker answered for peers",
}
_DISAGG_GAUGES = {
    "queue_depth": "prefill queue depth when last asked",
    "queue_tokens": "tokens the prefill queue's jobs had left to prefill when last asked",
    "active_blocks": "KV blocks in use",
}


def families(
    samples: Sequence[tuple[str, WorkerMetrics]], extra: Sequence[str] = (), models: Mapping[str, str] | None = None
) -> Iterator[Any]:
    """Metric families for ``(worker label, sample)`` pairs; labels ``worker``, ``role``
    and ``extra`` names (values appended by the caller in each pair's label); with
    ``models`` (worker label → its model: a frontend's view) the worker series carry a
    ``model`` label too. The families are :mod:`~kvmesh.observability.metrics_core`'s
    (``Any``: a worker's ``prometheus_client`` registry collects them as its own)."""
    from kvmesh.observability.metrics_core import counter_family, gauge_family

    labels = ["worker_id", "role"] if models is None else ["worker_id", "role", "model"]
    for name, kind, doc, attr in _WORKER:
        make = gauge_family if kind == "gauge" else counter_family
        family = make(f"kvmesh_worker_{name}", doc, labels)
        for worker, m in samples:
            values = [worker, m.mode] if models is None else [worker, m.mode, models.get(worker, "")]
            family.add_value(values, float(getattr(m, attr)))
        yield family
    with_disagg = [(w, m, m.disagg) for w, m in samples if m.disagg is not None]
    for name, doc in DISAGG_COUNTERS.items():
        counter = counter_family(f"kvmesh_disagg_{name}", doc.capitalize(), ["worker_id", "role"])
        for worker, m, d in with_disagg:
            counter.add_value([worker, m.mode], float(getattr(d, name)))
        yield counter
    for name, doc in _DISAGG_GAUGES.items():
        gauge = gauge_family(f"kvmesh_disagg_{name}", doc.capitalize(), ["worker_id", "role"])
        for worker, m, d in with_disagg:
            gauge.add_value([worker, m.mode], float(getattr(d, name)))
        yield gauge


def render(samples: Sequence[tuple[str, WorkerMetrics]], models: Mapping[str, str] | None = None) -> bytes:
    """The Prometheus text of ``samples`` (an empty list: nothing); ``models``: see
    :func:`families`. Written by :func:`kvmesh.observability.metrics_core.render` (what
    ``prometheus_client`` writes; the frontend's /metrics does not import it)."""
    if not samples:
        return b""
    from kvmesh.observability.metrics_core import render as render_text

    return render_text(_Fixed(list(families(samples, models=models))))


class _Fixed:
    def __init__(self, metrics: Iterable[Family]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterable[Family]:
        return self._metrics
