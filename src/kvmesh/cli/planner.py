"""The planner's fleets: ``kvmesh run --planner`` (the run's own worker supervisor)
and ``kvmesh planner`` (distributed: signed orders in discovery, :class:`DiscoveryFleet`;
see :mod:`kvmesh.planner.orders` for the keys, the orders and the standby workers).

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
from typing import TYPE_CHECKING, Literal, Protocol

from kvmesh.config import PlannerConfig as PlannerSettings
from kvmesh.config import RunConfig, RuntimeConfig
from kvmesh.errors import KvmeshError
from kvmesh.health.canary import CanaryOutput, agree
from kvmesh.health.monitor import generate_greedy
from kvmesh.health.state import CheckKind
from kvmesh.observability.metrics import PlannerMetrics, count_discovery_refusals
from kvmesh.planner.core import SERVING, Observation, Planner, PlannerConfig, Role, WorkerView
from kvmesh.planner.orders import Order, order_key, planner_prefix, sign_order
from kvmesh.planner.service import PlannerService
from kvmesh.planner.signals import Buckets, histogram_buckets, window_quantile
from kvmesh.protocol import InstanceInfo, LoadReport
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.distributed import DistributedRuntime, call, endpoint_prefix, record_is_signed
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import COMPONENT, GENERATE, LOAD, PREFILL_COMPONENT

import msgspec

if TYPE_CHECKING:
    from kvmesh.frontend.app import Frontend

__all__ = ["EmbeddedFleet", "DiscoveryFleet", "Launcher", "planner_config", "start_embedded_planner", "run_planner"]

log = logging.getLogger("kvmesh.planner")

_decode_load = msgspec.msgpack.Decoder(LoadReport).decode
_decode_info = msgspec.json.Decoder(InstanceInfo).decode
_encode = msgspec.json.encode
_VET_PROMPT = list(range(1, 17))
_VET_TOKENS = 4
_LOGPROB_TOLERANCE = 0.5
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
    vetted_at: float = 0.0
    vetting: bool = False
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
        self.revet_s = 30.0  # a ready spare is canary-checked again this often (idle canaries)
        self.members: dict[int, _Member] = {wid: _Member(role) for wid, role in roles.items()}
        self.main: Launcher | None = None  # aggregated (or decode) workers, and the spares
        self.prefill: Launcher | None = None  # disaggregated runs: prefill workers
        self.frontend: Frontend | None = None
        self.runtime: DistributedRuntime | None = None
        self.service: PlannerService | None = None
        self.metrics: PlannerMetrics | None = None
        # the prefill queue's depth in tokens (disaggregated runs; None: not known)
        self.queue_tokens: Callable[[], Awaitable[int]] | None = None
        self._lost: list[float] = []  # serving workers lost and not yet replaced (when)
        self._moves: dict[int, int] = {}  # new worker -> the one it takes over from
        self._tasks: set[asyncio.Task[None]] = set()
        self._settled = asyncio.Event()
        self._closing = False
        self._polling = False
        self._wired = asyncio.Event()  # set once the frontend and runtime are known
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
        if member is None or self._closing:
            return
        if member.published:
            await self.unpublish_record(worker_id)
        if not member.stopping and member.role in SERVING:
            self._lost.append(self.clock())
            log.warning("planner: %s worker %x lost", member.role.value, worker_id)
            if self.service is not None:
                self.service.wake()

    async def on_failed(self, worker_id: int, why: str) -> None:
        """A worker exited before it was ready: forgotten (the planner starts another at
        its next round, so a crash loop is paced by the planner's interval)."""
        member = self.members.pop(worker_id, None)
        if member is not None:
            log.error("planner: %s worker %x failed to start: %s", member.role.value, worker_id, why)
            if member.replaces:
                self._lost[:0] = member.replaces  # still to be made good
        self._check_settled()

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
        queued = await self.queue_tokens() if self.queue_tokens is not None else 0
        return Observation(now, tuple(views), tuple(starting), queued, ttft, itl, level, rate)

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
        return _worker_view(worker_id, m.role, routable, m.load, m.info)

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

    def info_of(self, worker_id: int) -> InstanceInfo | None:
        """A running worker's card, routed to or not (a spare's KV endpoint, for the
        prefill queue: its canaries may prefill remotely)."""
        member = self.members.get(worker_id)
        return None if member is None else member.info

    def wired(self) -> None:
        """The frontend and runtime are set: spares can be canary-checked."""
        self._wired.set()

    async def close(self) -> None:
        self._closing = True  # the run is ending: its workers' exits are no losses
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class DiscoveryFleet:
    """The planner's fleet through discovery (see the module docstring)."""

    def __init__(
        self, runtime: DistributedRuntime, min_serving: int = 1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.runtime = runtime
        self.ns = runtime.config.namespace
        self.min_serving = min_serving
        self.clock = clock
        self.vetted: dict[int, bool] = {}  # standby -> its canary agreed with a serving worker
        self.promoting: dict[int, Role] = {}  # standby ordered to serve, not registered yet
        self.moves: dict[int, int] = {}  # promoted standby -> the worker it takes over from
        self.loads: dict[int, LoadReport | None] = {}
        self._poller: asyncio.Task[None] | None = None
        self._serving: dict[int, tuple[Role, InstanceInfo]] = {}
        self._standby: dict[int, InstanceInfo] = {}

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)

    async def watch_losses(self, service: PlannerService) -> None:
        """Wake the planner when a serving instance's record goes (a lost worker)."""
        prefix = endpoint_prefix(self.ns, COMPONENT, GENERATE)
        async for event in self.runtime.discovery.watch_prefix(prefix):
            if event.kind == "delete":
                service.wake()

    async def settled(self) -> None:
        """Wait until ``min_serving`` serving workers are registered (the plan's sizes)."""
        while True:
            await self._scan()
            if len(self._serving) >= self.min_serving:
                return
            await asyncio.sleep(0.2)

    async def observe(self) -> Observation:
        await self._scan()
        # loads and standby canaries in the background (a canary may take seconds): a
        # round uses what the last poll found
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        views = [self._view(w, role) for w, (role, _) in sorted(self._serving.items())]
        views += [WorkerView(w, Role.SPARE, self.vetted.get(w, False)) for w in sorted(self._standby) if w not in self.promoting]
        starting = tuple(self.promoting.values())
        return Observation(self.clock(), tuple(views), starting)

    async def promote(self, worker_id: int, role: Role) -> None:
        """Order a vetted standby of ``role``'s kind to serve: ``worker_id`` if it fits
        (a prefill standby for the prefill role, another for the rest), else another."""
        fits = self._ready_standbys(role)
        if not fits:
            raise KvmeshError(f"no vetted {role.value} standby to promote")
        chosen = worker_id if worker_id in fits else fits[0]
        await self._order(chosen, "serve", f"promoted to {role.value}")
        self.promoting[chosen] = role

    async def start(self, role: Role) -> None:
        """The planner cannot start processes here: a start promotes a ready standby."""
        if role is Role.SPARE or not self._ready_standbys(role):
            raise KvmeshError(f"no standby to start a {role.value} worker from: start `kvmesh worker --standby` processes")
        await self.promote(self._ready_standbys(role)[0], role)

    async def stop(self, worker_id: int) -> None:
        await self._order(worker_id, "stop", "planner: scale down")

    async def move(self, worker_id: int, role: Role) -> None:
        """A worker's role is fixed by its flags here: a standby of the new role is
        promoted, and ``worker_id`` is ordered to drain once that one is registered."""
        await self.start(role)
        self.moves[next(w for w, r in self.promoting.items() if r is role)] = worker_id

    def _ready_standbys(self, role: Role) -> list[int]:
        component = PREFILL_COMPONENT if role is Role.PREFILL else COMPONENT
        return [
            w for w, info in sorted(self._standby.items())
            if self.vetted.get(w) and w not in self.promoting and (info.component or COMPONENT) == component
        ]  # fmt: skip

    # ------------------------------------------------------------ steps
    async def _order(self, worker_id: int, action: Literal["serve", "stop"], reason: str) -> None:
        rt = self.runtime
        key = order_key(self.ns, worker_id)
        order = sign_order(rt.secret, key, Order(worker_id, action, time.time_ns(), reason))
        await rt.put_leased(key, _encode(order))

    async def _scan(self) -> None:
        """Serving instances and standby workers with a valid record."""
        secret = self.runtime.secret
        serving: dict[int, tuple[Role, InstanceInfo]] = {}
        for component, role in ((COMPONENT, Role.AGGREGATED), (PREFILL_COMPONENT, Role.PREFILL)):
            for key, value in (await self.runtime.discovery.get_prefix(endpoint_prefix(self.ns, component, GENERATE))).items():
                info = self._valid(secret, key, value)
                if info is not None:
                    serving[info.worker_id] = (role, info)
        if any(r is Role.PREFILL for r, _ in serving.values()):  # a disaggregated fleet: the others decode
            serving = {w: (Role.DECODE if r is Role.AGGREGATED else r, i) for w, (r, i) in serving.items()}
        standby: dict[int, InstanceInfo] = {}
        for key, value in (await self.runtime.discovery.get_prefix(f"{planner_prefix(self.ns)}standby/")).items():
            info = self._valid(secret, key, value)
            if info is not None and info.worker_id not in serving:
                standby[info.worker_id] = info
        for w in [w for w in self.promoting if w in serving or w not in standby]:
            del self.promoting[w]  # registered (or gone)
            old = self.moves.pop(w, None)
            if old is not None and w in serving:  # the move's new worker serves: the old one drains
                await self._order(old, "stop", f"moved to worker {w:x}")
        self._serving, self._standby = serving, standby
        for w in [w for w in self.vetted if w not in standby]:
            del self.vetted[w]

    @staticmethod
    def _valid(secret: ClusterSecret | None, key: str, value: bytes) -> InstanceInfo | None:
        try:
            info = _decode_info(value)
        except msgspec.DecodeError:
            return None
        return info if record_is_signed(secret, key, info) else None

    async def _poll(self) -> None:
        """Load reports of the serving workers; a canary for each standby not vetted yet."""
        async def load(worker_id: int, info: InstanceInfo) -> None:
            self.loads[worker_id] = await self._call_load(info)

        await asyncio.gather(*(load(w, i) for w, (_, i) in self._serving.items()))
        reference = next((i for _, i in self._serving.values()), None)
        pending = [i for w, i in self._standby.items() if not self.vetted.get(w)]
        if reference is not None and pending:
            await asyncio.gather(*(self._vet(i, reference) for i in pending))

    async def _call_load(self, info: InstanceInfo) -> LoadReport | None:
        client = await self.runtime.client_for(info, 2.0, 2.0)
        try:
            return await asyncio.wait_for(call(client, LOAD, decode=_decode_load), 2.0)
        except (KvmeshError, TimeoutError, OSError):
            return None
        finally:
            await client.close()

    async def _vet(self, standby: InstanceInfo, reference: InstanceInfo) -> None:
        answers = await asyncio.gather(self._greedy(standby), self._greedy(reference))
        if answers[0] is None or answers[1] is None:
            return
        ok = agree([answers[0]], [answers[1]], _LOGPROB_TOLERANCE)
        self.vetted[standby.worker_id] = ok
        if not ok:
            log.warning("standby %x answers the canary unlike serving worker %x", standby.worker_id, reference.worker_id)

    async def _greedy(self, info: InstanceInfo) -> CanaryOutput | None:
        client = await self.runtime.client_for(info, 2.0, 10.0)
        try:
            model = info.engine.served_model_name
            tokens, top = await asyncio.wait_for(generate_greedy(client, model, _VET_PROMPT, _VET_TOKENS), 10.0)
        except (KvmeshError, TimeoutError, OSError):
            return None
        finally:
            await client.close()
        return CanaryOutput(_VET_PROMPT, tokens, top)

    def _view(self, worker_id: int, role: Role) -> WorkerView:
        return _worker_view(worker_id, role, True, self.loads.get(worker_id), self._serving[worker_id][1])


def _worker_view(worker_id: int, role: Role, routable: bool, r: LoadReport | None, info: InstanceInfo | None) -> WorkerView:
    """What the planner core sees of a worker: its load report (None: none yet) and its
    card, whose ``max_num_seqs`` is the batch capacity (the full-decode-batch rule)."""
    kv = r.active_blocks / r.total_blocks if r is not None and r.total_blocks > 0 else 0.0
    capacity = info.engine.max_num_seqs if info is not None else 0
    return WorkerView(worker_id, role, routable, kv, r.num_running if r else 0, r.num_waiting if r else 0, max(0, capacity))


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
    fleet.wired()
    fleet.metrics = PlannerMetrics(frontend.metrics.registry)
    service = PlannerService(Planner(planner_config(cfg)), fleet, cfg.planner.planner_interval_s, fleet.metrics)
    fleet.service = service
    service.start()
    return service


def run_planner(settings: PlannerSettings, runtime_cfg: RuntimeConfig, log_level: str = "warning") -> int:
    """``kvmesh planner``: plan a distributed fleet until SIGTERM/SIGINT."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvmesh.cli.worker import event_loop_runner

    return event_loop_runner()(_plan_distributed(settings, runtime_cfg))


async def _plan_distributed(settings: PlannerSettings, runtime_cfg: RuntimeConfig) -> int:
    import signal

    min_workers = settings.min_workers or 1
    config = PlannerConfig(
        min_workers=min_workers,
        max_workers=max(settings.max_workers or 1024, min_workers),
        hot_spares=settings.hot_spares,
        hold_rounds=settings.planner_hold_rounds,
        cooldown_s=settings.planner_cooldown_s,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runtime = DistributedRuntime(runtime_cfg)
    await runtime.start()
    metrics = PlannerMetrics()
    count_discovery_refusals(metrics.registry, runtime.discovery.refused)
    metrics_server = None
    if settings.planner_metrics_port is not None:  # on this loop, loopback by default, token asked with a secret
        from kvmesh.observability.metrics_server import serve_registry
        from kvmesh.runtime import auth

        host, port = settings.planner_metrics_host, settings.planner_metrics_port
        metrics_server, _ = await serve_registry(metrics.registry, host, port, auth.process_secret())
    fleet = DiscoveryFleet(runtime, min_serving=min_workers)
    service = PlannerService(Planner(config), fleet, settings.planner_interval_s, metrics)
    watch = loop.create_task(fleet.watch_losses(service))
    service.start()
    print(f"kvmesh planner: planning namespace {runtime_cfg.namespace!r} ({settings.hot_spares} hot spares)", flush=True)
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
