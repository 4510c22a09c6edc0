"""In-process discovery: a dict, leases that live until revoked, per-watcher queues.

One :class:`MemoryStore` is the "server"; any number of :class:`MemoryDiscovery`
objects may share it, so one test can play several processes. Leases never expire on
their own; :meth:`MemoryDiscovery.expire` simulates an expiry (a process that died).
Everything runs on one event loop: a change is applied and queued to every matching
watcher synchronously, so watchers see changes in the order they were made.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.runtime.discovery.base import Discovery, Lease, WatchEvent

__all__ = ["MemoryStore", "MemoryDiscovery", "MemoryLease"]


class MemoryLease(Lease):
    def __init__(self, store: MemoryStore, lease_id: int, ttl_s: float) -> None:
        super().__init__(lease_id, ttl_s)
        self._store = store

    async def revoke(self) -> None:
        self._store.end_lease(self.id)


@dataclass(eq=False)
class _Watcher:
    prefix: str
    # None is the end-of-watch sentinel (its discovery was closed).
    queue: asyncio.Queue[WatchEvent | None] = field(default_factory=asyncio.Queue)


class MemoryStore:
    """The shared state: entries, live leases and registered watchers."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[bytes, int]] = {}  # key -> (value, lease id or 0)
        self._leases: dict[int, MemoryLease] = {}
        self._watchers: set[_Watcher] = set()

    def grant(self, ttl_s: float) -> MemoryLease:
        lease_id = _new_lease_id(self._leases)
        lease = self._leases[lease_id] = MemoryLease(self, lease_id, ttl_s)
        return lease

    def end_lease(self, lease_id: int, expired: bool = False) -> None:
        """Revoke or expire: the lease's keys are deleted and ``lost`` is set. Idempotent.
        ``expired``: as if its owner had been cut off for longer than the TTL."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        for key in [k for k, (_, owner) in self._entries.items() if owner == lease_id]:
            self.delete(key)
        lease.expired = expired
        lease.lost.set()

    def put(self, key: str, value: bytes, lease_id: int | None) -> None:
        if lease_id and lease_id not in self._leases:
            raise InvalidArgument(f"lease {lease_id:x} not found")
        self._entries[key] = (bytes(value), lease_id or 0)
        self._notify(WatchEvent("put", key, bytes(value)))

    def delete(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            self._notify(WatchEvent("delete", key))

    def snapshot(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, (v, _) in self._entries.items() if k.startswith(prefix)}

    def add_watcher(self, prefix: str) -> tuple[_Watcher, dict[str, bytes]]:
        """Register a watcher and return it with the snapshot it starts from; no change
        can fall between the two because nothing here awaits."""
        watcher = _Watcher(prefix)
        self._watchers.add(watcher)
        return watcher, self.snapshot(prefix)

    def remove_watcher(self, watcher: _Watcher) -> None:
        self._watchers.discard(watcher)

    def _notify(self, event: WatchEvent) -> None:
        for watcher in self._watchers:
            if event.key.startswith(watcher.prefix):
                watcher.queue.put_nowait(event)


class MemoryDiscovery(Discovery):
    name = "memory"

    def __init__(self, store: MemoryStore | None = None) -> None:
        super().__init__()
        self.store = store if store is not None else MemoryStore()
        self._watchers: set[_Watcher] = set()
        self._closed = False

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        """End this object's watches; leases and keys stay in the store (close never
        revokes; use :meth:`expire` to simulate the process dying)."""
        self._closed = True
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)
        self._watchers.clear()

    async def grant_lease(self, ttl_s: float) -> Lease:
        return self.store.grant(ttl_s)

    def expire(self, lease_id: int) -> None:
        """Simulate the lease's expiry: its keys vanish and ``lost`` is set."""
        self.store.end_lease(lease_id)

    def cut_off(self, lease_id: int) -> None:
        """Simulate the lease's owner out of contact for longer than its TTL: its keys
        vanish and ``lost`` is set with ``expired`` (the owner may take a new lease)."""
        self.store.end_lease(lease_id, expired=True)

    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        self.store.put(key, value, lease_id)

    async def delete(self, key: str) -> None:
        self.store.delete(key)

    async def _get_prefix(self, prefix: str) -> dict[str, bytes]:
        return self.store.snapshot(prefix)

    async def _watch_prefix(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        if self._closed:
            return
        watcher, snapshot = self.store.add_watcher(prefix)
        self._watchers.add(watcher)
        try:
            for key, value in snapshot.items():
                yield WatchEvent("put", key, value)
            while (event := await watcher.queue.get()) is not None:
                yield event
        finally:
            self.store.remove_watcher(watcher)
            self._watchers.discard(watcher)


def _new_lease_id(taken: dict[int, MemoryLease]) -> int:
    while True:
        lease_id = secrets.randbits(63)
        if lease_id and lease_id not in taken:
            return lease_id
