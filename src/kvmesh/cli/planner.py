"""``kvmesh run --planner``: the planner acting on the run's own worker supervisor.

:class:`EmbeddedFleet` is the :class:`~kvmesh.planner.service.Fleet` of the embedded
mode. It sits between the supervisor and discovery (in-process): a worker that gets
ready is published (routable) unless it is a hot spare; a spare is canary-checked
(:meth:`~kvmesh.health.monitor.HealthMonitor.vet`) and held back, ready to be
published the moment a serving worker is lost. The supervisor does not restart
workers under the planner: a lost worker wakes the planner at once, which promotes a
ready spare (or, without one, starts a replacement) and starts a new spare in the
background. The time from the loss to the replacement being routable in the
frontend is exported (``kvmesh_planner_replacement_seconds{how=promote|cold}``) and
logged.

What it observes (each round): every worker's role, readiness, health weight and load
report (KV use, running, waiting); TTFT and ITL p90 over the last round from the
frontend's histograms; the request rate; the degradation level.

Disaggregated runs: a spare is a decode worker (a prefill worker would pull from the
queue); promoting into the prefill role starts a prefill worker instead. A move
(``MOVE``) starts a worker in the new role and, once it is routable, drains and stops
the old one (SIGTERM: drain with the KV hand-off), so no request is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.config import RunConfig
from kvmesh.errors import KvmeshError
from kvmesh.frontend.app import Frontend
from kvmesh.health.state import CheckKind
from kvmesh.observability.metrics import PlannerMetrics
from kvmesh.planner.core import SERVING, Observation, Planner, PlannerConfig, Role, WorkerView
from kvmesh.planner.service import PlannerService
from kvmesh.planner.signals import Buckets, histogram_buckets, window_quantile
from kvmesh.protocol import InstanceInfo, LoadReport
from kvmesh.runtime.distributed import DistributedRuntime, call
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import LOAD

import msgspec

__all__ = ["EmbeddedFleet", "Launcher", "planner_config", "start_embedded_planner"]

log = logging.getLogger("kvmesh.planner")

_decode_load = msgspec.msgpack.Decoder(LoadReport).decode
_LOAD_TIMEOUT_S = 0.5
_ROUTABLE_POLL_S = 0.002


class Launcher(Protocol):
    """What the fleet needs of a :class:`~kvmesh.worker.supervisor.Supervisor`."""

    def launch(self) -> int:
        """Start a worker from the supervisor's template; its new id."""
        ...

    def terminate(self, worker_id: int) -> bool:
        """SIGTERM ``worker_id`` (it drains); False if it is not running."""
        ...


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
    )


@dataclass
class _Member:
    """One worker the fleet launched: its (planned) role and where it stands."""

    role: Role
    info: InstanceInfo | None = None  # set once it is ready
    published: bool = False
    vetted: bool = False  # a spare that passed its canary check
    stopping: bool = False
    load: LoadReport | None = None
    replaces: list[float] = field(default_factory=list)  # loss times this worker makes good


class EmbeddedFleet:
    """See the module docstring. ``publish`` / ``unpublish`` put and delete a worker's
    discovery record (what makes the frontend route to it)."""

    def __init__(
        self,
        publish: Callable[[InstanceInfo], Awaitable[None]],
        unpublish: Callable[[int], Awaitable[None]],
        roles: dict[int, Role],
        clock: Callable[[], float] = time.monotonic,
        vet: Callable[[InstanceInfo], Awaitable[tuple[bool, str]]] | None = None,
    ) -> None:
        self.publish_record = publish
        self.unpublish_record = unpublish
        self.clock = clock
        self.vet_spare = vet if vet is not None else self._canary_check
        self.members: dict[int, _Member] = {wid: _Member(role) for wid, role in roles.items()}
        self.main: Launcher | None = None  # aggregated (or decode) workers, and the spares
        self.prefill: Launcher | None = None  # disaggregated runs: prefill workers
        self.frontend: Frontend | None = None
        self.runtime: DistributedRuntime | None = None
        self.service: PlannerService | None = None
        self.metrics: PlannerMetrics | None = None
        self._lost: list[float] = []  # serving workers lost and not yet replaced (when)
        self._moves: dict[int, int] = {}  # new worker -> the one it takes over from
        self._tasks: set[asyncio.Task[None]] = set()
        self._settled = asyncio.Event()
        self._last: tuple[float, Buckets, Buckets] | None = None

    # ------------------------------------------------------------ supervisor callbacks
    async def on_ready(self, info: InstanceInfo) -> None:
        member = self.members.setdefault(info.worker_id, _Member(Role.AGGREGATED))
        member.info = info
        if member.role is Role.SPARE:
            self._spawn(self._vet(info.worker_id))
        else:
            self._spawn(self._serve(info.worker_id))
        self._check_settled()

    async def on_exit(self, worker_id: int) -> None:
        member = self.members.pop(worker_id, None)
        if member is None:
            return
        if member.published:
            await self.unpublish_record(worker_id)
        if not member.stopping and member.role in SERVING:
            self._lost.append(self.clock())
            log.warning("planner: %s worker %x lost", member.role.value, worker_id)
            if self.service is not None:
                self.service.wake()

    # ------------------------------------------------------------ the Fleet seam
    async def settled(self) -> None:
        self._check_settled()
        await self._settled.wait()

    async def observe(self) -> Observation:
        await self._poll_loads()
        now = self.clock()
        views, starting = [], []
        for wid, m in sorted(self.members.items()):
            if m.stopping:
                continue
            if m.info is None or (m.role in SERVING and not m.published):
                starting.append(m.role)
                continue
            views.append(self._view(wid, m))
        ttft, itl, rate = self._latencies(now)
        level = 0
        if self.frontend is not None and self.frontend.registry.shedder is not None:
            level = int(self.frontend.registry.shedder.controller.level)
        return Observation(now, tuple(views), tuple(starting), 0, ttft, itl, level, rate)

    async def promote(self, worker_id: int, role: Role) -> None:
        member = self.members.get(worker_id)
        if member is None or member.role is not Role.SPARE or not member.vetted:
            raise KvmeshError(f"worker {worker_id:x} is not a ready spare")
        if role is Role.PREFILL:  # a spare is a decode worker: a prefill one starts cold
            await self.start(role)
            return
        member.role = role
        member.replaces = self._take_loss()
        await self._serve(worker_id, how="promote")

    async def start(self, role: Role) -> None:
        worker_id = self._supervisor(role).launch()
        member = self.members[worker_id] = _Member(role)
        if role in SERVING:
            member.replaces = self._take_loss()
        log.warning("planner: starting worker %x as %s", worker_id, role.value)

    async def stop(self, worker_id: int) -> None:
        member = self.members.get(worker_id)
        if member is None:
            return
        member.stopping = True
        self._spawn(self._drain(worker_id, member))

    async def move(self, worker_id: int, role: Role) -> None:
        """Start the worker for ``role``; the old one drains once the new is routable."""
        new = self._supervisor(role).launch()
        self.members[new] = _Member(role)
        self._moves[new] = worker_id

    # ------------------------------------------------------------ steps
    def _supervisor(self, role: Role) -> Launcher:
        supervisor = self.prefill if role is Role.PREFILL else self.main
        if supervisor is None:
            raise KvmeshError(f"this run has no {role.value} workers to start")
        return supervisor

    def _check_settled(self) -> None:
        if all(m.info is not None for m in self.members.values()):
            self._settled.set()

    def _take_loss(self) -> list[float]:
        return [self._lost.pop(0)] if self._lost else []

    async def _serve(self, worker_id: int, how: str = "cold") -> None:
        """Publish the worker; once the frontend routes to it, account for the loss it
        makes good and end the move it completes."""
        member = self.members.get(worker_id)
        if member is None or member.info is None:
            return
        await self.publish_record(member.info)
        member.published = True
        await self._routable(worker_id)
        now = self.clock()
        for lost_at in member.replaces:
            seconds = now - lost_at
            log.warning("planner: worker %x routable %.3f s after the loss (%s)", worker_id, seconds, how)
            if self.metrics is not None:
                self.metrics.replacement.labels(how).observe(seconds)
        member.replaces = []
        old = self._moves.pop(worker_id, None)
        if old is not None:
            await self.stop(old)

    async def _routable(self, worker_id: int, timeout_s: float = 30.0) -> None:
        """Wait until the frontend has attached the worker (discovery → watch → router)."""
        if self.frontend is None:
            return
        registry = self.frontend.registry
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            if any(i.worker_id == worker_id for i in registry.workers()):
                return
            await asyncio.sleep(_ROUTABLE_POLL_S)

    async def _vet(self, worker_id: int) -> None:
        """Canary-check a spare before it counts as ready; a failing spare is stopped
        (the planner starts another)."""
        member = self.members.get(worker_id)
        if member is None or member.info is None:
            return
        ok, detail = await self.vet_spare(member.info)
        if ok:
            member.vetted = True
            log.info("planner: hot spare %x passed its canary check", worker_id)
            if self.service is not None:
                self.service.wake()  # a loss waiting for a spare can be served now
        else:
            log.warning("planner: hot spare %x failed its canary check (%s); stopping it", worker_id, detail)
            await self.stop(worker_id)

    async def _canary_check(self, info: InstanceInfo) -> tuple[bool, str]:
        """The frontend's canaries against a worker it does not route to."""
        if self.runtime is None or self.frontend is None:
            return False, "no frontend yet"
        client = await self.runtime.client_for(info)
        try:
            health = self.frontend.registry.health
            if health is not None:
                result = await health.vet(Instance(info, client))
                return result.ok, f"{result.kind.value} {result.detail}"
            report = await asyncio.wait_for(call(client, LOAD, decode=_decode_load), 10.0)
            return report is not None, "load report"
        except (KvmeshError, TimeoutError, OSError) as exc:
            return False, f"{CheckKind.ERROR.value} {exc}"
        finally:
            await client.close()

    async def _drain(self, worker_id: int, member: _Member) -> None:
        """Out of routing first (no new requests), then SIGTERM: the worker drains."""
        if member.published:
            member.published = False
            await self.unpublish_record(worker_id)
        for supervisor in (self.main, self.prefill):
            if supervisor is not None and supervisor.terminate(worker_id):
                return

    # ------------------------------------------------------------ signals
    def _view(self, worker_id: int, m: _Member) -> WorkerView:
        if m.role is Role.SPARE:
            routable = m.vetted
        else:
            weight = self.frontend.registry.weight(worker_id) if self.frontend is not None else 1.0
            routable = m.published and weight > 0
        r = m.load
        kv = r.active_blocks / r.total_blocks if r is not None and r.total_blocks > 0 else 0.0
        return WorkerView(worker_id, m.role, routable, kv, r.num_running if r else 0, r.num_waiting if r else 0)

    async def _poll_loads(self) -> None:
        if self.frontend is None:
            return
        instances = {i.worker_id: i for i in self.frontend.registry.workers()}

        async def one(worker_id: int, member: _Member) -> None:
            instance = instances.get(worker_id)
            if instance is None:
                return
            try:
                member.load = await asyncio.wait_for(call(instance.client, LOAD, decode=_decode_load), _LOAD_TIMEOUT_S)
            except (KvmeshError, TimeoutError, OSError):
                member.load = None

        await asyncio.gather(*(one(w, m) for w, m in list(self.members.items()) if m.published))

    def _latencies(self, now: float) -> tuple[float, float, float]:
        """TTFT p90 (ms), ITL p90 (ms) and requests per second since the last round."""
        if self.frontend is None:
            return 0.0, 0.0, 0.0
        m = self.frontend.metrics
        ttft, itl = histogram_buckets(m.ttft), histogram_buckets(m.itl)
        last, self._last = self._last, (now, ttft, itl)
        if last is None:
            return 0.0, 0.0, 0.0
        at, ttft0, itl0 = last
        p_ttft = window_quantile(ttft[0], _align(ttft0, ttft), ttft[1], 0.9) * 1000.0
        p_itl = window_quantile(itl[0], _align(itl0, itl), itl[1], 0.9) * 1000.0
        done = ttft[1][-1] - _align(ttft0, ttft)[-1] if ttft[1] else 0.0
        return p_ttft, p_itl, done / (now - at) if now > at else 0.0

    def _spawn(self, coro: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception:  # noqa: BLE001 - logged; the next round sees the fleet as it is
                log.exception("planner fleet task failed")

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _align(before: Buckets, now: Buckets) -> tuple[float, ...]:
    """``before``'s counts on ``now``'s bounds (a label set that appeared since: 0)."""
    counts = dict(zip(*before))
    return tuple(counts.get(b, 0.0) for b in now[0])


def start_embedded_planner(
    cfg: RunConfig, fleet: EmbeddedFleet, frontend: Frontend, runtime: DistributedRuntime
) -> PlannerService:
    """Wire the fleet to the running frontend and start planning."""
    fleet.frontend = frontend
    fleet.runtime = runtime
    fleet.metrics = PlannerMetrics(frontend.metrics.registry)
    service = PlannerService(Planner(planner_config(cfg)), fleet, cfg.planner.planner_interval_s, fleet.metrics)
    fleet.service = service
    service.start()
    return service
