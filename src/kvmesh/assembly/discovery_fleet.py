"""The planner's fleet in ``kvmesh planner`` (distributed): it observes through
discovery and acts through its actuators (:mod:`kvmesh.planner.actuators`): signed
orders to standby workers (see :mod:`kvmesh.planner.orders` for the keys, the orders
and the standby workers), and with ``--worker-flags`` local ``kvmesh worker``
processes it starts and stops itself.

:class:`DiscoveryFleet` observes the instances (serving: ``backend``; prefill:
``prefill``), the standby workers and their load reports; a standby is vetted by a
greedy canary whose answer must agree with a serving worker's (tokens and top
log-probability). A start promotes a vetted standby when there is one, else starts a
process (when an actuator can); a stop goes to the actuator that owns the worker; a
move starts a worker in the new role and stops the old one once a new worker of that
role is registered.

Each round it also reads the frontends' signed reports (:mod:`kvmesh.planner.reports`):
the round's arrivals (requests the frontends admitted) with their tokens, and the TTFT
and ITL p90 of the round, so the core's latency rules and, with a capacity profile, its
forecast have what ``kvmesh run --planner`` reads from its own frontend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence

import msgspec

from kvmesh.errors import KvmeshError
from kvmesh.health.canary import CanaryOutput, agree
from kvmesh.health.monitor import generate_greedy
from kvmesh.planner.core import Observation, Role, WorkerView, worker_view
from kvmesh.planner.actuators import Actuator, StandbyActuator
from kvmesh.planner.orders import planner_prefix
from kvmesh.planner.reports import FrontendReport, read_reports, totals_of
from kvmesh.planner.service import PlannerService
from kvmesh.planner.signals import Totals, Window, window
from kvmesh.protocol import InstanceInfo, LoadReport
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.distributed import DistributedRuntime, call, endpoint_prefix, record_is_signed
from kvmesh.runtime.names import COMPONENT, GENERATE, LOAD, PREFILL_COMPONENT

__all__ = ["DiscoveryFleet"]

log = logging.getLogger("kvmesh.planner")

_decode_load = msgspec.msgpack.Decoder(LoadReport).decode
_decode_info = msgspec.json.Decoder(InstanceInfo).decode
_encode = msgspec.json.encode
_VET_PROMPT = list(range(1, 17))
_VET_TOKENS = 4
_LOGPROB_TOLERANCE = 0.5


class DiscoveryFleet:
    """The planner's fleet through discovery (see the module docstring)."""

    def __init__(
        self,
        runtime: DistributedRuntime,
        min_serving: int = 1,
        clock: Callable[[], float] = time.monotonic,
        actuators: Sequence[Actuator] = (),
    ) -> None:
        self.runtime = runtime
        self.ns = runtime.config.namespace
        self.min_serving = min_serving
        self.clock = clock
        self.vetted: dict[int, bool] = {}  # standby -> its canary agreed with a serving worker
        self.standbys = StandbyActuator(runtime, self._ready_standbys)
        # start: the first that can (a warm standby first); stop: the first that owns the
        # worker (the process actuators first: a signed stop order is the fallback)
        self.actuators: tuple[Actuator, ...] = (self.standbys, *actuators)
        self._stoppers: tuple[Actuator, ...] = (*actuators, self.standbys)
        self.moves: list[tuple[Role, int]] = []  # (new role, the worker to stop once a new one serves in it)
        self.loads: dict[int, LoadReport | None] = {}
        self._poller: asyncio.Task[None] | None = None
        self._serving: dict[int, tuple[Role, InstanceInfo]] = {}
        self._standby: dict[int, InstanceInfo] = {}
        self._reports: dict[int, FrontendReport] = {}  # the newest report of each frontend
        self._totals: tuple[float, dict[int, Totals]] | None = None  # the last round's (when, totals)

    @property
    def promoting(self) -> dict[int, Role]:
        """Standbys ordered to serve, not registered yet."""
        return self.standbys.promoting

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for actuator in self.actuators:
            await actuator.close()

    async def watch_losses(self, service: PlannerService) -> None:
        """Wake the planner when a serving instance's record goes (a lost worker)."""
        prefix = endpoint_prefix(self.ns, COMPONENT, GENERATE)
        async for event in self.runtime.discovery.watch_prefix(prefix):
            if event.kind == "delete":
                service.wake()

    async def settled(self) -> None:
        """Wait until ``min_serving`` serving workers are registered (the plan's sizes);
        an actuator that starts processes starts the missing ones first."""
        await self._scan()
        present = self._serving.keys() | self._standby.keys()
        on_the_way = sum(len(a.starting(present)) for a in self.actuators)
        for _ in range(self.min_serving - len(self._serving) - on_the_way):
            try:
                await self.start(Role.AGGREGATED)
            except KvmeshError:
                break  # standbys only: wait for workers started elsewhere
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
        present = self._serving.keys() | self._standby.keys()
        starting = tuple(role for a in self.actuators for role in a.starting(present))
        now = self.clock()
        interval, w = await self._frontend_window(now)
        rate = w.finished / interval if interval > 0 else 0.0
        return Observation(now, tuple(views), starting, 0, w.ttft_p90_ms, w.itl_p90_ms, 0, rate, interval, w.arrived,
                           w.input_tokens, w.output_tokens)  # fmt: skip

    async def promote(self, worker_id: int, role: Role) -> None:
        """Order a vetted standby of ``role``'s kind to serve (see StandbyActuator.promote)."""
        await self.standbys.promote(worker_id, role)

    async def start(self, role: Role) -> None:
        """A ready standby promoted, else a process started (an actuator that can)."""
        actuator = next((a for a in self.actuators if a.can_start(role)), None)
        if actuator is None:
            hint = "start `kvmesh worker --standby` processes, or give kvmesh planner --worker-flags"
            raise KvmeshError(f"no standby to start a {role.value} worker from: {hint}")
        await actuator.start(role)

    async def stop(self, worker_id: int) -> None:
        actuator = next(a for a in self._stoppers if a.owns(worker_id))
        await actuator.stop(worker_id)

    async def move(self, worker_id: int, role: Role) -> None:
        """Drain + start: a worker in ``role`` is started (a standby promoted, or a
        process), and ``worker_id`` is stopped once a new worker serves in that role."""
        await self.start(role)
        self.moves.append((role, worker_id))

    async def _frontend_window(self, now: float) -> tuple[float, Window]:
        """Seconds since the last round and what the frontends counted in them (nothing
        at the first round, or when discovery did not answer)."""
        try:
            reports = await asyncio.wait_for(read_reports(self.runtime), 2.0)
        except (KvmeshError, TimeoutError, OSError) as exc:
            log.warning("planner: frontend reports not read: %s", exc)
            return 0.0, Window()
        for frontend, report in reports.items():  # an older report (a replayed one) never replaces a newer
            last = self._reports.get(frontend)
            if last is None or report.seq >= last.seq:
                self._reports[frontend] = report
        self._reports = {f: r for f, r in self._reports.items() if f in reports}
        totals = {f: totals_of(r) for f, r in self._reports.items()}
        last_round, self._totals = self._totals, (now, totals)
        if last_round is None or now <= last_round[0]:
            return 0.0, Window()
        return now - last_round[0], window(last_round[1], totals)

    def _ready_standbys(self, role: Role) -> list[int]:
        component = PREFILL_COMPONENT if role is Role.PREFILL else COMPONENT
        return [
            w for w, info in sorted(self._standby.items())
            if self.vetted.get(w) and (info.component or COMPONENT) == component
        ]  # fmt: skip

    # ------------------------------------------------------------ steps
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
        self.standbys.seen(serving, standby)
        await self._end_moves([(r, w) for w, (r, _) in serving.items() if w not in self._serving])
        self._serving, self._standby = serving, standby
        for w in [w for w in self.vetted if w not in standby]:
            del self.vetted[w]

    async def _end_moves(self, newcomers: list[tuple[Role, int]]) -> None:
        """A move ends when a new worker serves in its role: the old one drains."""
        for role, new in newcomers:
            old = next((m for m in self.moves if m[0] is role), None)
            if old is not None:
                self.moves.remove(old)
                log.warning("planner: worker %x serves as %s: stopping worker %x (moved)", new, role.value, old[1])
                try:
                    await self.stop(old[1])
                except KvmeshError as exc:
                    log.warning("planner: worker %x not stopped: %s", old[1], exc.message)

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
        return worker_view(worker_id, role, True, self.loads.get(worker_id), self._serving[worker_id][1])
