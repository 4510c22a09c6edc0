"""The planner's fleet in ``kvmesh run --planner``: the run's own worker supervisors.

:class:`EmbeddedFleet` is the :class:`~kvmesh.planner.service.Fleet` of the embedded
mode. It sits between the supervisors and discovery (in-process): a worker that gets
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

Lifecycle: built before the supervisors start (it hears their workers' ready and exit:
:class:`~kvmesh.worker.supervisor.WorkerEvents`); :meth:`EmbeddedFleet.attach` once the
frontend exists (it is built while the workers start) and the planner service that
plans over the fleet; :meth:`EmbeddedFleet.close` at the end of the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvmesh.errors import KvmeshError
from kvmesh.health.state import CheckKind
from kvmesh.observability.metrics import PlannerMetrics
from kvmesh.planner.core import SERVING, Observation, Role, WorkerView, worker_view
from kvmesh.planner.service import PlannerService
from kvmesh.planner.signals import Buckets, align, counter_total, gauge_total, histogram_buckets, window_quantile
from kvmesh.protocol import InstanceInfo, LoadReport
from kvmesh.runtime.distributed import DistributedRuntime, call
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import LOAD

if TYPE_CHECKING:
    from kvmesh.frontend.app import Frontend

__all__ = ["EmbeddedFleet", "Launcher", "Records"]

log = logging.getLogger("kvmesh.planner")

_decode_load = msgspec.msgpack.Decoder(LoadReport).decode
_LOAD_TIMEOUT_S = 0.5
_ROUTABLE_POLL_S = 0.002
_RETRY_S, _RETRY_MAX_S = 0.5, 10.0  # backoff of a first worker started again (doubled per failure in a row)


class Launcher(Protocol):
    """What the fleet needs of a :class:`~kvmesh.worker.supervisor.Supervisor`."""

    def launch(self) -> int:
        """Start a worker from the supervisor's template; its new id."""
        ...

    def terminate(self, worker_id: int) -> bool:
        """SIGTERM ``worker_id`` (it drains); False if it is not running."""
        ...


class Records(Protocol):
    """Where a worker's discovery record is put and deleted (what makes the frontend
    route to it): :class:`~kvmesh.assembly.records.Roster` in ``kvmesh run``."""

    async def publish(self, info: InstanceInfo) -> None: ...

    async def unpublish(self, worker_id: int) -> None: ...


@dataclass
class _Member:
    """One worker the fleet launched: its (planned) role and where it stands."""

    role: Role
    info: InstanceInfo | None = None  # set once it is ready
    published: bool = False
    vetted: bool = False  # a spare that passed its canary check
    vetted_at: float = 0.0
    vetting: bool = False
    stopping: bool = False
    load: LoadReport | None = None
    replaces: list[float] = field(default_factory=list)  # loss times this worker makes good
    first: bool = False  # one of the run's first workers (in the plan's starting sizes)
    started_at: float | None = None  # when the planner started it (its scale-up time is logged)


class EmbeddedFleet:
    """See the module docstring. ``records``: where a routable worker's record goes;
    ``roles``: the workers about to start (serving ones, then spares); ``main``: the
    supervisor of the aggregated (or decode) workers and the spares, ``prefill``: of the
    prefill workers (disaggregated runs); ``queue_tokens``: the prefill queue's depth in
    tokens (disaggregated runs)."""

    def __init__(
        self,
        records: Records,
        roles: dict[int, Role],
        main: Launcher,
        prefill: Launcher | None = None,
        queue_tokens: Callable[[], Awaitable[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        vet: Callable[[InstanceInfo], Awaitable[tuple[bool, str]]] | None = None,
    ) -> None:
        self.records = records
        self.main = main
        self.prefill = prefill
        self.queue_tokens = queue_tokens
        self.clock = clock
        self.vet_spare = vet if vet is not None else self._canary_check
        self.revet_s = 30.0  # a ready spare is canary-checked again this often (idle canaries)
        self.members: dict[int, _Member] = {wid: _Member(role, first=True) for wid, role in roles.items()}
        # set by attach(): the frontend is built while the first workers start
        self.frontend: Frontend | None = None
        self.runtime: DistributedRuntime | None = None
        self.service: PlannerService | None = None
        self.metrics: PlannerMetrics | None = None
        self._lost: list[float] = []  # serving workers lost and not yet replaced (when)
        self._moves: dict[int, int] = {}  # new worker -> the one it takes over from
        self._retrying: list[Role] = []  # first workers that failed to start, about to start again
        self._failed_in_a_row = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._settled = asyncio.Event()
        self._closing = False
        self._polling = False
        self._wired = asyncio.Event()  # set once the frontend and runtime are known
        self._last: tuple[float, Buckets, Buckets] | None = None
        self._last_counts: tuple[float, float, float, float] | None = None  # the forecast's: at, requests, tokens

    def attach(
        self, service: PlannerService, frontend: Frontend | None = None, runtime: DistributedRuntime | None = None
    ) -> None:
        """The planner that plans over this fleet (woken on a loss, its metrics), the
        frontend it observes and whose canaries vet the spares, and the runtime whose
        request plane reaches them."""
        self.service = service
        self.metrics = service.metrics
        self.frontend = frontend
        self.runtime = runtime
        self._wired.set()

    # ------------------------------------------------------------ supervisor callbacks
    async def on_ready(self, info: InstanceInfo) -> None:
        member = self.members.setdefault(info.worker_id, _Member(Role.AGGREGATED))
        member.info = info
        self._failed_in_a_row = 0
        if member.role is Role.SPARE:
            self._spawn(self._vet(info.worker_id))
        else:
            self._spawn(self._serve(info.worker_id))
        self._check_settled()

    async def on_exit(self, worker_id: int) -> None:
        member = self.members.pop(worker_id, None)
        if member is None or self._closing:
            return
        if member.published:
            await self.records.unpublish(worker_id)
        if not member.stopping and member.role in SERVING:
            self._lost.append(self.clock())
            log.warning("planner: %s worker %x lost", member.role.value, worker_id)
            if self.service is not None:
                self.service.wake()

    async def on_failed(self, worker_id: int, why: str) -> None:
        """A worker exited before it was ready: forgotten (the planner starts another at
        its next round, so a crash loop is paced by the planner's interval). One of the
        run's first workers, before the planner's first round (the plan's sizes are not
        known yet), is started again here, after a backoff. The supervisor counts the
        failed starts and gives up on a crash loop (kvmesh run exits 1 with the error)."""
        member = self.members.pop(worker_id, None)
        if member is not None:
            log.error("planner: %s worker %x failed to start: %s", member.role.value, worker_id, why)
            if member.replaces:
                self._lost[:0] = member.replaces  # still to be made good
            if member.first and not self._closing and (self.service is None or self.service.rounds == 0):
                self._retrying.append(member.role)
                self._spawn(self._start_again(member.role))
        self._check_settled()

    async def _start_again(self, role: Role) -> None:
        self._failed_in_a_row += 1
        await asyncio.sleep(min(_RETRY_S * 2 ** (self._failed_in_a_row - 1), _RETRY_MAX_S))
        self._retrying.remove(role)
        if not self._closing:
            self.members[self._supervisor(role).launch()] = _Member(role, first=True)

    # ------------------------------------------------------------ the Fleet seam
    async def settled(self) -> None:
        self._check_settled()
        await self._settled.wait()

    async def observe(self) -> Observation:
        # load reports from the last poll (at most a round old), refreshed in the
        # background: a round woken by a loss must not wait on a slow worker's answer
        if not self._polling:
            self._polling = True
            self._spawn(self._poll_loads())
        now = self.clock()
        for wid, m in self.members.items():  # idle canaries on the ready spares
            if m.role is Role.SPARE and m.vetted and not m.vetting and now - m.vetted_at >= self.revet_s:
                self._spawn(self._vet(wid))
        views, starting = [], list(self._retrying)
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
        queued = await self.queue_tokens() if self.queue_tokens is not None else 0
        interval, arrived, tokens_in, tokens_out = self._arrivals(now)
        return Observation(now, tuple(views), tuple(starting), queued, ttft, itl, level, rate, interval, arrived, tokens_in,
                           tokens_out)  # fmt: skip

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
        member = self.members[worker_id] = _Member(role, started_at=self.clock())
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
        if not self._retrying and all(m.info is not None for m in self.members.values()):
            self._settled.set()

    def _take_loss(self) -> list[float]:
        return [self._lost.pop(0)] if self._lost else []

    async def _serve(self, worker_id: int, how: str = "cold") -> None:
        """Publish the worker; once the frontend routes to it, account for the loss it
        makes good and end the move it completes."""
        member = self.members.get(worker_id)
        if member is None or member.info is None:
            return
        await self.records.publish(member.info)
        member.published = True
        await self._routable(worker_id)
        now = self.clock()
        for lost_at in member.replaces:
            seconds = now - lost_at
            log.warning("planner: worker %x routable %.3f s after the loss (%s)", worker_id, seconds, how)
            if self.metrics is not None:
                self.metrics.replacement.labels(how).observe(seconds)
        member.replaces = []
        if member.started_at is not None and how == "cold":
            log.warning("planner: worker %x routable %.3f s after its start", worker_id, now - member.started_at)
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
        if member is None or member.info is None or member.vetting:
            return
        member.vetting = True
        try:
            ok, detail = await self.vet_spare(member.info)
        finally:
            member.vetting = False
        member.vetted_at = self.clock()
        if member.role is not Role.SPARE:
            return  # promoted meanwhile: the fleet's own health checks take over
        if ok and member.vetted:
            return
        if ok:
            member.vetted = True
            log.info("planner: hot spare %x passed its canary check", worker_id)
            if self.service is not None:
                self.service.wake()  # a loss waiting for a spare can be served now
        else:
            log.warning("planner: hot spare %x failed its canary check (%s); stopping it", worker_id, detail)
            member.vetted = False
            await self.stop(worker_id)

    async def _canary_check(self, info: InstanceInfo) -> tuple[bool, str]:
        """The frontend's canaries against a worker it does not route to."""
        await self._wired.wait()  # a spare may be ready before the frontend is built
        if self.runtime is None or self.frontend is None:
            return False, "no frontend"
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
            await self.records.unpublish(worker_id)
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
        return worker_view(worker_id, m.role, routable, m.load, m.info)

    async def _poll_loads(self) -> None:
        try:
            await self._poll_loads_once()
        finally:
            self._polling = False

    async def _poll_loads_once(self) -> None:
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
        p_ttft = window_quantile(ttft[0], align(ttft0, ttft), ttft[1], 0.9) * 1000.0
        p_itl = window_quantile(itl[0], align(itl0, itl), itl[1], 0.9) * 1000.0
        done = ttft[1][-1] - align(ttft0, ttft)[-1] if ttft[1] else 0.0
        return p_ttft, p_itl, done / (now - at) if now > at else 0.0

    def _arrivals(self, now: float) -> tuple[float, int, int, int]:
        """Seconds since the last round and the requests the frontend admitted in them
        (finished + in flight: arrivals, not a request's lifetime later), their prompt
        tokens and the tokens generated (the planner's forecast input; 0s at the first)."""
        if self.frontend is None:
            return 0.0, 0, 0, 0
        m = self.frontend.metrics
        admitted = counter_total(m.requests) + gauge_total(m.inflight)
        counts = (now, admitted, counter_total(m.input_tokens), counter_total(m.output_tokens))
        last, self._last_counts = self._last_counts, counts
        if last is None or now <= last[0]:
            return 0.0, 0, 0, 0
        return now - last[0], int(counts[1] - last[1]), int(counts[2] - last[2]), int(counts[3] - last[3])

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        # the coroutine is the task (one cancelled before it ran is closed, never left unawaited)
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # logged; the next round sees the fleet as it is
            log.error("planner fleet task failed", exc_info=task.exception())

    def info_of(self, worker_id: int) -> InstanceInfo | None:
        """A running worker's card, routed to or not (a spare's KV endpoint, for the
        prefill queue: its canaries may prefill remotely)."""
        member = self.members.get(worker_id)
        return None if member is None else member.info

    async def close(self) -> None:
        self._closing = True  # the run is ending: its workers' exits are no losses
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

