"""The planner in distributed mode: it acts through discovery, with signed orders.

Keys (the namespace's planner prefix)::

    /planner/{namespace}/standby/{worker:x}   a standby worker's InstanceInfo (its lease), signed
                                              like an instance record: started, not routed to
    /planner/{namespace}/orders/{worker:x}    an :class:`Order` for that worker (the planner's lease)

A ``kvmesh worker --standby`` starts its engine and request plane, offers itself
under ``standby/`` (so it can be canary-checked: it answers requests sent to it
directly) and does not register as an instance, so no frontend routes to it. It
obeys the orders on its own key: ``serve`` registers it as an instance (routable the
moment the frontends' watches see the record), ``stop`` drains it and ends it. An
order counts only when its MAC verifies under the cluster secret (HMAC over the key
and the order, label ``planner``) and its ``seq`` is newer than the last one obeyed:
a process that can write to discovery but lacks the secret cannot promote or stop a
worker, nor replay an old order.

:class:`kvmesh.assembly.discovery_fleet.DiscoveryFleet` is the planner's
:class:`~kvmesh.planner.service.Fleet` here: it observes the instances (serving: ``backend``; prefill: ``prefill``), the
standby workers and their load reports; a standby is vetted by a greedy canary whose
answer must agree with a serving worker's (tokens and top log-probability). It cannot
start processes: ``start`` promotes a vetted standby when there is one (keeping the
standby pool full is the process manager's job: Kubernetes, systemd); a worker's role
is fixed by its flags (a prefill standby is one started with ``--mode prefill``), so a
``move`` promotes a standby of the new role and orders the old worker to drain once
the new one is registered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import msgspec

from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.distributed import DistributedRuntime, sign_record, sign_struct, struct_is_signed

__all__ = [
    "Order",
    "order_key",
    "planner_prefix",
    "standby_key",
    "sign_order",
    "order_is_signed",
    "StandbyLink",
]

log = logging.getLogger("kvmesh.planner")

_encode = msgspec.json.encode


MAX_ORDER_BYTES = 4096  # an order is a few fields and a short reason


class Order(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the planner tells one standby or serving worker to do."""

    worker_id: int
    action: Literal["serve", "stop"]
    seq: int  # newer orders have larger numbers (the planner's wall clock in ns)
    reason: str = ""
    mac: str = ""


def planner_prefix(namespace: str) -> str:
    return f"/planner/{namespace}/"


def standby_key(namespace: str, worker_id: int) -> str:
    return f"{planner_prefix(namespace)}standby/{worker_id:x}"


def order_key(namespace: str, worker_id: int) -> str:
    return f"{planner_prefix(namespace)}orders/{worker_id:x}"


def sign_order(secret: ClusterSecret | None, key: str, order: Order) -> Order:
    return sign_struct(secret, "planner", key, order)


def order_is_signed(secret: ClusterSecret | None, key: str, order: Order) -> bool:
    return struct_is_signed(secret, "planner", key, order)


class StandbyLink:
    """A ``--standby`` worker's side: offer itself, wait for orders (see the module
    docstring). ``next_order`` returns verified, newer orders only."""

    def __init__(self, runtime: DistributedRuntime, info: InstanceInfo) -> None:
        self.runtime = runtime
        self.info = info
        ns = runtime.config.namespace
        self._standby = standby_key(ns, info.worker_id)
        self._orders = order_key(ns, info.worker_id)
        self._seq = 0
        self._queue: asyncio.Queue[Order] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def offer(self) -> None:
        rt = self.runtime
        await rt.put_leased(self._standby, _encode(sign_record(rt.secret, self._standby, self.info)))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def withdraw(self) -> None:
        await self.runtime.delete_leased(self._standby)

    async def next_order(self) -> Order:
        return await self._queue.get()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        discovery = self.runtime.discovery
        for value in (await discovery.get_prefix(self._orders)).values():
            self._consider(value)
        async for event in discovery.watch_prefix(self._orders):
            if event.kind == "put" and event.key == self._orders:
                self._consider(event.value)

    def _consider(self, value: bytes) -> None:
        if len(value) > MAX_ORDER_BYTES:  # bounded before it is decoded: anyone may write to discovery
            log.warning("ignoring an order of %d bytes at %s (at most %d)", len(value), self._orders, MAX_ORDER_BYTES)
            return
        try:
            order = msgspec.json.decode(value, type=Order)
        except msgspec.DecodeError:
            log.warning("ignoring an order that does not decode at %s", self._orders)
            return
        if order.worker_id != self.info.worker_id or not order_is_signed(self.runtime.secret, self._orders, order):
            log.warning("ignoring an order at %s that is not signed with the cluster secret", self._orders)
            return
        if order.seq <= self._seq:
            return  # an order already obeyed (or a replay of one)
        self._seq = order.seq
        log.warning("planner order: %s (%s)", order.action, order.reason)
        self._queue.put_nowait(order)
