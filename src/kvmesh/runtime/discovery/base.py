"""Discovery: a small key-value view with leases and prefix watches.

Backends: ``memory`` (one process), ``file`` (a directory shared by processes on one
host; a lease is a heartbeat file), ``etcd`` (real etcd v3). The runtime stores its
instances under ``/services/{namespace}/{component}/{endpoint}-{lease_id:x}`` with
JSON values; see :mod:`kvmesh.runtime.distributed`.

Contract (every backend):

1. ``await connect()`` before anything else; ``await close()`` last (idempotent). Close
   stops keep-alives and watches but does not revoke leases: the owner revokes first
   when it wants its keys gone at once.
2. ``await grant_lease(ttl_s)`` returns a :class:`Lease` kept alive in the background
   until revoked or lost. An unreachable backend is not a lost lease: keep-alives go
   on, for as long as it takes. ``lease.lost`` is set once the backend, reachable
   again, says the lease is gone; ``lease.expired`` then tells why: True when it may
   have run out while the backend could not be reached (no keep-alive succeeded for a
   whole TTL; the owner may take a new lease and put its keys again), False when it
   cannot have expired, so someone revoked it (the deliberate stop signal).
3. ``put(key, value, lease_id)`` binds the key to the lease: it disappears when the
   lease does. ``delete(key)`` removes it now. ``get_prefix(prefix)`` is a snapshot.
4. ``watch_prefix(prefix)`` is an async iterator that first yields the current keys
   under ``prefix`` as ``put`` events, then every change, in order. It survives
   backend outages: it retries, and on reconnect resumes from the last revision it
   saw (or re-reads and yields the difference), so a watcher never ends up with a
   stale view and never sees a key vanish only because the backend was unreachable.
   It ends only when the consumer stops iterating or the backend is closed.

Keys are ``str``; values are ``bytes``.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Literal

import msgspec

__all__ = ["WatchEvent", "Lease", "Discovery", "LeaseTasks"]


class WatchEvent(msgspec.Struct, frozen=True):
    kind: Literal["put", "delete"]
    key: str
    value: bytes = b""


class Lease(abc.ABC):
    """A lease: keys put with it live as long as it does."""

    def __init__(self, lease_id: int, ttl_s: float) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self.lost = asyncio.Event()
        # set before ``lost``: True if the lease ran out while out of contact, False if revoked
        self.expired = False

    @abc.abstractmethod
    async def revoke(self) -> None:
        """End the lease now; its keys are deleted. Idempotent."""


class Discovery(abc.ABC):
    name: str = "abstract"

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: float) -> Lease: ...

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, bytes]: ...

    @abc.abstractmethod
    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]: ...


class LeaseTasks:
    """The refresh task of each lease a backend granted (etcd keep-alive, file
    heartbeat): owned here, cancelled when the lease is revoked or the backend closes."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def start(self, lease_id: int, refresh: Coroutine[Any, Any, None]) -> None:
        loop = asyncio.get_running_loop()
        self._tasks[lease_id] = loop.create_task(refresh, name=f"{self._kind}-lease-{lease_id:x}")

    def forget(self, lease_id: int) -> None:
        """The task ends by itself (its lease is gone): no longer ours to cancel."""
        self._tasks.pop(lease_id, None)

    async def stop(self, lease_id: int) -> None:
        task = self._tasks.pop(lease_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop_all(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
