"""Stored responses for OpenAI Responses' ``previous_response_id`` (pure: the clock is
passed in, no I/O, no asyncio).

A finished ``/v1/responses`` request with ``store`` (the default) leaves its
conversation here under its response id: the messages it was given (earlier turns,
its input) and the answer, as encoded JSON. A later request naming that id continues
the conversation. ``instructions`` and ``tools`` are not kept (the Responses API does
not carry them over either).

Bounds (``--responses-store-entries``, ``--responses-store-bytes``,
``--responses-store-ttl``): an entry lives ``ttl_s`` seconds after it was stored; past
either bound the oldest entries go first; one conversation larger than the byte bound
is not stored at all. The store lives in one frontend process: behind several
frontends, a chained request must reach the frontend that answered the one it names,
and a restart forgets every entry. Ids are random (128 bits), so one caller cannot
name another's conversation by guessing; with API keys an entry is kept under the
key's digest as well (``responses._scope``), so a caller that learns another tenant's
id still finds nothing.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["ResponseStore"]


class ResponseStore:
    """Bounded, expiring map from a response id to its conversation (bytes).

    Insertion order is expiry order (one TTL for all), so the oldest entry is always
    the first: expiry and eviction both pop from the front."""

    __slots__ = ("max_entries", "max_bytes", "ttl_s", "_entries", "_bytes")

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # id → (expires, value)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        """Bytes of the stored values."""
        return self._bytes

    def put(self, key: str, value: bytes, now: float) -> bool:
        """Store ``value`` under ``key`` until ``now + ttl_s``; False when it alone is
        larger than the byte bound (nothing is stored, nothing evicted)."""
        if len(value) > self.max_bytes or self.max_entries == 0:
            return False
        self._drop(key)
        self._expire(now)
        while self._entries and (len(self._entries) >= self.max_entries or self._bytes + len(value) > self.max_bytes):
            self._pop_oldest()
        self._entries[key] = (now + self.ttl_s, value)
        self._bytes += len(value)
        return True

    def get(self, key: str, now: float) -> bytes | None:
        """The value under ``key``, or None when there is none or it expired."""
        found = self._entries.get(key)
        if found is None:
            return None
        if found[0] <= now:
            self._expire(now)
            return None
        return found[1]

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old[1])

    def _expire(self, now: float) -> None:
        while self._entries and next(iter(self._entries.values()))[0] <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, (_, value) = self._entries.popitem(last=False)
        self._bytes -= len(value)
