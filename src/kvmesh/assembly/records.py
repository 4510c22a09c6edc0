"""``kvmesh run``'s half of its workers' registration: a static worker registers by its
READY line (:class:`~kvmesh.worker.registration.ParentRegistration`); its supervisor
hears it (:class:`~kvmesh.worker.supervisor.WorkerEvents`) and the :class:`Roster` puts the worker's record in the
run's in-process discovery, the record a distributed worker puts itself (same key, same
signature, :meth:`~kvmesh.runtime.distributed.Endpoint.register`), which the frontend
watches the same way."""

from __future__ import annotations

import msgspec

from kvmesh.protocol import InstanceInfo, KvEndpoint
from kvmesh.runtime.distributed import DistributedRuntime, instance_key, sign_record
from kvmesh.runtime.names import COMPONENT, GENERATE, PREFILL_COMPONENT
from kvmesh.worker.supervisor import WorkerEvents

__all__ = ["Roster", "PREFILL_FIRST_ID", "MODEL_ID_STRIDE"]

PREFILL_FIRST_ID = 1_000_000  # a disaggregated run's prefill workers' ids start here
MODEL_ID_STRIDE = 10_000  # several models: model i's workers' ids start at i × this (64 models fit below the prefill ids)

_encode = msgspec.json.encode


class Roster:
    """The run's running workers (every card, routed to or not) and their records in
    the run's discovery. :meth:`events` is what the supervisors report to."""

    def __init__(self, runtime: DistributedRuntime) -> None:
        self.runtime = runtime
        self.cards: dict[int, InstanceInfo] = {}

    async def publish(self, info: InstanceInfo) -> None:
        """Make the worker routable: its signed record, bound to nothing (the run's own
        lease-free discovery), deleted by :meth:`unpublish`."""
        rt = self.runtime
        key = instance_key(rt.config.namespace, info.component or COMPONENT, GENERATE, info.worker_id)
        await rt.discovery.put(key, _encode(sign_record(rt.secret, key, info)))

    async def unpublish(self, worker_id: int) -> None:
        ns = self.runtime.config.namespace
        for component in (COMPONENT, PREFILL_COMPONENT):
            await self.runtime.discovery.delete(instance_key(ns, component, GENERATE, worker_id))

    def kv_endpoint(self, worker_id: int) -> KvEndpoint | None:
        """A running worker's KV endpoint, routed to or not (a planner's spare): where
        the prefill queue tells prefill workers to write."""
        card = self.cards.get(worker_id)
        return None if card is None else card.kv

    def events(self, planner: WorkerEvents | None = None) -> WorkerEvents:
        """Cards kept, then: every ready worker published, or (``planner``: the planner's
        fleet) the planner told, which publishes what it routes to."""
        return _Reported(self, planner)


class _Reported:
    def __init__(self, roster: Roster, planner: WorkerEvents | None) -> None:
        self.roster = roster
        self.planner = planner

    async def on_ready(self, info: InstanceInfo) -> None:
        self.roster.cards[info.worker_id] = info
        if self.planner is None:
            await self.roster.publish(info)
        else:
            await self.planner.on_ready(info)

    async def on_exit(self, worker_id: int) -> None:
        self.roster.cards.pop(worker_id, None)
        if self.planner is None:
            await self.roster.unpublish(worker_id)
        else:
            await self.planner.on_exit(worker_id)

    async def on_failed(self, worker_id: int, why: str) -> None:
        if self.planner is not None:
            await self.planner.on_failed(worker_id, why)
