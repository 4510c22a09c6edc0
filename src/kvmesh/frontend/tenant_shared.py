"""Tenants' budgets shared by every frontend of a fleet, in a NATS JetStream KV bucket
(the lease logic is :mod:`kvmesh.frontend.tenant_budget`; this is its store).

One key per tenant, kind and window: ``t.<tenant>.<kind>.<window>`` (``.`` in a tenant
name written ``=``), its value the units leased so far in that minute. A frontend
spends its local lease with no store operation; when the lease runs short it reads the
key and writes ``granted + slice`` by compare-and-set on the revision it read (a write
that lost the race reads again), under one lock per key in this process. The bucket's
entries expire after :data:`KEY_TTL_S` (a window's key is dead once its minute ends).

**With a cluster secret** a value is ``(replaces, granted, mac)``, ``replaces`` the
revision it was written over, the MAC over the bucket, the key and both numbers
(:mod:`kvmesh.disagg.queue`'s counter does the same). A value at revision ``R`` is
accepted only if its MAC is right, ``replaces < R``, and ``replaces`` is not older
than the last revision this frontend accepted for the key (an old signed value written
again is refused). A refused value (forged, unsigned, replayed, the key deleted) reads
as the most this frontend knows was leased (the last value it accepted, or its own
leases) and is logged once; the next lease overwrites it by compare-and-set.

Reads are bounded: a value over :data:`MAX_VALUE_BYTES` is refused before decoding;
every store call gives up after ``timeout_s``. Once the store refused a lease, the
tenant's requests are refused without a store read for :data:`SPENT_RECHECK_S`, so a
tenant over its limit costs the store about one read per second per frontend. While the store is out of reach a
request is admitted under this frontend's own limits (logged once, counted in
``store_errors``; the store is tried again after :data:`DOWN_RETRY_S`, requests
meanwhile do not wait for it): the fleet then admits up to N × a limit, as without a shared store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvmesh.errors import CannotConnect
from kvmesh.frontend.tenant_budget import BudgetLedger, Lease, plan_lease, window_of
from kvmesh.runtime import auth
from kvmesh.runtime.auth import ClusterSecret

__all__ = ["SharedBudget", "KEY_TTL_S", "MAX_VALUE_BYTES"]

log = logging.getLogger(__name__)

KEY_TTL_S = 180.0  # a window's key outlives its minute (clock skew between frontends), then expires
MAX_VALUE_BYTES = 128  # a counter value is ~45 bytes signed
SPENT_RECHECK_S = 1.0  # a spent budget is read again (another frontend may have given some back) after this
DOWN_RETRY_S = 5.0  # a store out of reach is tried again after this (requests meanwhile: local limits, no wait)
_MAX_GRANTED = 1 << 53
_CAS_TRIES = 16
_LABEL = "tenant-budget"


class _Signed(msgspec.Struct, array_like=True):
    replaces: int
    granted: int
    mac: bytes


_decode_signed = msgspec.msgpack.Decoder(_Signed).decode
_decode_plain = msgspec.msgpack.Decoder(int).decode
_encode = msgspec.msgpack.encode


class SharedBudget:
    """One frontend's side of the shared budgets; ``nc``: a connected nats-py client."""

    def __init__(
        self, nc: Any, namespace: str = "kvmesh", secret: Any = auth.FROM_ENV, clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
    ) -> None:  # fmt: skip
        self._nc = nc
        self._secret: ClusterSecret | None = auth.resolve(secret)
        self.clock = clock  # wall-clock seconds: windows are wall-clock minutes, the same on every frontend
        self.timeout_s = timeout_s
        self.bucket = f"KVMESH_TENANTS_{namespace}".replace(".", "_").replace("-", "_")
        self.ledger = BudgetLedger()
        self._kv: Any = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._seen: dict[str, tuple[int, int, int]] = {}  # key → (window, revision, granted) last read or written
        self._down_until = 0.0  # the store was out of reach: not tried again before then
        self._spent: dict[str, tuple[int, float]] = {}  # key → (window, when) the store last refused a lease
        self.operations = 0  # store reads and writes
        self.ignored = 0  # values refused (with a secret)
        self.store_errors = 0  # leases not taken because the store was out of reach

    @staticmethod
    def key(tenant: str, kind: str, window: int) -> str:
        return f"t.{tenant.replace('.', '=')}.{kind}.{window}"

    async def take(self, tenant: str, kind: str, limit: int, n: float) -> int | None:
        """Spend ``n`` of the tenant's ``kind`` in this window: what is left in the fleet
        as this frontend last saw it (admitted), or None (refused: the window's budget is
        spent). The local lease serves it without a store operation when it can."""
        window = window_of(self.clock())
        lkey = f"{tenant}\0{kind}"  # the ledger's, locks' and _seen's key: one per tenant and kind
        lease = self.ledger.lease(lkey, window)
        if lease.balance >= n:  # the hot path: spent from the local lease
            lease.balance -= n
            return self._left(lkey, lease, limit)
        if self._down_until and self.clock() < self._down_until:
            return self._left(lkey, lease, limit)  # the store was out of reach a moment ago: this frontend's limits
        spent = self._spent.get(lkey)
        if spent is not None and spent[0] == window and self.clock() - spent[1] < SPENT_RECHECK_S:
            return None  # the window's budget was spent a moment ago: refused without a store read
        lock = self._locks.setdefault(lkey, asyncio.Lock())
        async with lock:
            if self.ledger.take(lkey, window, n):  # leased by the request that held the lock
                return self.left(lkey, window, limit)
            try:
                leased = await asyncio.wait_for(self._lease(lkey, self.key(tenant, kind, window), window, limit, n), self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - timeout, connection, lost races; nats-py's errors have no common base
                return self._unreachable(lkey, exc, window, limit)
            if not leased or not self.ledger.take(lkey, window, n):
                self._spent[lkey] = (window, self.clock())
                return None
            return self.left(lkey, window, limit)

    def refund(self, tenant: str, kind: str, window: int, n: float) -> None:
        """A settled request gives back ``n`` taken in ``window`` (negative: a debt)."""
        self.ledger.refund(f"{tenant}\0{kind}", window, window_of(self.clock()), n)

    def remaining(self, tenant: str, kind: str, limit: int) -> int:
        """What is left of the tenant's ``kind`` in the fleet this minute, as last seen."""
        return self.left(f"{tenant}\0{kind}", window_of(self.clock()), limit)

    def left(self, lkey: str, window: int, limit: int) -> int:
        """What is left of the window's budget in the fleet, as this frontend last saw it."""
        return self._left(lkey, self.ledger.lease(lkey, window), limit)

    def _left(self, lkey: str, lease: Lease, limit: int) -> int:
        seen = self._seen.get(lkey)
        granted = seen[2] if seen is not None and seen[0] == lease.window else lease.leased
        return max(0, int(limit - granted + (lease.balance if lease.balance > 0 else 0)))

    async def _lease(self, lkey: str, key: str, window: int, limit: int, n: float) -> bool:
        for _ in range(_CAS_TRIES):
            granted, revision = await self._read(lkey, key, window)
            lease = plan_lease(limit, granted, self.ledger.shortfall(lkey, window, n))
            if lease == 0:
                return False
            if await self._write(lkey, key, window, granted + lease, revision):
                self.ledger.credit(lkey, window, lease)
                return True
        raise CannotConnect(f"tenant budget: {_CAS_TRIES} compare-and-set attempts lost the race")

    async def give_back(self) -> None:
        """Return every unspent lease of the current window (at shutdown), so the other
        frontends may spend it."""
        window = window_of(self.clock())
        for lkey in self.ledger.keys():
            tenant, _, kind = lkey.partition("\0")
            try:
                await asyncio.wait_for(self._give_back(lkey, self.key(tenant, kind, window), window), self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - best effort: the lease leaks until the minute ends
                log.debug("tenant budget %r not given back: %r", lkey, exc)

    async def close(self) -> None:
        await self.give_back()

    async def _give_back(self, lkey: str, key: str, window: int) -> None:
        async with self._locks.setdefault(lkey, asyncio.Lock()):
            unspent = self.ledger.unspent(lkey, window)
            if unspent <= 0:
                return
            self.ledger.returned(lkey, window, unspent)  # first: no request spends it meanwhile
            try:
                for _ in range(_CAS_TRIES):
                    granted, revision = await self._read(lkey, key, window)
                    if await self._write(lkey, key, window, max(0, granted - unspent), revision):
                        return
            except BaseException:
                self.ledger.credit(lkey, window, unspent)
                raise
            self.ledger.credit(lkey, window, unspent)

    # the store

    async def _bucket(self) -> Any:
        if self._kv is None:
            from nats.js.api import KeyValueConfig
            from nats.js.errors import BadRequestError, BucketNotFoundError

            js = self._nc.jetstream()
            try:
                self._kv = await js.key_value(self.bucket)
            except BucketNotFoundError:
                try:
                    config = KeyValueConfig(bucket=self.bucket, history=1, ttl=KEY_TTL_S, max_value_size=MAX_VALUE_BYTES)
                    self._kv = await js.create_key_value(config)
                except BadRequestError:  # created by another frontend meanwhile
                    self._kv = await js.key_value(self.bucket)
        return self._kv

    async def _read(self, lkey: str, key: str, window: int) -> tuple[int, int]:
        """(granted, the revision to write over; 0: no key yet)."""
        from nats.js.errors import KeyNotFoundError

        kv = await self._bucket()
        self.operations += 1
        try:
            entry = await kv.get(key)
        except KeyNotFoundError as exc:
            marker = getattr(exc, "entry", None)
            revision = int(marker.revision or 0) if marker is not None else 0
            if revision and self._secret is not None:
                return self._ignored(lkey, key, window, revision, "the key was deleted")
            return (self.ledger.leased(lkey, window), revision) if revision else (0, 0)
        revision = int(entry.revision or 0)
        value = entry.value or b""
        why = self._accept(lkey, key, window, value, revision)
        if why is not None:
            return self._ignored(lkey, key, window, revision, why)
        return self._seen[lkey][2], revision

    def _accept(self, lkey: str, key: str, window: int, value: bytes, revision: int) -> str | None:
        if len(value) > MAX_VALUE_BYTES:
            return f"a value of {len(value)} bytes"
        try:
            if self._secret is None:
                granted = _decode_plain(value)
            else:
                signed = _decode_signed(value)
                if not self._secret.verify(signed.mac, _LABEL, *self._parts(key, signed.replaces, signed.granted)):
                    return "not signed with this fleet's cluster secret"
                seen = self._seen.get(lkey)
                seen_revision = seen[1] if seen is not None and seen[0] == window else 0
                if signed.replaces >= revision or (revision != seen_revision and signed.replaces < seen_revision):
                    return "an older signed value written again"
                granted = signed.granted
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "malformed"
        if not 0 <= granted <= _MAX_GRANTED:
            return "out of range"
        self._seen[lkey] = (window, revision, granted)
        return None

    def _ignored(self, lkey: str, key: str, window: int, revision: int, why: str) -> tuple[int, int]:
        self.ignored += 1
        if self.ignored == 1:
            log.error(
                "ignoring the tenant budget %s in %s (%s): something outside the fleet wrote it; counting the most this"
                " frontend knows was leased instead (logged once; see ignored)", key, self.bucket, why,
            )  # fmt: skip
        seen = self._seen.get(lkey)
        known = seen[2] if seen is not None and seen[0] == window else 0
        return max(known, self.ledger.leased(lkey, window)), revision

    def _parts(self, key: str, replaces: int, granted: int) -> tuple[bytes, ...]:
        numbers = b"".join(n.to_bytes(9, "little", signed=True) for n in (replaces, granted))
        return self.bucket.encode(), key.encode(), numbers

    async def _write(self, lkey: str, key: str, window: int, granted: int, revision: int) -> bool:
        """Compare-and-set ``granted`` over ``revision`` (0: create); False: it moved."""
        from nats.js.errors import KeyWrongLastSequenceError

        kv = await self._bucket()
        if self._secret is None:
            value = _encode(granted)
        else:
            value = _encode(_Signed(revision, granted, self._secret.sign(_LABEL, *self._parts(key, revision, granted))))
        self.operations += 1
        try:
            written = await (kv.create(key, value) if revision == 0 else kv.update(key, value, last=revision))
        except KeyWrongLastSequenceError:
            return False
        except Exception as exc:  # noqa: BLE001 - create() raced another create()
            text = str(exc).lower()
            if "wrong last sequence" in text or "key exists" in text:
                return False
            raise
        self._seen[lkey] = (window, int(written), granted)
        return True

    def _unreachable(self, lkey: str, exc: BaseException, window: int, limit: int) -> int:
        self.store_errors += 1
        self._down_until = self.clock() + DOWN_RETRY_S
        if self.store_errors == 1:
            log.error(
                "tenant budget store %s out of reach (%r): admitting under this frontend's own limits until it is back"
                " (logged once; see store_errors)", self.bucket, exc,
            )  # fmt: skip
        return self.left(lkey, window, limit)
