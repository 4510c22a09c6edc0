"""KV indexer: which workers hold which prefix blocks. Pure and synchronous.

A prefix tree over chained block sequence hashes (:mod:`kvmesh.router.hashing`).
A sequence hash names a block *and* everything before it, so the tree is stored
with each node's path folded into its key: one dict from sequence hash to the set of
workers holding that block. Walking a request's hashes in order through that dict is
walking the tree from the root; no parent or child links are needed.

Contract (every call mutates nothing but this object; nothing here blocks or awaits):

1. ``apply(worker_id, data)`` applies one KV event payload of that worker:
   ``BlockStored`` adds the worker to every hash of the event (its ``parent_hash``
   is not needed: a block whose parent is missing is simply unreachable until the
   parent arrives), ``BlockRemoved`` takes it off those hashes, ``AllBlocksCleared``
   drops all of that worker's blocks. Storing a held hash or removing an unheld one
   is a no-op, so a replayed event is harmless. Event ordering and gaps are the
   caller's business (:class:`EventSequencer`).
2. ``find_matches(block_hashes)`` → ``{worker_id: n}``: for each worker holding the
   first block, ``n`` = the number of leading blocks of ``block_hashes`` it holds
   contiguously from the first (workers with 0 are left out).
3. ``remove_worker(worker_id)`` drops all of a worker's blocks and forgets it.
4. ``load_dump(worker_id, block_hashes)`` replaces a worker's blocks with a full dump
   (gap repair, or a worker that appeared with a warm cache).

Representation (memory matters: the bench indexes 10 million blocks):

* every worker gets a small dense index ``i`` (the lowest free one), and the set of
  workers holding a block is an int bitmask with bit ``i`` set;
* ``_nodes: dict[hash, mask]``. A block held by one worker, the common case, stores
  the interned ``1 << i`` object of that worker, so it costs only its dict entry;
  only shared blocks own a mask int;
* ``_held[i]``: the set of hashes worker ``i`` holds, so removing a worker, loading
  a dump and counting are O(that worker's blocks) rather than O(index).

Invariant: ``bit i is set in _nodes[h]`` ⇔ ``h in _held[i]``; no mask is 0.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Literal

from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEventData

__all__ = ["KvIndexer", "EventSequencer"]


def _bit_indices(mask: int) -> list[int]:
    """Positions of the set bits of ``mask`` (> 0), lowest first."""
    if mask & (mask - 1) == 0:
        return [mask.bit_length() - 1]
    # One C-level conversion, then str.find per set bit: far cheaper than peeling
    # bits off a 1,000-bit int one big-int operation at a time.
    s = bin(mask)[:1:-1]  # least significant bit first, "0b" prefix dropped
    out = []
    i = s.find("1")
    while i >= 0:
        out.append(i)
        i = s.find("1", i + 1)
    return out


class KvIndexer:
    """Which workers hold which blocks; see the module docstring for the contract."""

    __slots__ = ("_nodes", "_held", "_bits", "_index", "_ids", "_free")

    def __init__(self) -> None:
        self._nodes: dict[int, int] = {}
        self._held: list[set[int]] = []  # by dense index
        self._bits: list[int] = []  # by dense index: the interned 1 << i
        self._index: dict[int, int] = {}  # worker id -> dense index
        self._ids: list[int | None] = []  # dense index -> worker id (None: free)
        self._free: list[int] = []  # heap of free dense indices

    # ------------------------------------------------------------------ queries

    def find_matches(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """``{worker_id: leading blocks held}`` for workers holding the first block."""
        if not block_hashes:
            return {}
        nodes = self._nodes
        live = nodes.get(block_hashes[0])
        if live is None:
            return {}
        ids = self._ids
        out: dict[int, int] = {}
        depth = 1
        for h in block_hashes[1:]:
            m = nodes.get(h)
            if m is None:
                break
            narrowed = live & m
            if narrowed != live:
                # Workers in live but not in m held exactly `depth` leading blocks.
                for i in _bit_indices(live ^ narrowed):
                    out[ids[i]] = depth  # type: ignore[index]
                if not narrowed:
                    return out
                live = narrowed
            depth += 1
        for i in _bit_indices(live):
            out[ids[i]] = depth  # type: ignore[index]
        return out

    def worker_block_count(self, worker_id: int) -> int:
        """Blocks ``worker_id`` holds (0 for an unknown worker)."""
        i = self._index.get(worker_id)
        return 0 if i is None else len(self._held[i])

    def blocks_of(self, worker_id: int) -> set[int]:
        """A copy of the hashes ``worker_id`` holds (empty for an unknown worker)."""
        i = self._index.get(worker_id)
        return set() if i is None else set(self._held[i])

    @property
    def workers(self) -> list[int]:
        """Workers known to the index (seen in an event or a dump, not removed)."""
        return list(self._index)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks indexed (nodes of the tree)."""
        return len(self._nodes)

    # ------------------------------------------------------------------ mutations

    def apply(self, worker_id: int, data: KvEventData) -> None:
        """Apply one KV event payload of ``worker_id`` (see the module docstring)."""
        if isinstance(data, BlockStored):
            self._store(self._dense(worker_id), data.block_hashes)
        elif isinstance(data, BlockRemoved):
            i = self._index.get(worker_id)
            if i is not None:
                self._remove(i, data.block_hashes)
        elif isinstance(data, AllBlocksCleared):
            i = self._index.get(worker_id)
            if i is not None:
                self._clear(i)
        else:
            raise TypeError(f"not a KV event payload: {type(data).__name__}")

    def remove_worker(self, worker_id: int) -> None:
        """Drop all of ``worker_id``'s blocks and free its dense index (no-op if unknown)."""
        i = self._index.pop(worker_id, None)
        if i is None:
            return
        self._clear(i)
        self._ids[i] = None
        heapq.heappush(self._free, i)

    def load_dump(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Make ``worker_id``'s blocks exactly ``block_hashes``, touching only the difference."""
        i = self._dense(worker_id)
        dump = set(block_hashes)
        held = self._held[i]
        self._remove(i, held - dump)
        self._store(i, dump - held)

    # ------------------------------------------------------------------ internals

    def _dense(self, worker_id: int) -> int:
        """The dense index of ``worker_id``, assigning the lowest free one if new.

        Reusing the lowest index keeps masks (whose size grows with the highest bit)
        small after workers come and go.
        """
        i = self._index.get(worker_id)
        if i is not None:
            return i
        if self._free:
            i = heapq.heappop(self._free)
            self._ids[i] = worker_id
        else:
            i = len(self._ids)
            self._ids.append(worker_id)
            self._bits.append(1 << i)
            self._held.append(set())
        self._index[worker_id] = i
        return i

    def _store(self, i: int, hashes: Iterable[int]) -> None:
        nodes, held, bit = self._nodes, self._held[i], self._bits[i]
        get, add = nodes.get, held.add
        for h in hashes:
            if h in held:
                continue
            add(h)
            m = get(h)
            nodes[h] = bit if m is None else m | bit

    def _remove(self, i: int, hashes: Iterable[int]) -> None:
        held = self._held[i]
        gone = held.intersection(hashes)  # a set: a hash listed twice is removed once
        held.difference_update(gone)
        self._unmark(i, gone)

    def _clear(self, i: int) -> None:
        self._unmark(i, self._held[i])
        # A fresh set gives the (possibly huge) table's memory back.
        self._held[i] = set()

    def _unmark(self, i: int, hashes: Iterable[int]) -> None:
        """Clear bit ``i`` on ``hashes``, all of which worker ``i`` holds."""
        nodes, bits = self._nodes, self._bits
        bit = bits[i]
        for h in hashes:
            m = nodes[h] ^ bit
            if not m:
                del nodes[h]
            elif m & (m - 1) == 0:
                nodes[h] = bits[m.bit_length() - 1]  # back to the shared single-bit object
            else:
                nodes[h] = m


class EventSequencer:
    """Per-worker event ids: is this event the next one, old news, or after a gap?

    ``accept(worker_id, event_id, data=None)`` answers, and records the id when the
    answer is ``"apply"`` (the caller then applies the event):

    * ``"apply"``: the first id seen from that worker (whatever its value: a worker
      that appeared with a warm cache should also get a ``load_dump``), or
      ``last + 1``; also a **restart**: ``event_id == 0`` after a higher id, when
      ``data`` is ``AllBlocksCleared`` or not given. Engines start their numbering at
      0 and their event 0 is ``AllBlocksCleared`` (the mocker does), so applying it
      wipes the worker's stale blocks and the count starts over from 0;
    * ``"stale"``: an id at or below the last applied one (a redelivery); drop it;
    * ``"gap"``: ids were skipped (or an event 0 that is not ``AllBlocksCleared``
      arrived after a higher id: a restart whose clear we cannot see). The id is
      not recorded; the caller repairs (``KvIndexer.load_dump`` of a fresh dump, or
      a replay) and then calls ``reset(worker_id, last_applied_id)``.

    Limits: a restart whose event 0 is lost looks like stale events until the ids
    pass the old count; restarts normally show up as a new worker id (a new lease),
    which avoids this. A redelivered event 0 after ids 1..n were applied counts as a
    restart: the clear empties the worker's blocks and its next event is a gap, which
    the repair path fixes.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[int, int] = {}

    def accept(
        self, worker_id: int, event_id: int, data: KvEventData | None = None
    ) -> Literal["apply", "stale", "gap"]:
        last = self._last.get(worker_id)
        if last is None or event_id == last + 1:
            self._last[worker_id] = event_id
            return "apply"
        if event_id == 0 and last > 0:
            if data is None or isinstance(data, AllBlocksCleared):
                self._last[worker_id] = 0
                return "apply"
            return "gap"
        if event_id <= last:
            return "stale"
        return "gap"

    def last_event_id(self, worker_id: int) -> int | None:
        """The last id applied for ``worker_id`` (None if never seen or forgotten)."""
        return self._last.get(worker_id)

    def reset(self, worker_id: int, last_event_id: int) -> None:
        """Record ``last_event_id`` as applied (after a repair); the next is ``+ 1``."""
        self._last[worker_id] = last_event_id

    def forget(self, worker_id: int) -> None:
        """Forget ``worker_id``: its next event counts as the first seen."""
        self._last.pop(worker_id, None)
