"""A worker instance: load the model folder, start the engine, serve, drain on signal.

One start in every mode (:func:`boot`); what differs between a static worker (``kvmesh
run``'s, ``--static``) and a distributed one is its :class:`~kvmesh.worker.registration.Seat`:
its id, request server and :class:`~kvmesh.worker.registration.Registration`.

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

from kvmesh.config import RuntimeConfig, WorkerConfig
from kvmesh.engines.base import Engine
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.distributed import DistributedRuntime
from kvmesh.runtime.event_plane.base import EventPlane
from kvmesh.runtime.events import EventPublisher, NullPublisher
from kvmesh.runtime.tasks import cancel_and_wait
from kvmesh.worker.registration import READY_PREFIX, ReadyLine, Registration, Seat, publisher_on, seat_for
from kvmesh.worker.service import WorkerService

if TYPE_CHECKING:
    from kvmesh.worker.disagg import Roles

__all__ = [
    "READY_PREFIX", "build_engine", "serve", "boot", "die_with_parent", "publisher_on", "Shared", "serve_one",
    "stop_on_signals",
]  # fmt: skip

log = logging.getLogger("kvmesh.worker")


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
        served_model_name=cfg.served_model_name or model.name,
        vocab_size=model.vocab_size,
        eos_token_ids=tuple(model.eos_token_ids),
        special_token_ids=tuple(model.special_token_ids),
        context_length=model.context_length,
        worker_id=cfg.worker_id,
        block_size=cfg.block_size,
        loras=cfg.lora,
        max_loras=cfg.max_loras,
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
    and register in discovery (see :mod:`kvmesh.worker.registration`).
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
    """One worker instance until ``stop`` (or its registration is lost). ``runtime_cfg``
    None: a static seat (the READY line registers it), else a distributed runtime's
    (``runtime``: one made, not started, by the caller, e.g. one that borrows the
    process's etcd and NATS clients); ``shared``: the process's shared parts;
    ``on_ready``: called once the instance announced itself."""
    if runtime is None and runtime_cfg is not None:
        runtime = DistributedRuntime(runtime_cfg)
    await boot(cfg, seat_for(cfg, runtime, ReadyLine(ready_out, on_ready)), stop, shared)


async def boot(cfg: WorkerConfig, seat: Seat, stop: asyncio.Event, shared: Shared | None = None) -> None:
    """The one start of a worker instance, in every mode: engine, role, service, card,
    registration (:mod:`kvmesh.worker.registration`); then serve until ``stop``; then
    withdraw, step down, drain, close."""
    service: WorkerService | None = None
    roles: Roles | None = None
    registration: Registration | None = None
    try:
        await seat.open()
        service, roles, info = await _start(cfg, seat, shared)
        registration = seat.registration(roles.component)
        if not await registration.register(info, stop):
            return  # a standby stopped before it served: nothing to drain
        if shared is not None:
            shared.services.append(service)
        _begin(seat, roles)
        seat.ready(info)
        await _serve_until(stop, registration.lost)
        if registration.lost.is_set():
            log.warning("worker lease %x revoked; shutting down gracefully", seat.worker_id)
        else:
            await registration.withdraw(cfg.grace_s)
        await _step_down(cfg, roles)
    finally:
        if service is not None:
            if shared is not None and service in shared.services:
                shared.services.remove(service)
            await service.shutdown(cfg.grace_s)
        if roles is not None:
            await _close_roles(roles)
        if registration is not None:
            await registration.close()
        await seat.close()


async def _start(cfg: WorkerConfig, seat: Seat, shared: Shared | None) -> tuple[WorkerService, Roles, InstanceInfo]:
    """The engine (its KV events on the seat's publisher), its role, the service on the
    seat's request server, and the instance's card."""
    from kvmesh.worker.disagg import wire

    publisher, event_address = await seat.events(shared.plane if shared is not None else None)
    engine, model_path = build_engine(dataclasses.replace(cfg, worker_id=seat.worker_id), publisher)
    roles = await wire(cfg, engine, seat.worker_id, runtime=seat.runtime)
    server = await seat.request_server(roles.component)
    service = WorkerService(
        roles.engine, server, cfg.validate_streams, roles.stats, fault_injector(cfg, engine), roles.disagg
    )
    try:
        config = await service.start()
        if shared is not None:
            metrics = shared.metrics_address
        else:
            metrics = await _metrics(cfg, roles, service, seat.default_metrics_port)
    except BaseException:
        await service.shutdown(cfg.grace_s)
        await _close_roles(roles)
        raise
    info = seat.describe(
        server, roles.component, engine=config, model_path=model_path, event_address=event_address,
        kv=roles.kv_endpoint(), metrics_address=metrics,
    )  # fmt: skip
    service.info = info
    return service, roles, info


def _begin(seat: Seat, roles: Roles) -> None:
    """Once registered: a decode worker follows the fleet's thresholds (distributed), a
    prefill worker starts pulling."""
    from kvmesh.worker.disagg import start_watch

    runtime = seat.runtime
    watch = start_watch(runtime.discovery, runtime.config.namespace, roles) if runtime is not None else None
    if watch is not None and runtime is not None:
        runtime.add_closer(functools.partial(cancel_and_wait, watch))
    if roles.prefill is not None:
        roles.prefill.start()


async def _serve_until(stop: asyncio.Event, lost: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _metrics(cfg: WorkerConfig, roles: Roles, service: WorkerService, default_port: int | None) -> str:
    """The worker's metrics endpoint on ``--metrics-host`` (closed with its roles) and
    the address it advertises; "" without one."""
    port = cfg.metrics_port if cfg.metrics_port is not None else default_port
    if port is None:
        return ""
    from kvmesh.observability.metrics_server import advertised_address
    from kvmesh.worker.disagg import serve_metrics

    server, bound = await serve_metrics(roles, cfg.metrics_host, port, service.metrics_sample)
    roles.closers = (*roles.closers, server.close)
    return advertised_address(cfg.metrics_host, cfg.host, bound)


async def _step_down(cfg: WorkerConfig, roles: Roles) -> None:
    """Before the service drains: a prefill worker stops pulling and finishes its
    writes; with ``drain_migrate``, in-flight requests leave with their KV."""
    if roles.prefill is not None:
        await roles.prefill.stop(cfg.grace_s)
    if cfg.drain_migrate and roles.disagg is not None:
        from kvmesh.disagg.engine import DisaggEngine  # --drain-migrate's front: imported at its start

        assert isinstance(roles.disagg, DisaggEngine)
        moved = roles.disagg.hand_off_all()
        log.info("handed %d in-flight requests off with their KV", moved)


async def _close_roles(roles: Roles) -> None:
    for close in roles.closers:
        try:
            await close()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.debug("closing: %s", exc)
