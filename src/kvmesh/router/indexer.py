"""KV indexer: which workers hold which prefix blocks. Pure and synchronous.

A prefix tree over chained block sequence hashes (:mod:`kvmesh.kv.hashing`).
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
  the interned ``1 << i`` object of that worker, so it costs only its dict entry
  (and its hash's int); only shared blocks own a mask int;
* ``_log[i]``: an append-only array of unsigned 64-bit ints (``_LOG_TYPE``) of the hashes worker ``i`` was given
  (8 bytes each, where a set would cost ~60), so removing a worker, loading a dump
  and listing its blocks are O(that worker's blocks) rather than O(index). An entry
  is live while bit ``i`` is set on its node; removals leave dead entries behind (and
  a batch's store of a block held already a repeat), and the log is compacted once it
  is over twice its live count (amortised O(1)): by cutting its dead front when that
  is most of the dead entries (an engine evicts the blocks it stored first, mostly),
  else by a rebuild from the live entries.
  Hashes are therefore unsigned 64-bit ints (as :mod:`kvmesh.kv.hashing` makes
  them); anything else is a ``ValueError``.

Invariants: ``bit i is set in _nodes[h]`` ⇒ ``h in _log[i]``; ``_count[i]`` is the
number of nodes with bit ``i`` set; no mask is 0.

Cap (``max_blocks_per_worker``): a worker never holds more blocks in the index than
the cap, so one worker's events (a buggy engine, a hostile publisher) cannot grow the
router without bound. Eviction rule: when a store takes a worker over its cap, its
*oldest-stored* blocks (the front of its log, the order the events stored them in)
are dropped until it holds 7/8 of the cap; an engine evicts least-recently-used
blocks, and the oldest stored are the best guess at those that the router can make
without access times. Each eviction batch is O(cap) and frees cap/8 blocks, so the
cost per stored block stays O(1) amortised. ``evicted`` counts the blocks dropped.

:func:`check_event_data` says why an event payload cannot be applied (a hash that is
not an unsigned 64-bit int, too many blocks in one event) before anything is changed;
a payload decoded with the types of :mod:`kvmesh.kv.events` has had the same checks
while it was decoded. ``apply_many`` applies a batch's payloads in order, inline.

KV tiers: a stored/removed event names the tier (G1 device, G2 host, G3 disk) its
blocks entered or left. G1 is this index; each lower tier has an index of its own
(another :class:`KvIndexer`, made when its first event arrives, with the same cap), so
``find_matches`` and the hot path stay G1's. ``find_tier_matches(block_hashes)`` →
``{worker_id: (g1, g2, g3)}``: the leading run of blocks a worker holds in *any* tier,
counted by tier (a block in several tiers, between a move's two events, counts in the
fastest). ``blocks_of(w, tier)`` lists one tier. ``AllBlocksCleared`` and
``remove_worker`` clear every tier; ``load_dump`` (a G1 dump) clears the worker's lower
tiers, which a dump does not carry (they are learnt again from the next moves).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Sequence
from itertools import chain, compress, groupby, repeat
from operator import attrgetter, is_not, ne
from typing import Literal

from kvmesh.kv.events import MAX_EVENT_BLOCKS, KvEventView, StoredHashes
from kvmesh.kv.tiers import G1, G2, G3
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "KvIndexer",
    "EventSequencer",
    "check_event_data",
    "DEFAULT_MAX_BLOCKS_PER_WORKER",
    "MAX_EVENT_BLOCKS",
]

# A worker's blocks in the index at most (4 Mi blocks: 64 Mi tokens at block size 16).
DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 22
_U64 = 1 << 64

# Compact a worker's log when it holds more than 2 × live + this many entries.
_LOG_SLACK = 1024
# find_matches caches the decoding of masks with more bits than this, this many at most.
_DECODE_CACHE_MIN_BITS = 16
_DECODE_CACHE_SIZE = 2048
_FREE = -1  # the worker id of a free dense index (worker ids are lease ids, never negative)
# The logs' item type: unsigned 64-bit. "L" where C's unsigned long is 8 bytes (Linux, macOS):
# its conversion from an int is ~3x cheaper than "Q"'s (a byte-array conversion per hash).
_LOG_TYPE = "L" if array("L").itemsize == 8 else "Q"


# _BYTE_BITS[b]: positions of the set bits of the byte b.
_BYTE_BITS = [[j for j in range(8) if b >> j & 1] for b in range(256)]


def _bit_indices(mask: int) -> list[int]:
    """Positions of the set bits of ``mask`` (> 0), lowest first."""
    if mask.bit_count() <= 12:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    # Many bits: one conversion to bytes and a table per byte, instead of three
    # big-int operations per bit on an int as wide as the fleet.
    out = []
    append = out.append
    for k, b in enumerate(mask.to_bytes((mask.bit_length() + 7) >> 3, "little")):
        if b:
            base = k << 3
            for j in _BYTE_BITS[b]:
                append(base + j)
    return out


def check_event_data(data: KvEventView) -> str | None:
    """Why ``data`` must not be applied (a short reason, a metric label), or None."""
    if isinstance(data, AllBlocksCleared):
        return None
    hashes = data.block_hashes
    if len(hashes) > MAX_EVENT_BLOCKS:
        return "too_many_blocks"
    if not hashes:
        return None
    try:  # min/max in C; a decoded event holds only ints (the decoder checks their type)
        if min(hashes) < 0 or max(hashes) >= _U64:
            return "bad_hash"
    except TypeError:  # not comparable with 0: not numbers
        return "bad_hash"
    return None


class _NotPayload(TypeError):
    pass


_HASHES = attrgetter("block_hashes")


class KvIndexer:
    """Which workers hold which blocks; see the module docstring for the contract."""

    __slots__ = (
        "_nodes", "_log", "_count", "_bits", "_index", "_ids", "_free", "_decoded", "_lower", "max_blocks_per_worker",
        "evicted",
    )  # fmt: skip

    def __init__(self, max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER) -> None:
        if max_blocks_per_worker < 8:
            raise ValueError(f"max_blocks_per_worker must be at least 8, got {max_blocks_per_worker}")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.evicted = 0
        self._nodes: dict[int, int] = {}
        self._log: list[array[int]] = []  # by dense index
        self._count: list[int] = []  # by dense index: live blocks
        self._bits: list[int] = []  # by dense index: the interned 1 << i
        self._index: dict[int, int] = {}  # worker id -> dense index
        self._ids: list[int] = []  # dense index -> worker id (_FREE: none)
        self._free: list[int] = []  # heap of free dense indices
        # Wide masks seen by find_matches -> their worker ids. Popular prefixes end in
        # the same few masks, and decoding 500 bits costs more than the rest of a query.
        # Valid while dense indices keep their worker ids: cleared when one is freed.
        self._decoded: dict[int, tuple[int, ...]] = {}
        self._lower: dict[int, KvIndexer] = {}  # tier (G2, G3) -> its index, once it has had an event

    # ------------------------------------------------------------------ queries

    def find_matches(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """``{worker_id: leading blocks held}`` for workers holding the first block."""
        if not block_hashes:
            return {}
        nodes = self._nodes
        live = nodes.get(block_hashes[0])
        if live is None:
            return {}
        bits = self._bits
        out: dict[int, int] = {}
        depth = 1
        for h in block_hashes[1:]:
            m = nodes.get(h)
            if m is None:
                break
            if m is not live and m != live:  # equal: the same holders, nothing to narrow
                narrowed = live & m
                if narrowed != live:
                    # Workers in live but not in m held exactly `depth` leading blocks.
                    # When most of live drops out, write all of live (its decoding is
                    # shared by every query through this prefix, so likely cached);
                    # the survivors' entries are overwritten with their longer runs.
                    gone = live if narrowed.bit_count() * 4 <= live.bit_count() else live ^ narrowed
                    out.update(dict.fromkeys(self._workers_in(gone), depth))
                    if not narrowed:
                        return out
                    live = narrowed
                    if live & (live - 1) == 0:
                        # One worker left: switch to its interned bit, which its
                        # privately held nodes store, so they pass the identity test.
                        live = bits[live.bit_length() - 1]
            depth += 1
        out.update(dict.fromkeys(self._workers_in(live), depth))
        return out

    def find_tier_matches(self, block_hashes: Sequence[int]) -> dict[int, tuple[int, int, int]]:
        """``{worker_id: (g1, g2, g3)}``: for workers holding the first block in any tier,
        the leading run of ``block_hashes`` they hold in some tier, counted by tier.
        Without lower-tier blocks: :meth:`find_matches`'s runs, all G1."""
        if not self.has_lower_tiers:
            return {w: (n, 0, 0) for w, n in self.find_matches(block_hashes).items()}
        tiers = [(G1, self)] + [(t, self._lower[t]) for t in (G2, G3) if t in self._lower]
        counts: dict[int, list[int]] = {}
        live: set[int] | None = None
        for h in block_hashes:
            holders: dict[int, int] = {}
            for t, index in reversed(tiers):  # the fastest tier last: it wins
                m = index._nodes.get(h)
                if m is not None:
                    holders.update(dict.fromkeys(index._workers_in(m), t))
            if live is not None:
                holders = {w: t for w, t in holders.items() if w in live}
            if not holders:
                break
            for w, t in holders.items():
                counts.setdefault(w, [0, 0, 0])[t - 1] += 1
            live = set(holders)
        return {w: (c[0], c[1], c[2]) for w, c in counts.items()}

    @property
    def has_lower_tiers(self) -> bool:
        """Whether any worker holds blocks in G2 or G3."""
        return any(index._nodes for index in self._lower.values())

    def worker_block_count(self, worker_id: int, tier: int = G1) -> int:
        """Blocks ``worker_id`` holds in ``tier`` (0 for an unknown worker)."""
        if tier != G1:
            lower = self._lower.get(tier)
            return 0 if lower is None else lower.worker_block_count(worker_id)
        i = self._index.get(worker_id)
        return 0 if i is None else self._count[i]

    def blocks_of(self, worker_id: int, tier: int = G1) -> set[int]:
        """The hashes ``worker_id`` holds in ``tier`` (empty for an unknown worker)."""
        if tier != G1:
            lower = self._lower.get(tier)
            return set() if lower is None else lower.blocks_of(worker_id)
        i = self._index.get(worker_id)
        return set() if i is None else set(self._live(i))

    @property
    def workers(self) -> list[int]:
        """Workers known to the index (seen in an event or a dump, not removed)."""
        return list(self._index)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks indexed (nodes of the tree)."""
        return len(self._nodes)

    # ------------------------------------------------------------------ mutations

    def apply(self, worker_id: int, data: KvEventView) -> None:
        """Apply one KV event payload of ``worker_id`` (see the module docstring)."""
        if isinstance(data, (StoredHashes, BlockRemoved)) and data.tier != G1:
            self._apply_lower(worker_id, data.tier, isinstance(data, StoredHashes), data.block_hashes)
            return
        if isinstance(data, AllBlocksCleared):
            for lower in self._lower.values():
                lower.apply(worker_id, data)
        if isinstance(data, StoredHashes):  # a BlockStored, or what the router decodes of one
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

    def apply_many(self, worker_id: int, events: Iterable[KvEventView]) -> None:
        """Apply several event payloads of ``worker_id`` in order, as ``apply`` each would.

        The router's hot path: consecutive events of one kind (an engine step stores a
        run of blocks, or evicts one) are applied as one run, their hashes looked up and
        written by C loops (``map``, ``compress``, ``dict.update``); Python code runs
        per run, and per hash only for blocks other workers also hold. Hashes must be
        valid (a decoded payload's are: :mod:`kvmesh.kv.events` checks them while
        decoding); an invalid one raises ``ValueError``, the runs before it applied.
        The cap and the log's compaction are checked once, at the end: until then the
        worker may pass its cap by this batch's blocks.
        """
        events = events if isinstance(events, list) else list(events)
        # one C-level pass: a batch that moves blocks between tiers goes event by event
        if max(map(getattr, events, repeat("tier"), repeat(G1)), default=G1) != G1:
            for data in events:
                self.apply(worker_id, data)
            return
        i = self._index.get(worker_id)
        delta = 0
        try:
            for kind, group in groupby(events, type):
                if kind is StoredHashes or kind is BlockStored:
                    if i is None:
                        i = self._dense(worker_id)
                    delta += self._store_run(i, list(chain.from_iterable(map(_HASHES, group))))
                elif kind is BlockRemoved:
                    if i is not None:
                        delta -= self._remove_run(i, list(chain.from_iterable(map(_HASHES, group))))
                elif kind is AllBlocksCleared:
                    for lower in self._lower.values():
                        lower.apply(worker_id, AllBlocksCleared())
                    if i is not None:
                        self._count[i] += delta
                        delta = 0
                        self._clear(i)
                else:
                    raise _NotPayload(f"not a KV event payload: {kind.__name__}")
        except _NotPayload:
            raise
        except (OverflowError, TypeError) as e:
            raise ValueError(f"block hashes must be unsigned 64-bit ints: {e}") from None
        finally:
            if i is not None:
                self._settle(i, delta)

    def _apply_lower(self, worker_id: int, tier: int, stored: bool, hashes: list[int]) -> None:
        lower = self._lower.get(tier)
        if lower is None:
            if not stored:
                return
            lower = self._lower[tier] = KvIndexer(self.max_blocks_per_worker)
        if stored:
            lower._store(lower._dense(worker_id), hashes)
        else:
            j = lower._index.get(worker_id)
            if j is not None:
                lower._remove(j, hashes)

    def _store_run(self, i: int, hashes: list[int]) -> int:
        """Give worker ``i`` the blocks ``hashes``; returns how many it did not hold.

        One probe per hash (``setdefault`` writes the worker's bit where there was no
        node, the common case); the log takes the whole run first (an invalid hash
        raises before a node is written). Hashes the worker held already, or that
        repeat in the run, leave duplicate log entries: harmless (see ``_live``), and
        compacted with the rest (``_settle``)."""
        nodes, bit = self._nodes, self._bits[i]
        self._log[i].fromlist(hashes)  # (all or nothing: an invalid hash leaves the log as it was)
        before = len(nodes)
        masks = list(map(nodes.setdefault, hashes, repeat(bit)))
        added = len(nodes) - before
        if added < len(hashes):  # blocks other workers hold (or this one already, or repeated)
            for h in compress(hashes, map(is_not, masks, repeat(bit))):
                m = nodes[h]  # read again: a hash may repeat in the run
                if not m & bit:
                    nodes[h] = m | bit
                    added += 1
        return added

    def _remove_run(self, i: int, hashes: list[int]) -> int:
        """Take worker ``i`` off the blocks ``hashes``; returns how many it held.

        One probe per hash: every node is popped, and those other workers hold too
        are put back without the worker's bit (a hash repeated in the run pops as
        absent the second time)."""
        nodes, bits = self._nodes, self._bits
        bit = bits[i]
        masks = list(map(nodes.pop, hashes, repeat(None)))
        gone = masks.count(bit)  # held by this worker alone (the interned bit: see _clear_bit)
        if gone < len(hashes):  # not held, or held with other workers
            for h, m in compress(zip(hashes, masks), map(ne, masks, repeat(bit))):
                if m is None:
                    continue
                if m & bit:
                    gone += 1
                    m ^= bit
                    nodes[h] = bits[m.bit_length() - 1] if m & (m - 1) == 0 else m
                else:
                    nodes[h] = m  # not this worker's: put back as it was
        return gone

    def _settle(self, i: int, delta: int) -> None:
        """After a batch: worker ``i``'s count, then its cap, then its log's compaction."""
        self._count[i] += delta
        if self._count[i] > self.max_blocks_per_worker:
            self._evict_oldest(i)
        elif len(self._log[i]) > 2 * self._count[i] + _LOG_SLACK:
            self._compact(i)

    def _compact(self, i: int) -> None:
        """Drop worker ``i``'s dead log entries (and repeats). An engine evicts its least
        recently used blocks, mostly the ones stored first, so the dead entries gather at
        the front of the log: when the dead run there is at least half of the entries to
        drop, cutting it (one probe per dead entry) is enough; otherwise the log is rebuilt
        from its live entries, each once, in their order."""
        log = self._log[i]
        get, bit = self._nodes.get, self._bits[i]
        run = 0
        for h in log:
            if get(h, 0) & bit:
                break
            run += 1
        if 2 * run >= len(log) - self._count[i]:
            del log[:run]
        else:
            self._log[i] = array(_LOG_TYPE, dict.fromkeys(self._live(i)))

    def remove_worker(self, worker_id: int) -> None:
        """Drop all of ``worker_id``'s blocks and free its dense index (no-op if unknown)."""
        for lower in self._lower.values():
            lower.remove_worker(worker_id)
        i = self._index.pop(worker_id, None)
        if i is None:
            return
        self._clear(i)
        self._ids[i] = _FREE
        self._decoded.clear()
        heapq.heappush(self._free, i)

    def load_dump(self, worker_id: int, block_hashes: Iterable[int]) -> None:
        """Make ``worker_id``'s G1 blocks exactly ``block_hashes``, touching only the
        difference; its lower tiers are cleared (a dump does not list them)."""
        for lower in self._lower.values():
            lower.remove_worker(worker_id)
        i = self._dense(worker_id)
        dump = set(block_hashes)
        held = set(self._live(i))
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
            self._log.append(array(_LOG_TYPE))
            self._count.append(0)
        self._index[worker_id] = i
        return i

    def _workers_in(self, mask: int) -> tuple[int, ...]:
        """Worker ids of the bits of ``mask`` (> 0)."""
        ids = self._ids
        if mask & (mask - 1) == 0:
            return (ids[mask.bit_length() - 1],)
        if mask.bit_count() <= _DECODE_CACHE_MIN_BITS:
            return tuple(map(ids.__getitem__, _bit_indices(mask)))
        out = self._decoded.get(mask)
        if out is None:
            if len(self._decoded) >= _DECODE_CACHE_SIZE:
                self._decoded.clear()
            out = self._decoded[mask] = tuple(map(ids.__getitem__, _bit_indices(mask)))
        return out

    def _live(self, i: int) -> Iterable[int]:
        """Worker ``i``'s live log entries (a hash stored twice, or stored, removed and
        stored again, may repeat)."""
        nodes, bit = self._nodes, self._bits[i]
        get = nodes.get
        return (h for h in self._log[i] if get(h, 0) & bit)

    def _store(self, i: int, hashes: Iterable[int]) -> None:
        nodes, bit, append = self._nodes, self._bits[i], self._log[i].append
        get = nodes.get
        added = 0
        try:
            for h in hashes:
                m = get(h)
                if m is None:
                    append(h)  # first: an invalid hash raises before anything changes
                    nodes[h] = bit
                elif not m & bit:
                    append(h)
                    nodes[h] = m | bit
                else:
                    continue
                added += 1
        except (OverflowError, TypeError) as e:
            raise ValueError(f"block hashes must be unsigned 64-bit ints: {e}") from None
        finally:
            self._count[i] += added
            if self._count[i] > self.max_blocks_per_worker:
                self._evict_oldest(i)

    def _evict_oldest(self, i: int) -> None:
        """Drop worker ``i``'s oldest-stored blocks down to 7/8 of the cap (see the module docstring)."""
        keep = self.max_blocks_per_worker * 7 // 8
        live = list(dict.fromkeys(self._live(i)))  # oldest first, each hash once
        drop = len(live) - keep
        if drop <= 0:
            return
        self.evicted += self._unmark(i, live[:drop])
        self._log[i] = array(_LOG_TYPE, live[drop:])

    def _remove(self, i: int, hashes: Iterable[int]) -> None:
        if self._unmark(i, hashes) and len(self._log[i]) > 2 * self._count[i] + _LOG_SLACK:
            self._compact(i)

    def _clear(self, i: int) -> None:
        self._unmark(i, self._log[i])
        # A fresh array gives the (possibly large) buffer back.
        self._log[i] = array(_LOG_TYPE)

    def _unmark(self, i: int, hashes: Iterable[int]) -> int:
        """Clear bit ``i`` on those of ``hashes`` that have it; returns how many did."""
        get = self._nodes.get
        # (a mask read lazily: a hash listed twice finds its bit cleared the second time)
        gone = self._clear_bit(self._bits[i], ((h, get(h)) for h in hashes))
        self._count[i] -= gone
        return gone

    def _clear_bit(self, bit: int, held: Iterable[tuple[int, int | None]]) -> int:
        """Clear ``bit`` on the nodes of those (hash, mask) pairs whose mask has it;
        returns how many had it."""
        nodes, bits = self._nodes, self._bits
        gone = 0
        for h, m in held:
            if m is None or not m & bit:
                continue  # not held (or listed twice)
            gone += 1
            m ^= bit
            if not m:
                del nodes[h]
            elif m & (m - 1) == 0:
                nodes[h] = bits[m.bit_length() - 1]  # back to the shared single-bit object
            else:
                nodes[h] = m
        return gone


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
        self, worker_id: int, event_id: int, data: KvEventView | None = None
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
