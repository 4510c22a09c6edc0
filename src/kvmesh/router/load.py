"""Active load the router booked on each worker. Pure and synchronous: the clock is an argument.

Lifecycle of one request (the router core calls these, one at a time)::

    add(request_id, worker_id, prefill_tokens, decode_blocks, now)   at routing
    first_token(request_id, now)     its prefill is done: prefill tokens leave the worker
    finished(request_id)             it ended: its decode blocks leave the worker
    expire(now, ttl)                 drop entries untouched for ``ttl`` (a lost finish)

Per worker this keeps two sums, read in O(1) by :meth:`prefill_tokens` and
:meth:`decode_blocks`:

* **prefill tokens**: uncached prompt tokens of requests routed there that have not
  produced their first token yet (work queued or running on the prefill path);
* **decode blocks**: KV blocks the requests in flight there will hold (from routing
  until finish; a request counts here during its prefill too).

Expiry is oldest-first over the time of each entry's last call (``add`` or
``first_token``). It assumes ``now`` does not go backwards; if it does, entries touched
at a later time only expire later, never early.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ActiveLoad"]


@dataclass(slots=True)
class _Entry:
    worker_id: int
    prefill_tokens: int  # 0 once the first token came
    decode_blocks: int
    touched: float


class ActiveLoad:
    """In-flight prefill tokens and decode blocks per worker; see the module docstring."""

    def __init__(self) -> None:
        # request id -> entry, oldest touch first (expiry scans from the front)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._prefill: dict[int, int] = {}
        self._blocks: dict[int, int] = {}
        self._count: dict[int, int] = {}

    # ------------------------------------------------------------------ queries

    def prefill_tokens(self, worker_id: int) -> int:
        return self._prefill.get(worker_id, 0)

    def decode_blocks(self, worker_id: int) -> int:
        return self._blocks.get(worker_id, 0)

    @property
    def prefill_by_worker(self) -> Mapping[int, int]:
        """Worker id -> in-flight prefill tokens (absent: 0). The live map: do not mutate."""
        return self._prefill

    @property
    def blocks_by_worker(self) -> Mapping[int, int]:
        """Worker id -> active decode blocks (absent: 0). The live map: do not mutate."""
        return self._blocks

    def requests(self, worker_id: int) -> int:
        """Requests in flight on ``worker_id``."""
        return self._count.get(worker_id, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    # ------------------------------------------------------------------ mutations

    def add(self, request_id: str, worker_id: int, prefill_tokens: int, decode_blocks: int, now: float) -> None:
        """Book a request on ``worker_id``. Booking an id again replaces its old entry
        (a retried or migrated request counts once, on its latest worker)."""
        if prefill_tokens < 0 or decode_blocks < 0:
            raise ValueError(f"load must be >= 0, got {prefill_tokens} tokens, {decode_blocks} blocks")
        entries = self._entries
        if request_id in entries:
            self._drop(request_id)
        entries[request_id] = _Entry(worker_id, prefill_tokens, decode_blocks, now)
        # (_sub inlined: this runs on every decision; a positive total stays in the map)
        prefill, blocks, count = self._prefill, self._blocks, self._count
        if prefill_tokens:
            prefill[worker_id] = prefill.get(worker_id, 0) + prefill_tokens
        if decode_blocks:
            blocks[worker_id] = blocks.get(worker_id, 0) + decode_blocks
        count[worker_id] = count.get(worker_id, 0) + 1

    def first_token(self, request_id: str, now: float) -> bool:
        """The request's prefill is done; False if it is unknown (finished or expired)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        if entry.prefill_tokens:
            self._sub(self._prefill, entry.worker_id, entry.prefill_tokens)
            entry.prefill_tokens = 0
        entry.touched = now
        self._entries.move_to_end(request_id)
        return True

    def finished(self, request_id: str) -> bool:
        """The request ended; False if it is unknown (already finished or expired)."""
        return self._drop(request_id)

    def expire(self, now: float, ttl: float) -> list[str]:
        """Drop entries last touched more than ``ttl`` before ``now``; returns their ids."""
        limit = now - ttl
        expired: list[str] = []
        entries = self._entries
        while entries:
            request_id, entry = next(iter(entries.items()))
            if entry.touched >= limit:
                break
            self._drop(request_id)
            expired.append(request_id)
        return expired

    def remove_worker(self, worker_id: int) -> list[str]:
        """Forget every request booked on ``worker_id``; returns their ids."""
        ids = [rid for rid, e in self._entries.items() if e.worker_id == worker_id]
        for rid in ids:
            self._drop(rid)
        self._prefill.pop(worker_id, None)
        self._blocks.pop(worker_id, None)
        self._count.pop(worker_id, None)
        return ids

    def _drop(self, request_id: str) -> bool:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        w, sub = entry.worker_id, self._sub
        if entry.prefill_tokens:
            sub(self._prefill, w, entry.prefill_tokens)
        if entry.decode_blocks:
            sub(self._blocks, w, entry.decode_blocks)
        sub(self._count, w, 1)
        return True

    @staticmethod
    def _sub(by_worker: dict[int, int], worker_id: int, amount: int) -> None:
        """Take ``amount`` off a worker's total; a total of 0 leaves the map, so the maps
        list only loaded workers (the fast selection scores the others as one group)."""
        left = by_worker.get(worker_id, 0) - amount
        if left:
            by_worker[worker_id] = left
        else:
            by_worker.pop(worker_id, None)
