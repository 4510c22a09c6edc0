"""Graceful degradation in the frontend: the fleet's capacity (from healthy workers'
load reports and the configured SLOs) against the measured demand sets a degradation
level (:mod:`kvmesh.health.degradation`); each new request's priority tier is admitted
or refused with 503 + ``Retry-After`` at that level.

:class:`RateMeter` is pure (clock passed in); :class:`LoadShedder` is the async glue
that polls every worker's ``load`` endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec

from kvmesh.errors import KvmeshError
from kvmesh.health.fleet import FleetView
from kvmesh.health.degradation import CapacityConfig, Decision, DegradationController, admit
from kvmesh.protocol import LoadReport
from kvmesh.runtime.distributed import call
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import LOAD, TUNE
from kvmesh.runtime.tasks import cancel_and_wait
from kvmesh.observability.metrics import FrontendMetrics

__all__ = ["RateMeter", "LoadShedder"]

log = logging.getLogger("kvmesh.health")

_decode_load = msgspec.msgpack.Decoder(LoadReport).decode


class RateMeter:
    """Events per second, exponentially smoothed with time constant ``tau_s``."""

    __slots__ = ("tau_s", "_rate", "_last")

    def __init__(self, tau_s: float = 2.0) -> None:
        self.tau_s = tau_s
        self._rate = 0.0
        self._last: float | None = None

    def _decay(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self._rate *= math.exp(-(now - self._last) / self.tau_s)
        self._last = now if self._last is None else max(self._last, now)

    def tick(self, now: float) -> None:
        self._decay(now)
        self._rate += 1.0 / self.tau_s

    def rate(self, now: float) -> float:
        self._decay(now)
        return self._rate


class LoadShedder:
    def __init__(
        self, fleet: FleetView, config: CapacityConfig, period_s: float = 0.5, metrics: FrontendMetrics | None = None
    ) -> None:
        self.fleet = fleet
        self.controller = DegradationController(config)
        self.meter = RateMeter()
        self.period_s = period_s
        self.metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._batch: dict[int, float] = {}  # worker -> batch multiplier it was told

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    def admit(self, priority: str | None) -> Decision:
        """Count the arrival, then admit or refuse it at the current level."""
        self.meter.tick(time.monotonic())
        return admit(priority, self.controller.level, retry_after_s=self.controller.config.retry_after_s)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self._evaluate()
            except Exception:  # noqa: BLE001 - degradation must never stop serving
                log.exception("degradation update failed")

    async def _evaluate(self) -> None:
        fleet = self.fleet
        instances = fleet.workers()
        live = [i for i in instances if fleet.weight(i.worker_id) > 0]
        reports = [r for r in await asyncio.gather(*(self._load(i) for i in live)) if r is not None]
        weights = fleet.capacities([i.worker_id for i in live])
        now = time.monotonic()
        change = self.controller.evaluate(reports, now, weights=weights, demand_rps=self.meter.rate(now))
        if change is not None:
            log.warning("degradation level %d -> %d (capacity/demand %.2f)", change.src, change.dst, change.ratio)
        multiplier = self.controller.actions.batch_multiplier
        for instance in instances:
            if self._batch.get(instance.worker_id) != multiplier:
                await self._tune(instance, multiplier)
        if self.metrics is not None:
            self.metrics.degradation_level.set(int(self.controller.level))

    async def _tune(self, instance: Instance, multiplier: float) -> None:
        """Tell a worker the level's batch multiplier (once per change per worker)."""
        try:
            await call(instance.client, TUNE, msgspec.msgpack.encode(multiplier))
        except KvmeshError as exc:
            log.warning("worker %x not tuned: %s", instance.worker_id, exc.message)
            return
        self._batch[instance.worker_id] = multiplier

    async def _load(self, instance: Instance) -> LoadReport | None:
        try:
            report = await call(instance.client, LOAD, decode=_decode_load)
        except KvmeshError:
            return None
        if report is not None:
            report = msgspec.structs.replace(report, worker_id=instance.worker_id)
        return report
