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

Read bounds (every backend, every consumer): discovery values are data anyone with
write access to the store can put, so what :meth:`Discovery.get_prefix` and
:meth:`Discovery.watch_prefix` hand out is bounded here, once, before any consumer
decodes it. A value over ``max_value_bytes`` is refused; a prefix holds at most
``max_records`` keys (a read stops there; a watch refuses new keys past it, keeps
updating the keys it has, and a delete frees a slot). Each refusal is logged (a
flood: the first, then every 1000th) and counted in ``refused`` by reason
(``too_large``, ``too_many``; exported as ``kvmesh_discovery_records_refused_total``).
A watched key whose new value is refused is reported deleted: its consumer drops
the old value. A key refused for the count stays unseen until it is put again.
Backends implement ``_get_prefix`` / ``_watch_prefix``; the etcd one also reads in
pages and stops at ``max_records``, so an oversized prefix is never read whole.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, Literal

import msgspec

__all__ = ["WatchEvent", "Lease", "Discovery", "LeaseTasks", "MAX_VALUE_BYTES", "MAX_RECORDS"]

log = logging.getLogger("kvmesh.discovery")

# An instance record is about 1 KB (a KV layout, addresses, the engine card); an order
# or a thresholds record less. etcd itself takes values of up to 1.5 MiB.
MAX_VALUE_BYTES = 64 * 1024
# Keys under one watched prefix: well above the largest fleet run (bench/fleet.py: 1,000).
MAX_RECORDS = 10_000
_LOG_EVERY = 1000  # past the first, one warning per this many refusals of one reason


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

    def __init__(self) -> None:
        self.max_value_bytes = MAX_VALUE_BYTES
        self.max_records = MAX_RECORDS
        self.refused: dict[str, int] = {"too_large": 0, "too_many": 0}  # since start, by reason

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

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """A snapshot of ``prefix``, bounded (see the module docstring): the first
        ``max_records`` keys in key order whose values are not too large."""
        found: dict[str, bytes] = {}
        for key, value in sorted((await self._get_prefix(prefix)).items()):
            if len(found) >= self.max_records:
                self.refuse("too_many", key, f"{prefix} holds more than {self.max_records} keys")
            elif len(value) > self.max_value_bytes:
                self.refuse("too_large", key, f"{len(value)} bytes (at most {self.max_value_bytes})")
            else:
                found[key] = value
        return found

    async def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """The backend's watch (the contract above), bounded (see the module docstring)."""
        admitted: set[str] = set()
        async with contextlib.aclosing(self._watch_prefix(prefix)) as events:
            async for event in events:
                out = self._admit(prefix, admitted, event)
                if out is not None:
                    yield out

    def _admit(self, prefix: str, admitted: set[str], event: WatchEvent) -> WatchEvent | None:
        """What a watcher gets of ``event`` (None: nothing); ``admitted``: the keys it has."""
        key = event.key
        if event.kind == "delete" or len(event.value) > self.max_value_bytes:
            if event.kind == "put":
                self.refuse("too_large", key, f"{len(event.value)} bytes (at most {self.max_value_bytes})")
            if key not in admitted:
                return None
            admitted.discard(key)
            return WatchEvent("delete", key)
        if key not in admitted and len(admitted) >= self.max_records:
            self.refuse("too_many", key, f"{prefix} holds {self.max_records} keys already")
            return None
        admitted.add(key)
        return event

    def refuse(self, reason: Literal["too_large", "too_many"], key: str, why: str, count: int = 1) -> None:
        """Count ``count`` refused records; log the first and every 1000th after it."""
        before = self.refused[reason]
        self.refused[reason] = before + count
        if before == 0 or before // _LOG_EVERY != (before + count) // _LOG_EVERY:
            log.warning(
                "%s discovery: refusing record %s: %s (%d refused so far: %s)",
                self.name, key[:200], why, before + count, reason,
            )  # fmt: skip

    @abc.abstractmethod
    async def _get_prefix(self, prefix: str) -> dict[str, bytes]:
        """The backend's snapshot of ``prefix`` (bounded by :meth:`get_prefix`)."""

    @abc.abstractmethod
    def _watch_prefix(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        """The backend's watch of ``prefix`` (bounded by :meth:`watch_prefix`)."""


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
