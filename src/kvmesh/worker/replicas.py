"""Many workers in one process (``kvmesh worker --replicas N``, ``kvmesh run
--workers-per-process K``), so one host can hold a fleet of simulated workers.

Each replica is a full instance, as if it were its own process: its own lease (or,
embedded, its own supervisor record), discovery record, request-plane endpoint (TCP
port or NATS subject), KV event and load report publishers, engine and worker id.
What they share is what a process has once:

* the event loop, the interpreter and the modules;
* distributed: one discovery client (one etcd gRPC channel; etcd keeps any number of
  leases over one connection, each with its own keep-alive) and one NATS connection,
  lent to every replica's runtime (:class:`~kvmesh.runtime.distributed.SharedClients`);
* one event plane object (zmq: one context and its I/O thread; each replica binds its
  own PUB sockets; nats: the shared connection, one subject per topic);
* one Prometheus endpoint for the metrics of all replicas (labelled by worker id), and
  every replica's record names it.

Replicas start in waves (at most ``STARTING_AT_ONCE`` at a time), so each lease is
kept alive from the moment it is granted.

Signals stop all replicas (each drains as a single worker does). A replica whose lease
is revoked steps down alone; the process exits when the last replica has ended. A
replica that fails to start stops the others and the process reports its error, as a
single worker would (a supervisor then replaces the whole process).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, TextIO

from kvmesh.config import RuntimeConfig, WorkerConfig
from kvmesh.runtime.distributed import DistributedRuntime, SharedClients
from kvmesh.runtime.event_plane import make_event_plane
from kvmesh.worker.main import Shared, serve_one, stop_on_signals

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["serve", "serve_replicas", "replica_config"]

log = logging.getLogger("kvmesh.worker")

STARTING_AT_ONCE = 64  # replicas starting at the same time (the others wait their turn)


def replica_config(cfg: WorkerConfig, index: int) -> WorkerConfig:
    """Replica ``index``'s own config: worker id ``worker_id + index``, port ``port +
    index`` (0 stays 0: any free port); the process serves the metrics."""
    port = cfg.port + index if cfg.port else 0
    return dataclasses.replace(cfg, replicas=1, worker_id=cfg.worker_id + index, port=port, metrics_port=None)


async def serve(cfg: WorkerConfig, runtime_cfg: RuntimeConfig | None = None, ready_out: TextIO = sys.stdout) -> None:
    """:func:`kvmesh.worker.main.serve` for ``cfg.replicas`` workers: until SIGTERM/SIGINT."""
    await serve_replicas(cfg, runtime_cfg, stop_on_signals(), ready_out)


async def serve_replicas(cfg: WorkerConfig, rcfg: RuntimeConfig | None, stop: asyncio.Event, ready_out: TextIO) -> None:
    """Serve ``cfg.replicas`` workers until ``stop`` (see the module docstring)."""
    if cfg.port and cfg.port + cfg.replicas - 1 > 65535:
        raise ValueError(f"--port {cfg.port} leaves no room for {cfg.replicas} replicas (ports port..port+N-1)")
    if rcfg is None:
        shared = Shared(make_event_plane("zmq", host=cfg.host))
        try:
            async with _metrics_served(shared, cfg, cfg.metrics_port, cfg.host):
                await _run_all(cfg, None, stop, ready_out, shared, None)
        finally:
            await shared.plane.close()
        return
    clients = await SharedClients.connect(rcfg)
    try:
        plane = make_event_plane(rcfg.event_plane, nats_client=clients.nats, namespace=rcfg.namespace, host=rcfg.host)
        shared = Shared(plane)
        try:
            port = cfg.metrics_port if cfg.metrics_port is not None else 0  # distributed workers always serve metrics
            async with _metrics_served(shared, cfg, port, rcfg.host):
                await _run_all(cfg, rcfg, stop, ready_out, shared, clients)
        finally:
            await plane.close()
    finally:
        await clients.close()


async def _run_all(
    cfg: WorkerConfig,
    rcfg: RuntimeConfig | None,
    stop: asyncio.Event,
    ready_out: TextIO,
    shared: Shared,
    clients: SharedClients | None,
) -> None:
    starting = asyncio.Semaphore(STARTING_AT_ONCE)

    async def one(i: int) -> None:
        """Replica ``i``, once fewer than STARTING_AT_ONCE others are starting: a lease
        granted at the start of a start that waits behind hundreds of others could
        expire before its record is put (seen with 1,250 replicas on a loaded host)."""
        await starting.acquire()
        released = False

        def ready() -> None:
            nonlocal released
            if not released:
                released = True
                starting.release()

        try:
            if stop.is_set():
                return
            runtime = None
            if rcfg is not None and clients is not None:
                runtime = DistributedRuntime(rcfg, clients.discovery, nats=clients.nats, borrowed=True)
            await serve_one(replica_config(cfg, i), rcfg, stop, ready_out, shared, runtime, ready)
        finally:
            ready()

    tasks = [asyncio.ensure_future(one(i)) for i in range(cfg.replicas)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in done if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            log.error("a replica failed; stopping the other %d", len(tasks) - 1)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            failed.result()  # raises its error: the process reports it as a worker's
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def _metrics_served(shared: Shared, cfg: WorkerConfig, port: int | None, host: str) -> AsyncIterator[None]:
    """One Prometheus endpoint for every running replica, on ``--metrics-host``, its
    address in ``shared`` (none when ``port`` is None; ``host``: the one advertised
    when bound to every interface), closed on the way out."""
    if port is None:
        yield
        return
    from prometheus_client import CollectorRegistry

    from kvmesh.observability.metrics_server import advertised_address, serve_registry
    from kvmesh.observability.worker_metrics import families
    from kvmesh.runtime import auth

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            samples = [service.metrics_sample() for service in list(shared.services)]
            yield from families([(f"{m.worker_id:x}", m) for m in samples])

    registry = CollectorRegistry()
    registry.register(_Collector())
    server, bound = await serve_registry(registry, cfg.metrics_host, port, auth.process_secret())
    shared.metrics_address = advertised_address(cfg.metrics_host, host, bound)
    try:
        yield
    finally:
        await server.close()
