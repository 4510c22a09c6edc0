"""A worker's disaggregation wiring: its role (``--mode``), the prefill queue it uses,
where it finds other workers' KV endpoints, and the run-time thresholds.

* ``aggregated`` (default) and ``decode`` workers whose engine moves KV blocks put a
  :class:`~kvmesh.disagg.engine.DisaggEngine` in front of the engine's ``generate``
  (KV migrations in, hand-offs out on drain; ``decode`` ones also put remote prefills
  on the queue). Where KV leaves the worker (``decode``: prefill workers write into
  it; ``--drain-migrate``: hand-offs) the front has a KV-transfer server, whose
  :class:`~kvmesh.protocol.KvEndpoint` goes into the worker's discovery record;
  elsewhere it opens no port. The engine itself stays the worker's engine; an
  engine without KV access gets no front.
* ``prefill`` workers run a :class:`~kvmesh.disagg.prefill.PrefillWorker` that pulls
  the queue; they register under the ``prefill`` component, so frontends never route
  requests to them.

Distributed mode uses a NATS JetStream queue and reads KV endpoints from discovery;
embedded mode (``--prefill-queue tcp://...``) asks ``kvmesh run``'s queue server for both.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.config import WorkerConfig
from kvmesh.engines.base import Engine, KvBlockAccess, LoadReporting
from kvmesh.protocol import (
    DisaggStats, DisaggThresholds, InstanceInfo, KvEndpoint, OutputChunk, PreprocessedRequest, WorkerMetrics,
)  # fmt: skip
from kvmesh.runtime.context import Context
from kvmesh.runtime.names import COMPONENT, GENERATE, PREFILL_COMPONENT

if TYPE_CHECKING:  # the disaggregation stack: imported where a worker's role uses it (wire, OnDemandFront)
    from kvmesh.disagg.engine import DisaggEngine
    from kvmesh.disagg.prefill import PrefillWorker
    from kvmesh.disagg.queue import PrefillQueue
    from kvmesh.disagg.transfer import KvTransferServer
    from kvmesh.observability.metrics_server import MetricsServer

__all__ = ["Roles", "OnDemandFront", "wire", "thresholds_key", "watch_thresholds", "put_thresholds", "serve_metrics"]

log = logging.getLogger(__name__)

_decode_info = msgspec.json.Decoder(InstanceInfo).decode
_decode_thresholds = msgspec.json.Decoder(DisaggThresholds).decode


@dataclass
class Roles:
    """What :func:`wire` built: the engine to serve, the front of its ``generate`` and
    the prefill loop if any."""

    engine: Engine
    component: str
    prefill: PrefillWorker | None = None
    queue: PrefillQueue | None = None
    closers: tuple[Callable[[], Any], ...] = ()
    disagg: DisaggEngine | OnDemandFront | None = None  # the worker service's front (GenerateFront)

    def stats(self) -> DisaggStats | None:
        if self.prefill is not None:
            return self.prefill.disagg_stats()
        return self.disagg.disagg_stats() if self.disagg is not None else None

    def kv_endpoint(self) -> KvEndpoint | None:
        return self.disagg.kv_endpoint if self.disagg is not None else None


async def wire(cfg: WorkerConfig, engine: Engine, worker_id: int, *, runtime: Any = None) -> Roles:
    """Build the worker's role around ``engine`` (``runtime`` None: static/embedded mode)."""
    if not isinstance(engine, KvBlockAccess):
        if cfg.mode != "aggregated" or cfg.drain_migrate:
            role = f"--mode {cfg.mode}" if cfg.mode != "aggregated" else "--drain-migrate"
            raise ValueError(f"{role} needs an engine that moves KV blocks (KvBlockAccess); {cfg.engine} does not")
        return Roles(engine, COMPONENT)
    if cfg.mode == "aggregated" and not _kv_leaves(cfg):
        # no KV leaves this worker: its front is built by the first request bringing KV
        return Roles(engine, COMPONENT, disagg=OnDemandFront(engine, functools.partial(_front, cfg, engine, worker_id)))
    return await _wire_disaggregated(cfg, engine, worker_id, runtime)


async def _wire_disaggregated(cfg: WorkerConfig, engine: KvBlockAccess, worker_id: int, runtime: Any) -> Roles:
    from kvmesh.disagg.prefill import KvMetadataCache, PrefillWorker
    from kvmesh.disagg.transfer import TcpKvConnector

    assert isinstance(engine, Engine)
    queue = await _queue(cfg, runtime) if cfg.mode != "aggregated" else None
    if cfg.mode == "prefill":
        assert queue is not None
        metadata = KvMetadataCache(_metadata_lookup(queue, runtime))
        worker = PrefillWorker(engine, queue, TcpKvConnector(), metadata)
        return Roles(engine, PREFILL_COMPONENT, prefill=worker, queue=queue, closers=(queue.close,))
    return Roles(engine, COMPONENT, queue=queue, disagg=_front(cfg, engine, worker_id, queue))


def _front(cfg: WorkerConfig, engine: KvBlockAccess, worker_id: int, queue: PrefillQueue | None = None) -> DisaggEngine:
    from kvmesh.disagg.engine import DisaggEngine
    from kvmesh.disagg.transfer import TcpKvConnector

    assert isinstance(engine, Engine)
    return DisaggEngine(
        engine,
        worker_id=worker_id,
        # a KV-transfer port only where KV leaves: prefill workers write into decode
        # workers; a draining worker hands its requests' KV off; --peer-fetch: peers
        # read prefixes from it (issue 33)
        transfer=_transfer_server(cfg, engine),
        connector=TcpKvConnector(),
        mode=cfg.mode,
        queue=queue,
        thresholds=DisaggThresholds(cfg.max_local_prefill_length, cfg.max_prefill_queue_size, cfg.max_prefill_queue_tokens),
        remote_timeout_s=cfg.remote_prefill_timeout_s,
    )


def _kv_leaves(cfg: WorkerConfig) -> bool:
    """Whether KV leaves this worker (its front needs a KV-transfer server)."""
    return cfg.mode == "decode" or cfg.drain_migrate or cfg.peer_fetch


def _transfer_server(cfg: WorkerConfig, engine: KvBlockAccess) -> KvTransferServer | None:
    if _kv_leaves(cfg):
        from kvmesh.disagg.transfer import KvTransferServer

        return KvTransferServer(engine, host=cfg.host, serve_prefixes=cfg.peer_fetch)
    return None


class OnDemandFront:
    """An aggregated worker's front where no KV leaves it (no ``--drain-migrate``, no
    ``--peer-fetch``): the engine's ``generate`` itself until the first request that
    brings KV with it (a migration's ``kv_source``, a peer's prefix); that request builds
    the :class:`~kvmesh.disagg.engine.DisaggEngine` (importing the disaggregation stack)
    and every request goes through it from then on. So a worker that never receives KV
    starts without that stack; one that does behaves as if it had been built at start."""

    mode = "aggregated"

    def __init__(self, engine: Engine, build: Callable[[], DisaggEngine]) -> None:
        self.inner = engine
        self.supports_guided = engine.supports_guided
        self.front: DisaggEngine | None = None
        self._build = build

    kv_endpoint: KvEndpoint | None = None  # no KV-transfer server: nothing to advertise

    def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        front = self.front
        if front is None:
            routing = request.routing
            if request.disaggregated_params is None and (routing is None or routing.peer is None):
                return self.inner.generate(request, ctx)
            front = self.front = self._build()
        return front.generate(request, ctx)

    def disagg_stats(self) -> DisaggStats:
        """The front's once built; before: nothing moved yet, the engine's blocks in use."""
        if self.front is not None:
            return self.front.disagg_stats()
        report = self.inner.load_report() if isinstance(self.inner, LoadReporting) else None
        return DisaggStats(mode=self.mode, active_blocks=report.active_blocks if report is not None else 0)

    async def open(self) -> None:
        return None  # a front built later has no server to open (no KV-transfer server)

    async def drain(self) -> None:
        if self.front is not None:
            await self.front.drain()

    async def close(self) -> None:
        if self.front is not None:
            await self.front.close()


async def _queue(cfg: WorkerConfig, runtime: Any) -> PrefillQueue:
    from kvmesh.disagg.queue import MAX_JOB_AGE_S, JetStreamPrefillQueue, RemotePrefillQueue

    if cfg.prefill_queue.startswith("tcp://"):
        return RemotePrefillQueue(cfg.prefill_queue[len("tcp://") :])
    if runtime is None:
        raise ValueError(f"a static --mode {cfg.mode} worker needs --prefill-queue tcp://host:port (kvmesh run's queue)")
    nc = runtime.nats
    if nc is None:
        nc = await runtime.connect_nats()  # with the configured credentials; closed at shutdown
    # a sealed job is opened up to max_job_age_s after it was sent: a longer remote-prefill
    # timeout (plus one redelivery after JetStream's ack wait) keeps its jobs openable
    age = max(MAX_JOB_AGE_S, cfg.remote_prefill_timeout_s + 90.0)
    return JetStreamPrefillQueue(nc, runtime.config.namespace, max_job_age_s=age)


def _metadata_lookup(queue: PrefillQueue, runtime: Any) -> Callable[[int], Any]:
    from kvmesh.disagg.queue import RemotePrefillQueue
    from kvmesh.runtime.distributed import instance_key, record_is_signed

    if runtime is None:
        assert isinstance(queue, RemotePrefillQueue)
        return queue.kv_metadata

    async def from_discovery(worker_id: int) -> KvEndpoint | None:
        key = instance_key(runtime.config.namespace, COMPONENT, GENERATE, worker_id)
        found = await runtime.discovery.get_prefix(key)
        value = found.get(key)
        if value is None:
            return None
        try:
            info = _decode_info(value)
        except msgspec.DecodeError as exc:  # data from discovery: anyone may have put it there
            log.warning("ignoring the KV endpoint in %s: not an instance record: %s", key, exc)
            return None
        if not record_is_signed(runtime.secret, key, info):
            log.warning("ignoring the KV endpoint in %s: not signed with this fleet's cluster secret", key)
            return None
        return info.kv

    return from_discovery


# ------------------------------------------------------------------ run-time thresholds


def thresholds_key(namespace: str) -> str:
    return f"/disagg/{namespace}/thresholds"


async def put_thresholds(discovery: Any, namespace: str, thresholds: DisaggThresholds) -> None:
    """Change every decode worker's thresholds (they watch this key)."""
    await discovery.put(thresholds_key(namespace), msgspec.json.encode(thresholds))


async def watch_thresholds(discovery: Any, namespace: str, engine: DisaggEngine) -> None:
    """Keep ``engine.thresholds`` equal to the discovery key (until cancelled)."""
    key = thresholds_key(namespace)
    async for event in discovery.watch_prefix(key):
        if event.key != key or event.kind != "put":
            continue
        try:
            engine.thresholds = _decode_thresholds(event.value)
            log.info("disaggregation thresholds now %s", engine.thresholds)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring bad thresholds at %s: %s", key, exc)


def start_watch(discovery: Any, namespace: str, roles: Roles) -> asyncio.Task[None] | None:
    front = roles.disagg
    if front is None or isinstance(front, OnDemandFront) or front.mode != "decode":
        return None
    return asyncio.get_running_loop().create_task(watch_thresholds(discovery, namespace, front))


# ------------------------------------------------------------------ Prometheus


_COUNTERS = {
    "remote_prefills": "prefills done by a prefill worker for this decode worker",
    "local_prefills": "prefills done here",
    "local_by_queue": "prefills done here because the prefill queue was full",
    "remote_fallbacks": "remote prefills that failed or timed out and were done here",
    "prefill_jobs_done": "prefill jobs this prefill worker completed",
    "prefill_jobs_failed": "prefill jobs this prefill worker gave up",
    "kv_bytes_sent": "KV bytes sent to other workers",
    "kv_bytes_received": "KV bytes received from other workers",
    "kv_transfer_s": "seconds spent in KV transfers this worker started",
    "kv_migrations_in": "requests resumed here with KV moved from a draining worker",
    "kv_migrations_out": "requests handed off with their KV on drain",
    "kv_migration_fallbacks": "KV migrations that fell back to re-prefill",
    "peer_fetches": "prompts whose prefix was read from a peer worker instead of prefilled",
    "peer_fetch_blocks": "KV blocks read from peer workers' prefixes",
    "peer_fetch_fallbacks": "peer fetches that failed or found fewer blocks (prefilled here)",
    "peer_prefixes_served": "prefix reads this worker answered for peers",
}


async def serve_metrics(
    roles: Roles, host: str, port: int, sample: Callable[[], WorkerMetrics] | None = None
) -> tuple[MetricsServer, int]:
    """Serve this worker's metrics for Prometheus on ``host:port`` (on this loop, token
    asked with a cluster secret: :mod:`kvmesh.observability.metrics_server`); returns
    the server and its port. ``sample``: the worker's whole metrics (engine, requests,
    disaggregation; labelled by worker), else only the disaggregation counters."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

    from kvmesh.observability.metrics_server import serve_registry
    from kvmesh.runtime import auth

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            if sample is not None:
                from kvmesh.observability.worker_metrics import families

                m = sample()
                yield from families([(f"{m.worker_id:x}", m)])
                return
            stats = roles.stats()
            if stats is None:
                return
            for name, doc in _COUNTERS.items():
                family = CounterMetricFamily(f"kvmesh_disagg_{name}", doc, labels=["mode"])
                family.add_metric([stats.mode], getattr(stats, name))
                yield family
            gauges = (
                ("queue_depth", "prefill queue depth when last asked"),
                ("queue_tokens", "tokens the prefill queue's jobs had left to prefill when last asked"),
                ("active_blocks", "KV blocks in use"),
            )
            for name, doc in gauges:
                gauge = GaugeMetricFamily(f"kvmesh_disagg_{name}", doc, labels=["mode"])
                gauge.add_metric([stats.mode], getattr(stats, name))
                yield gauge

    registry = CollectorRegistry()
    registry.register(_Collector())
    return await serve_registry(registry, host, port, auth.process_secret())
