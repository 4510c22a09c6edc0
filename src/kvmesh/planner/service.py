"""The planner's async glue: one round per interval (or at once when the fleet reports
a loss), each round an :class:`~kvmesh.planner.core.Observation` in, the pure core's
:class:`~kvmesh.planner.core.Plan` out, every action logged with its inputs, counted
in the metrics and carried out through a :class:`Fleet`.

Two fleets implement the seam: ``kvmesh run --planner`` acts on the run's worker
supervisors (:mod:`kvmesh.assembly.embedded_fleet`), ``kvmesh planner`` through signed orders in
discovery (:mod:`kvmesh.planner.orders`). Neither blocks a round for long: a start is
launched, a drain runs in the fleet's own task.

Lifecycle: ``start()`` (after the fleet has settled: :meth:`Fleet.settled`), rounds
until ``close()``; :meth:`PlannerService.wake` asks for a round now (a worker died).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.errors import KvmeshError
from kvmesh.observability.metrics import PlannerMetrics
from kvmesh.planner.core import SERVING, Action, ActionKind, Observation, Plan, Planner, Role

__all__ = ["Fleet", "PlannerService", "Decision"]

log = logging.getLogger("kvmesh.planner")

_REPEAT_LOG_S = 60.0


class Fleet(Protocol):
    """What the planner sees of a fleet and how it acts on it. The action methods
    return once the action is under way (a started worker reports ready later)."""

    async def settled(self) -> None:
        """Return once the fleet's first workers are up (the plan's starting sizes)."""
        ...

    async def observe(self) -> Observation:
        """The fleet now (``now_s`` on the planner's clock)."""
        ...

    async def promote(self, worker_id: int, role: Role) -> None:
        """Make the ready spare ``worker_id`` a routable worker in ``role``."""
        ...

    async def start(self, role: Role) -> None:
        """Start a worker for ``role`` (SPARE: a hot spare, checked, not routed to)."""
        ...

    async def stop(self, worker_id: int) -> None:
        """Take ``worker_id`` out of routing, drain it (no request lost), stop it."""
        ...

    async def move(self, worker_id: int, role: Role) -> None:
        """Drain ``worker_id`` and bring it back in ``role``."""
        ...


@dataclass(frozen=True, slots=True)
class Decision:
    """One carried-out action, for the log and ``history``."""

    at_s: float
    action: Action
    ok: bool


class PlannerService:
    def __init__(
        self,
        planner: Planner,
        fleet: Fleet,
        interval_s: float,
        metrics: PlannerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.planner = planner
        self.fleet = fleet
        self.interval_s = interval_s
        self.metrics = metrics
        self.clock = clock
        self.history: collections.deque[Decision] = collections.deque(maxlen=256)
        self.rounds = 0
        self._wake = asyncio.Event()
        self._said: dict[str, float] = {}  # refused actions last logged (when)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        """Plan now (a worker was lost: its replacement must not wait an interval)."""
        self._wake.set()

    async def _run(self) -> None:
        await self.fleet.settled()
        while True:
            try:
                await self.round()
            except Exception:  # noqa: BLE001 - a bad round must not end planning
                log.exception("planner round failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    async def round(self) -> Plan:
        """Observe, plan, act; returns the plan (tests drive rounds directly)."""
        obs = await self.fleet.observe()
        plan = self.planner.plan(obs)
        self.rounds += 1
        self._export(obs, plan)
        for action in plan.actions:
            await self._carry_out(action)
        return plan

    async def _carry_out(self, action: Action) -> None:
        fleet = self.fleet
        ok = True
        try:
            if action.kind is ActionKind.PROMOTE and action.worker_id is not None:
                await fleet.promote(action.worker_id, action.role)
            elif action.kind is ActionKind.START:
                await fleet.start(action.role)
            elif action.kind is ActionKind.STOP and action.worker_id is not None:
                await fleet.stop(action.worker_id)
            elif action.kind is ActionKind.MOVE and action.worker_id is not None:
                await fleet.move(action.worker_id, action.role)
        except KvmeshError as exc:  # the fleet cannot do it (no standby, a fixed role): said, counted
            ok = False
            self._refused(action, exc.message)
        except Exception:  # noqa: BLE001 - logged and counted; the next round sees the fleet as it is
            ok = False
            log.exception("planner: %s failed", _describe(action))
            if self.metrics is not None:
                self.metrics.failed.labels(action.kind.value).inc()
        self.history.append(Decision(self.clock(), action, ok))
        if ok:
            log.warning("planner: %s", _describe(action))
        if self.metrics is not None and ok:
            self.metrics.decisions.labels(action.kind.value, action.role.value).inc()

    def _refused(self, action: Action, why: str) -> None:
        """Log a refused action once per ``_REPEAT_LOG_S`` for the same reason (the core
        asks again every round while the fleet cannot, e.g. no standby to promote)."""
        now = self.clock()
        key = f"{action.kind.value} {action.role.value}: {why}"
        if now - self._said.get(key, -_REPEAT_LOG_S) >= _REPEAT_LOG_S:
            self._said[key] = now
            log.warning("planner: %s not done: %s", _describe(action), why)

    def _export(self, obs: Observation, plan: Plan) -> None:
        m = self.metrics
        if m is None:
            return
        m.pressure.labels("prefill").set(plan.prefill_pressure)
        m.pressure.labels("decode").set(plan.decode_pressure)
        signals = {
            "prefill_queue_tokens": obs.prefill_queue_tokens, "ttft_p90_ms": obs.ttft_p90_ms,
            "itl_p90_ms": obs.itl_p90_ms, "degradation_level": obs.degradation_level,
            "request_rate_rps": obs.request_rate_rps, "starting": len(obs.starting),
            # requests the frontends admitted per second this round (the forecast's input)
            "arrival_rps": obs.arrived / obs.interval_s if obs.interval_s > 0 else 0.0,
        }  # fmt: skip
        if plan.forecast is not None:  # with a capacity profile: what the targets were sized for
            signals.update(forecast_rps=plan.forecast.rate_rps, forecast_input_tokens=plan.forecast.input_tokens,
                           forecast_output_tokens=plan.forecast.output_tokens)  # fmt: skip
            signals.update({f"target_{role.value}": n for role, n in plan.targets.items()})
        for name, value in signals.items():
            m.inputs.labels(name).set(value)
        # the fleet as this plan leaves it: a promoted spare counts in its new role
        promoted = {a.worker_id: a.role for a in plan.actions if a.kind is ActionKind.PROMOTE}
        for role in (*SERVING, Role.SPARE):
            count = sum(1 for w in obs.workers if promoted.get(w.worker_id, w.role) is role and w.routable)
            m.workers.labels(role.value).set(count)


def _describe(action: Action) -> str:
    who = "" if action.worker_id is None else f" worker {action.worker_id:x}"
    inputs = " ".join(f"{k}={v:.3g}" for k, v in sorted(action.inputs.items()))
    return f"{action.kind.value} {action.role.value}{who}: {action.reason} [{inputs}]"
