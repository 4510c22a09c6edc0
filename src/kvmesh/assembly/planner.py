"""The planner's wiring: over the embedded run's fleet (``kvmesh run --planner``), or
over a distributed fleet through discovery (``kvmesh planner``)."""

from __future__ import annotations

import asyncio
import shlex
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvmesh.assembly.discovery_fleet import DiscoveryFleet
from kvmesh.assembly.embedded_fleet import EmbeddedFleet, Launcher, Records
from kvmesh.assembly.records import PREFILL_FIRST_ID
from kvmesh.config import PlannerConfig as PlannerSettings
from kvmesh.config import RunConfig, RuntimeConfig
from kvmesh.observability.metrics import PlannerMetrics, count_discovery_refusals
from kvmesh.observability.metrics_server import MetricsServer, serve_registry
from kvmesh.errors import KvmeshError
from kvmesh.planner.actuators import Actuator, ProcessActuator
from kvmesh.planner.core import Planner, PlannerConfig, Role
from kvmesh.planner.profile import load_profile
from kvmesh.planner.service import PlannerService
from kvmesh.runtime import auth
from kvmesh.runtime.distributed import DistributedRuntime
from kvmesh.settings import settings_of
from kvmesh.worker.registration import READY_PREFIX

if TYPE_CHECKING:
    from kvmesh.frontend.app import Frontend

__all__ = [
    "planner_config", "planned_roles", "embedded_fleet", "plan_embedded", "plan_distributed", "runtime_env",
    "process_actuators", "distributed_config",
]  # fmt: skip


def planner_config(cfg: RunConfig) -> PlannerConfig:
    """The core's configuration from ``kvmesh run``'s flags and the frontend's SLOs."""
    p = cfg.planner
    start = cfg.decode_workers + cfg.prefill_workers if cfg.disaggregated else cfg.workers
    min_workers = p.min_workers if p.min_workers is not None else start
    max_workers = p.max_workers if p.max_workers is not None else start + p.hot_spares
    return PlannerConfig(
        min_workers=min_workers,
        max_workers=max(max_workers, min_workers),
        hot_spares=p.hot_spares,
        slo_ttft_ms=cfg.frontend.slo_ttft_ms,
        slo_itl_ms=cfg.frontend.slo_tpot_ms,
        hold_rounds=p.planner_hold_rounds,
        cooldown_s=p.planner_cooldown_s,
        profile=load_profile(p.capacity_profile) if p.capacity_profile else None,
        headroom=p.planner_headroom,
    )


def planned_roles(cfg: RunConfig) -> dict[int, Role]:
    """The planner's view of the run's workers about to start: serving ones, then spares."""
    spares = cfg.planner.hot_spares
    if cfg.disaggregated:
        roles = {i: Role.DECODE for i in range(cfg.decode_workers)}
        roles.update({cfg.decode_workers + i: Role.SPARE for i in range(spares)})
        roles.update({PREFILL_FIRST_ID + i: Role.PREFILL for i in range(cfg.prefill_workers)})
    else:
        roles = {i: Role.AGGREGATED for i in range(cfg.workers)}
        roles.update({cfg.workers + i: Role.SPARE for i in range(spares)})
    return roles


def embedded_fleet(
    cfg: RunConfig,
    records: Records,
    main: Launcher,
    prefill: Launcher | None,
    queue_tokens: Callable[[], Awaitable[int]] | None,
) -> EmbeddedFleet:
    """The planner's fleet over the run's supervisors, its workers in their planned roles."""
    return EmbeddedFleet(records, planned_roles(cfg), main, prefill, queue_tokens)


def plan_embedded(cfg: RunConfig, fleet: EmbeddedFleet, frontend: Frontend, runtime: DistributedRuntime) -> PlannerService:
    """Plan over the run's fleet, observed through its frontend (metrics in the
    frontend's registry); started."""
    metrics = PlannerMetrics(frontend.metrics.registry)
    service = PlannerService(Planner(planner_config(cfg)), fleet, cfg.planner.planner_interval_s, metrics)
    fleet.attach(service, frontend, runtime)
    service.start()
    return service


async def plan_distributed(settings: PlannerSettings, runtime_cfg: RuntimeConfig) -> int:
    """``kvmesh planner``: plan a distributed fleet until SIGTERM/SIGINT."""
    config = distributed_config(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runtime = DistributedRuntime(runtime_cfg)
    await runtime.start()
    metrics = PlannerMetrics()
    count_discovery_refusals(metrics.registry, runtime.discovery.refused)
    metrics_server: MetricsServer | None = None
    if settings.planner_metrics_port is not None:  # on this loop, loopback by default, token asked with a secret
        host, port = settings.planner_metrics_host, settings.planner_metrics_port
        metrics_server, _ = await serve_registry(metrics.registry, host, port, auth.process_secret())
    fleet = DiscoveryFleet(runtime, min_serving=config.min_workers, actuators=process_actuators(settings, runtime_cfg, config))
    service = PlannerService(Planner(config), fleet, settings.planner_interval_s, metrics)
    watch = loop.create_task(fleet.watch_losses(service))
    service.start()
    starts = "starting local workers" if settings.worker_flags else "promoting standbys"
    sizing = f"sizing from {settings.capacity_profile}" if config.profile is not None else "no capacity profile"
    print(f"kvmesh planner: planning namespace {runtime_cfg.namespace!r} ({settings.hot_spares} hot spares,"
          f" {config.min_workers}..{config.max_workers} workers, {starts}, {sizing})", flush=True)  # fmt: skip
    try:
        await stop.wait()
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await service.close()
        await fleet.close()
        if metrics_server is not None:
            await metrics_server.close()
        await runtime.shutdown()
    return 0


def distributed_config(settings: PlannerSettings) -> PlannerConfig:
    """``kvmesh planner``'s core configuration. With ``--capacity-profile`` it sizes
    from the frontends' arrivals and holds the profile's SLOs (the ones it was measured
    at); without, the core's default SLOs judge the frontends' TTFT/ITL."""
    min_workers = settings.min_workers or 1
    profile = load_profile(settings.capacity_profile) if settings.capacity_profile else None
    config = PlannerConfig(
        min_workers=min_workers,
        max_workers=max(settings.max_workers or 1024, min_workers),
        hot_spares=settings.hot_spares,
        hold_rounds=settings.planner_hold_rounds,
        cooldown_s=settings.planner_cooldown_s,
        profile=profile,
        headroom=settings.planner_headroom,
    )
    return config if profile is None else replace(config, slo_ttft_ms=profile.slo_ttft_ms, slo_itl_ms=profile.slo_itl_ms)


def process_actuators(settings: PlannerSettings, runtime_cfg: RuntimeConfig, config: PlannerConfig) -> tuple[Actuator, ...]:
    """With ``--worker-flags``: the actuator that starts and stops local ``kvmesh worker``
    processes (with those flags, in this planner's runtime), at most ``max_workers``."""
    if not settings.worker_flags:
        return ()
    try:
        flags = shlex.split(settings.worker_flags)
    except ValueError as exc:
        raise KvmeshError(f"--worker-flags does not split like a shell line: {exc}") from exc
    return (ProcessActuator(flags, runtime_env(runtime_cfg), READY_PREFIX, max_processes=config.max_workers),)


def runtime_env(cfg: RuntimeConfig) -> dict[str, str]:
    """``cfg`` as the environment variables of its settings (a started worker joins the
    same fleet: namespace, discovery, planes, host, lease)."""
    env = {}
    for f, meta in settings_of(RuntimeConfig):
        value = getattr(cfg, f.name)
        if meta.env and value not in ("", None):
            env[meta.env] = ",".join(value) if isinstance(value, tuple) else str(value)
    return env
