"""The worker process: load the model folder, start the engine, serve, drain on signal.

Kept light on imports (no HTTP stack, no tokenizer) so a worker is up fast.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

import msgspec

from kvmesh.config import RuntimeConfig, WorkerConfig
from kvmesh.engines.base import Engine
from kvmesh.errors import KvmeshError
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.distributed import DistributedRuntime, Endpoint
from kvmesh.runtime.event_plane.base import EventPlane
from kvmesh.runtime.events import BatchingPublisher, EventPublisher, NullPublisher
from kvmesh.runtime.tcp_server import TcpServer
from kvmesh.runtime.names import GENERATE, KV_EVENTS_TOPIC, LOAD_TOPIC
from kvmesh.worker.service import WorkerService

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

    from kvmesh.planner.orders import StandbyLink
    from kvmesh.worker.disagg import Roles

__all__ = ["READY_PREFIX", "build_engine", "serve", "die_with_parent", "event_publisher", "Shared", "serve_one", "stop_on_signals"]

log = logging.getLogger("kvmesh.worker")

READY_PREFIX = "KVMESH_READY "
UNREGISTER_GRACE_S = 0.5
UNREGISTER_TIMEOUT_S = 2.0


@dataclasses.dataclass
class Shared:
    """What the workers of one process share (``--replicas``, :mod:`kvmesh.worker.replicas`):
    the event plane (each worker still has its own publishers), the one metrics endpoint
    that serves them all, and the list of running services it reads."""

    plane: EventPlane
    metrics_address: str = ""
    services: list[WorkerService] = dataclasses.field(default_factory=list)


def build_engine(cfg: WorkerConfig, publisher: EventPublisher | None = None) -> tuple[Engine, str]:
    """The engine ``cfg`` names (through :mod:`kvmesh.engines.registry`), over the
    model folder it names (default: bundled)."""
    from kvmesh.engines.registry import EngineSpec, build
    from kvmesh.preprocess.model import bundled_model_path, load_model_folder

    model_path = cfg.model_path or str(bundled_model_path())
    model = load_model_folder(model_path)
    spec = EngineSpec(
        model_path=model_path,
        served_model_name=model.name,
        vocab_size=model.vocab_size,
        eos_token_ids=tuple(model.eos_token_ids),
        special_token_ids=tuple(model.special_token_ids),
        context_length=model.context_length,
        worker_id=cfg.worker_id,
        block_size=cfg.block_size,
    )
    return build(cfg.engine, cfg.engine_options, spec, publisher or NullPublisher()), model_path


def fault_injector(cfg: WorkerConfig, engine: Engine) -> Callable[[str], None] | None:
    """The worker's ``fault`` endpoint, where ``cfg``'s engine registered one."""
    from kvmesh.engines.registry import entry

    inject = entry(cfg.engine).inject_fault
    return None if inject is None else functools.partial(inject, engine)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (embedded mode)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


async def serve(cfg: WorkerConfig, runtime_cfg: RuntimeConfig | None = None, ready_out: TextIO = sys.stdout) -> None:
    """Serve until SIGTERM/SIGINT (or, in distributed mode, until the lease is revoked;
    an etcd outage, however long, is not a reason to stop).

    ``runtime_cfg`` None: static mode (fixed or free TCP port, no discovery; the
    embedded supervisor reads the READY line). Otherwise: join the distributed runtime
    and register in discovery.
    """
    await serve_one(cfg, runtime_cfg, stop_on_signals(), ready_out)


def stop_on_signals() -> asyncio.Event:
    """An event SIGTERM and SIGINT set (call it in the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_one(
    cfg: WorkerConfig,
    runtime_cfg: RuntimeConfig | None,
    stop: asyncio.Event,
    ready_out: TextIO,
    shared: Shared | None = None,
    runtime: DistributedRuntime | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """One worker instance until ``stop`` (or its lease is revoked). ``shared``: the
    process's shared parts; ``runtime``: a runtime made (not started) by the caller,
    e.g. one that borrows the process's etcd and NATS clients; ``on_ready``: called once
    the instance announced itself."""
    if runtime_cfg is None:
        await _serve_static(cfg, stop, ready_out, shared, on_ready)
    else:
        await _serve_distributed(cfg, runtime or DistributedRuntime(runtime_cfg), stop, ready_out, shared, on_ready)


def _announce(info: InstanceInfo, out: TextIO) -> None:
    out.write(READY_PREFIX + msgspec.json.encode(info).decode() + "\n")
    out.flush()


async def _serve_static(
    cfg: WorkerConfig, stop: asyncio.Event, ready_out: TextIO, shared: Shared | None, on_ready: Callable[[], None] | None
) -> None:
    from kvmesh.worker.disagg import wire

    if shared is None:
        plane, publisher, event_address = await event_publisher("zmq", cfg.worker_id, host=cfg.host)
    else:
        plane = shared.plane
        publisher, event_address = await publisher_on(plane, cfg.worker_id)
    engine, model_path = build_engine(cfg, publisher)
    roles = await wire(cfg, engine, cfg.worker_id)
    service = WorkerService(
        roles.engine, TcpServer(cfg.host, cfg.port), cfg.validate_streams, roles.stats, fault_injector(cfg, engine),
        roles.disagg,
    )
    try:
        config = await service.start()
        info = InstanceInfo(
            cfg.worker_id,
            service.address,
            config,
            model_path,
            os.getpid(),
            component=roles.component,
            endpoint=GENERATE,
            event_address=event_address,
            kv=roles.kv_endpoint(),
            metrics_address=shared.metrics_address if shared is not None else await _metrics(cfg, roles, service),
        )
        service.info = info
        if shared is not None:
            shared.services.append(service)
        if roles.prefill is not None:
            roles.prefill.start()
        _announce(info, ready_out)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        log.info("worker %d draining", cfg.worker_id)
        await _step_down(cfg, roles)
    finally:
        if shared is not None and service in shared.services:
            shared.services.remove(service)
        await service.shutdown(cfg.grace_s)
        await _close_roles(roles)
        if shared is None:
            await plane.close()


async def _metrics(
    cfg: WorkerConfig, roles: Roles, service: WorkerService | None = None, default_port: int | None = None
) -> str:
    """The worker's metrics endpoint on ``--metrics-host`` (closed with its roles) and
    the address it advertises; "" without one."""
    port = cfg.metrics_port if cfg.metrics_port is not None else default_port
    if port is None:
        return ""
    from kvmesh.observability.metrics_server import advertised_address
    from kvmesh.worker.disagg import serve_metrics

    sample = service.metrics_sample if service is not None else None  # the whole worker's metrics
    server, bound = await serve_metrics(roles, cfg.metrics_host, port, sample)
    roles.closers = (*roles.closers, server.close)
    return advertised_address(cfg.metrics_host, cfg.host, bound)


async def _step_down(cfg: WorkerConfig, roles: Roles) -> None:
    """Before the service drains: a prefill worker stops pulling and finishes its
    writes; with ``drain_migrate``, in-flight requests leave with their KV."""
    if roles.prefill is not None:
        await roles.prefill.stop(cfg.grace_s)
    if cfg.drain_migrate and roles.disagg is not None:
        moved = roles.disagg.hand_off_all()
        log.info("handed %d in-flight requests off with their KV", moved)


async def _close_roles(roles: Roles) -> None:
    for close in roles.closers:
        try:
            await close()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.debug("closing: %s", exc)


async def _serve_distributed(
    cfg: WorkerConfig,
    runtime: DistributedRuntime,
    stop: asyncio.Event,
    ready_out: TextIO,
    shared: Shared | None,
    on_ready: Callable[[], None] | None,
) -> None:
    from kvmesh.worker.disagg import start_watch, wire

    await runtime.start()
    service: WorkerService | None = None
    roles: Roles | None = None
    try:
        rc = runtime.config
        if shared is None:
            plane, publisher, event_address = await event_publisher(
                rc.event_plane, runtime.lease_id, nats=runtime.nats, namespace=rc.namespace, host=rc.host
            )
            runtime.add_closer(plane.close)
        else:
            publisher, event_address = await publisher_on(shared.plane, runtime.lease_id)
        # KV events name the worker by its lease id, as the routers know it
        engine, model_path = build_engine(dataclasses.replace(cfg, worker_id=runtime.lease_id), publisher)
        roles = await wire(cfg, engine, runtime.lease_id, runtime=runtime)
        endpoint = runtime.namespace().component(roles.component).endpoint(GENERATE)
        server = await runtime.request_server(roles.component)
        service = WorkerService(
            roles.engine, server, cfg.validate_streams, roles.stats, fault_injector(cfg, engine), roles.disagg
        )
        config = await service.start()
        info = endpoint.describe(server, engine=config, model_path=model_path, event_address=event_address)
        metrics = shared.metrics_address if shared is not None else await _metrics(cfg, roles, service, default_port=0)
        info = msgspec.structs.replace(info, kv=roles.kv_endpoint(), metrics_address=metrics)
        service.info = info
        link = None
        if cfg.standby:  # a hot spare: offered, checked, routed to only once the planner orders it
            _announce(info, ready_out)
            if on_ready is not None:
                on_ready()  # started: waiting for the planner is no part of a replica's start
            link = await _stand_by(runtime, info, stop)
            if link is None:
                return
        await endpoint.register(info)
        if link is not None:
            await link.withdraw()  # after registering: the planner never sees it in neither place
            obey = asyncio.ensure_future(_obey_stop(link, stop))
            runtime.add_closer(functools.partial(_close_link, link, obey))
        if shared is not None:
            shared.services.append(service)
        watch = start_watch(runtime.discovery, rc.namespace, roles)
        if watch is not None:
            runtime.add_closer(lambda: _cancel(watch))
        if roles.prefill is not None:
            roles.prefill.start()
        if link is None:
            _announce(info, ready_out)
        if on_ready is not None:
            on_ready()
        lost = asyncio.ensure_future(runtime.lease_lost.wait())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([lost, stopped], return_when=asyncio.FIRST_COMPLETED)
        lost.cancel()
        stopped.cancel()
        if runtime.lease_lost.is_set():
            log.warning("worker lease %x revoked; shutting down gracefully", runtime.lease_id)
        else:
            await _unregister(endpoint)
            # routers that have not seen the removal yet may still pick us: keep serving
            await asyncio.sleep(min(cfg.grace_s, UNREGISTER_GRACE_S))
        await _step_down(cfg, roles)
    finally:
        if service is not None:
            if shared is not None and service in shared.services:
                shared.services.remove(service)
            await service.shutdown(cfg.grace_s)
        if roles is not None:
            await _close_roles(roles)
        await runtime.shutdown()


async def _stand_by(runtime: DistributedRuntime, info: InstanceInfo, stop: asyncio.Event) -> StandbyLink | None:
    """Offer this worker as a standby until the planner orders it to serve (the link,
    which keeps delivering orders) or it is stopped: an order, a signal, its lease (None)."""
    from kvmesh.planner.orders import StandbyLink

    link = StandbyLink(runtime, info)
    await link.offer()
    log.info("worker %x standing by", info.worker_id)
    order = asyncio.ensure_future(link.next_order())
    others = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(runtime.lease_lost.wait())]
    await asyncio.wait([order, *others], return_when=asyncio.FIRST_COMPLETED)
    for w in (order, *others):
        w.cancel()
    if order.cancelled() or not order.done() or order.exception() is not None:
        await link.close()
        return None
    if order.result().action == "serve":
        log.warning("worker %x promoted by the planner", info.worker_id)
        return link
    await link.close()  # "stop": never served, nothing to drain
    return None


async def _obey_stop(link: StandbyLink, stop: asyncio.Event) -> None:
    """A serving worker that came from standby drains when the planner says stop."""
    while (await link.next_order()).action != "stop":
        pass
    stop.set()


async def _close_link(link: StandbyLink, obey: asyncio.Future[None]) -> None:
    obey.cancel()
    await asyncio.gather(obey, return_exceptions=True)
    await link.close()


async def _unregister(endpoint: Endpoint) -> None:
    """Leave discovery before draining; bounded, since etcd may be out of reach (the
    record then goes with the lease, revoked or expiring, after the drain)."""
    try:
        await asyncio.wait_for(endpoint.unregister(), UNREGISTER_TIMEOUT_S)
    except (KvmeshError, TimeoutError) as exc:
        log.warning("could not unregister before draining (%s); the lease takes the record with it", exc)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def event_publisher(
    kind: str, publisher_id: int, *, nats: NatsClient | None = None, namespace: str = "kvmesh", host: str = "127.0.0.1"
) -> tuple[EventPlane, EventPublisher, str]:
    """A worker's KV events and load reports onto an event plane; returns the plane (to
    close), the engine-facing publisher and the address subscribers connect to."""
    from kvmesh.runtime.event_plane import make_event_plane

    plane = make_event_plane(kind, nats_client=nats, namespace=namespace, host=host)
    publisher, address = await publisher_on(plane, publisher_id)
    return plane, publisher, address


async def publisher_on(plane: EventPlane, publisher_id: int) -> tuple[EventPublisher, str]:
    """A worker's own KV event and load report publishers on ``plane``; returns the
    engine-facing publisher and the address subscribers connect to."""
    kv = await plane.publisher(KV_EVENTS_TOPIC, publisher_id)
    load = await plane.publisher(LOAD_TOPIC, publisher_id)
    # the KV events of one engine step (one turn of the loop) leave in one envelope
    publisher = BatchingPublisher(kv.publish, load.publish, asyncio.get_running_loop().call_soon)
    return publisher, kv.address
