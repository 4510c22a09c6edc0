"""Weighted fair queuing of waiting requests across tenants (pure: no I/O, no clock).

When every worker is busy, requests wait (:mod:`kvmesh.router.service`'s admission).
They leave this queue by priority tier first (``premium``, ``standard``,
``best_effort``), and inside a tier by virtual finish time (start-time fair queuing
over tokens)::

    start  = max(V[tier], last_finish[tier, tenant])
    finish = start + cost / weight               (cost: the request's tokens)
    pop: the smallest (tier, finish, arrival); V[tier] = that item's start

So a tenant that sends ten times its share queues behind its own earlier requests:
its finish times run ahead of the virtual clock while a light tenant's new request
starts at the clock. Requests without a tenant share one (the empty name). Per-tenant
state is dropped once the tenant has nothing waiting and its last finish is behind the
clock, and all of it when the queue empties, so memory is bounded by the tenants that
waited since the queue was last empty.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

__all__ = ["FairQueue", "TIER_RANK"]

T = TypeVar("T")

TIER_RANK = {"premium": 0, "standard": 1, "best_effort": 2}
_DEFAULT_RANK = TIER_RANK["standard"]


class FairQueue(Generic[T]):
    """Items waiting in WFQ order; ``push``/``pop``/``remove`` are O(log n)."""

    __slots__ = ("_heap", "_seq", "_virtual", "_finish", "_waiting", "_entries")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, float, str, T]] = []
        self._seq = itertools.count()
        self._virtual: dict[int, float] = {}  # tier -> its virtual clock
        self._finish: dict[tuple[int, str], float] = {}  # (tier, tenant) -> its last finish time
        self._waiting: dict[tuple[int, str], int] = {}  # (tier, tenant) -> items queued
        self._entries: dict[int, tuple[int, str]] = {}  # id(item) -> (tier, tenant), for remove()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, item: T, tenant: str = "", weight: float = 1.0, cost: float = 1.0, tier: str | None = None) -> None:
        """Queue ``item`` (each item at most once) for ``tenant`` at ``weight`` (> 0)
        costing ``cost`` (tokens, >= 0)."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        rank = TIER_RANK.get(tier or "", _DEFAULT_RANK)
        key = (rank, tenant)
        start = max(self._virtual.get(rank, 0.0), self._finish.get(key, 0.0))
        finish = start + max(cost, 0.0) / weight
        self._finish[key] = finish
        self._waiting[key] = self._waiting.get(key, 0) + 1
        self._entries[id(item)] = key
        heapq.heappush(self._heap, (rank, finish, next(self._seq), start, tenant, item))

    def pop(self) -> T:
        """The next item in fair order (IndexError when empty)."""
        while True:
            rank, _, _, start, tenant, item = heapq.heappop(self._heap)
            if self._entries.pop(id(item), None) is None:
                continue  # removed while waiting
            self._virtual[rank] = max(self._virtual.get(rank, 0.0), start)
            self._left((rank, tenant))
            return item

    def remove(self, item: T) -> bool:
        """Take ``item`` out (a waiter that gave up); False if it is not queued."""
        key = self._entries.pop(id(item), None)
        if key is None:
            return False
        self._left(key)
        return True

    def _left(self, key: tuple[int, str]) -> None:
        left = self._waiting[key] - 1
        if left:
            self._waiting[key] = left
            return
        del self._waiting[key]
        if self._finish.get(key, 0.0) <= self._virtual.get(key[0], 0.0):
            self._finish.pop(key, None)  # nothing waiting and nothing ahead of the clock: forget it
        if not self._entries:  # nobody waits: the fleet caught up, every tenant starts afresh
            self._heap.clear()
            self._finish.clear()
            self._virtual.clear()
