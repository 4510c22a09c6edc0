"""One engine's KV block pool (mocker and hf alike): prefix caching, reference counts, LRU eviction, KV events.

Pure: no asyncio, no I/O, no clock. The scheduler is its only caller.

Model
-----
``num_blocks`` blocks of ``block_size`` token slots. A sequence (an int id chosen by the
caller) holds a list of blocks; block ``i`` holds its tokens ``[i·bs, (i+1)·bs)``.

* A block is *cached* once it is full of computed tokens and registered under its
  chained sequence hash (:mod:`kvmesh.kv.hashing`) with :meth:`BlockManager.commit`.
  A new sequence reuses the cached blocks of its common leading run of hashes
  (reference count + 1) instead of computing them.
* A block whose reference count drops to 0 stays cached in an LRU free list and is
  evicted only when a fresh block is needed and no never-cached block is free.
  Eviction order is least recently freed first; a sequence frees its blocks tail
  first, so its tail is evicted before its (more shareable) prefix.
* If two sequences compute the same content at once, the first commit wins; the other
  block stays private (uncached) and goes back to the empty pool when freed. Every
  hash therefore names at most one block, which keeps events replayable into a set.

Events (only when prefix caching is on), each a :class:`~kvmesh.protocol.KvEvent`
with ``event_id`` 0, 1, 2, ... (per manager, no gaps; :meth:`reset` does not restart
the count): ``BlockStored`` for each contiguous run of newly cached blocks,
``BlockRemoved`` for blocks evicted by one allocation, ``AllBlocksCleared`` on
:meth:`reset`. Replaying every event into a set gives exactly :meth:`dump`.

Tiers (``host_blocks`` / ``disk_blocks`` > 0; :mod:`.tiers`): a cached block evicted
from this pool (G1) is written down to G2/G3 instead of being dropped (events: its
``BlockRemoved`` from G1, then ``BlockStored``/``BlockRemoved`` with ``tier`` for the
moves below). :meth:`lookup` counts a leading run cached in any tier, and
:meth:`allocate` brings the lower-tier part of it back (onboarding: fresh G1 blocks take
those hashes at once, ``BlockRemoved`` from their tier then ``BlockStored`` into G1);
:meth:`take_onboarded` tells the caller how many blocks came up from each tier since it
last asked, which the engine pays for in time (the mocker: bytes ÷ the tier's
bandwidth). Replaying the events into one set per tier gives :meth:`dump_tiers`.
Without tiers nothing changes: no lower-tier event is ever emitted.

An engine that keeps real KV in its tiers sets :attr:`BlockManager.slots` (a
:class:`TierSlots`): it is told every move with the G1 block ids involved, in order, as
it happens (before any block id is reused), so it can copy the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvmesh.engines.batching.tiers import G1, G2, G3, TIERS, LowerTiers, Move
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventData
from kvmesh.runtime.events import EventPublisher, KvEventRing, NullPublisher

__all__ = ["BlockManager", "TierSlots"]


class TierSlots(Protocol):
    """What an engine with real tier storage is told (engines/hf/tiers.py), in order."""

    def moved(self, moves: list[Move], evicted: Mapping[int, int]) -> None:
        """``moves`` wrote blocks down / dropped them; ``evicted``: hash → the G1 block
        it just left (still holding its content until the next pass)."""

    def taken(self, moves: list[Move]) -> None:
        """``moves`` took blocks out of their tiers for onboarding (placed next)."""

    def onboarded(self, placed: Mapping[int, int]) -> None:
        """Blocks taken just before now fill these G1 blocks (hash → block id)."""

    def cleared(self) -> None:
        """Every tier forgot everything (:meth:`BlockManager.reset`)."""


class _SeqBlocks:
    """The block table of one sequence; ``committed`` leading blocks are hashed
    (cached, or a private duplicate of cached content)."""

    __slots__ = ("blocks", "committed")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.committed = 0


class BlockManager:
    """KV block pool of one worker. See the module docstring for the model."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        publisher: EventPublisher | None = None,
        worker_id: int = 0,
        enable_prefix_caching: bool = True,
        ring_capacity: int = 1024,
        host_blocks: int = 0,
        disk_blocks: int = 0,
        onboard_tiers: tuple[int, ...] = (G2, G3),
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.worker_id = worker_id
        self.enable_prefix_caching = enable_prefix_caching
        self.ring = KvEventRing(ring_capacity)
        self._publisher: EventPublisher = publisher if publisher is not None else NullPublisher()
        self._next_event_id = 0
        self.tiers = LowerTiers(host_blocks, disk_blocks, onboard_tiers) if enable_prefix_caching else LowerTiers()
        self._onboarding = dict.fromkeys(TIERS, 0)  # blocks brought up since take_onboarded
        self.slots: TierSlots | None = None  # an engine's tensors behind the tiers, if any
        self._init_pool()

    def _init_pool(self) -> None:
        n = self.num_blocks
        self._ref = [0] * n
        self._hash: list[int | None] = [None] * n
        # Never-cached free blocks, a stack (block 0 on top).
        self._empty: list[int] = list(range(n - 1, -1, -1))
        # Cached free blocks in eviction order (first = evicted next).
        self._lru: OrderedDict[int, None] = OrderedDict()
        # Sequence hash -> the one block holding that content (referenced or free).
        self._cached: dict[int, int] = {}
        self._seqs: dict[int, _SeqBlocks] = {}

    # ------------------------------------------------------------------ queries

    @property
    def active_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._empty) - len(self._lru)

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take (never-cached plus evictable cached ones)."""
        return len(self._empty) + len(self._lru)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (``active_blocks / num_blocks``)."""
        return self.active_blocks / self.num_blocks

    @property
    def next_event_id(self) -> int:
        """The id the next event will carry (= number of events emitted so far)."""
        return self._next_event_id

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def lookup(self, seq_hashes: Sequence[int]) -> int:
        """How many leading hashes of ``seq_hashes`` are cached (0 without caching)."""
        if not self.enable_prefix_caching:
            return 0
        cached = self._cached
        n = 0
        if self.tiers.enabled:
            lower = self.tiers
            for h in seq_hashes:
                if h not in cached and h not in lower:
                    break
                n += 1
            return n
        for h in seq_hashes:
            if h not in cached:
                break
            n += 1
        return n

    @property
    def tables(self) -> Mapping[int, _SeqBlocks]:
        """Every sequence's block table by id (read-only: the scheduler's decode fast
        path checks ``len(tables[id].blocks) * block_size`` for room without a call)."""
        return self._seqs

    def held_blocks(self, seq_id: int) -> int:
        """Length of ``seq_id``'s block table (0 if unknown)."""
        seq = self._seqs.get(seq_id)
        return len(seq.blocks) if seq is not None else 0

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of ``seq_id``'s block ids, in token order (empty if unknown)."""
        seq = self._seqs.get(seq_id)
        return list(seq.blocks) if seq is not None else []

    def dump(self) -> set[int]:
        """Sequence hashes of every cached block, referenced or free (G1 only)."""
        return set(self._cached)

    def dump_tiers(self) -> dict[int, set[int]]:
        """Each tier's sequence hashes (G1: :meth:`dump`)."""
        return {G1: self.dump(), **{t: self.tiers.blocks(t) for t in TIERS if t != G1}}

    def take_onboarded(self) -> dict[int, int]:
        """Blocks brought up into G1 from each lower tier since the last call (tier →
        count, zeros included); the counts start over."""
        out, self._onboarding = self._onboarding, dict.fromkeys(TIERS, 0)
        return out

    # ------------------------------------------------------------------ mutations

    def allocate(self, seq_id: int, num_tokens: int, prefix_hashes: Sequence[int] = ()) -> bool:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; all or nothing.

        For a sequence not yet known, ``prefix_hashes`` (a cached leading run, as
        counted by :meth:`lookup`) are reused first, then fresh blocks are taken,
        evicting cached free blocks if needed. Returns False, changing nothing, when
        the pool is short. ``prefix_hashes`` is ignored for a known sequence.
        """
        seq = self._seqs.get(seq_id)
        need = -(-num_tokens // self.block_size)
        if seq is not None:
            if need <= len(seq.blocks):
                return True
            return self._grow(seq, need - len(seq.blocks))
        hashes = prefix_hashes[:need]
        if self.tiers.enabled and not all(map(self._cached.__contains__, hashes)):
            return self._allocate_tiered(seq_id, need, hashes)
        hits = [self._cached[h] for h in hashes]
        reclaimed = sum(1 for b in hits if self._ref[b] == 0)
        fresh = need - len(hits)
        if fresh > self.free_blocks - reclaimed:
            return False
        self.tiers.stats.hits[G1] += len(hits)
        seq = self._seqs[seq_id] = _SeqBlocks()
        # Touch hits before taking fresh blocks so they cannot be evicted by this call.
        for b in hits:
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1
        seq.blocks.extend(hits)
        seq.committed = len(hits)
        if fresh > 0:
            seq.blocks.extend(self._take(fresh))
        return True

    def _allocate_tiered(self, seq_id: int, need: int, hashes: Sequence[int]) -> bool:
        """:meth:`allocate` of a new sequence whose prefix is partly in a lower tier: its
        G1 blocks are reused, the others onboarded into fresh blocks (all or nothing)."""
        cached, ref = self._cached, self._ref
        hits = [cached.get(h, -1) for h in hashes]
        up = [h for h, b in zip(hashes, hits) if b < 0]
        reclaimed = sum(1 for b in hits if b >= 0 and ref[b] == 0)
        if need - (len(hits) - len(up)) > self.free_blocks - reclaimed:
            return False
        seq = self._seqs[seq_id] = _SeqBlocks()
        for b in hits:
            if b >= 0:
                if ref[b] == 0:
                    del self._lru[b]
                ref[b] += 1
        # NOTE: out of their tier before fresh blocks are taken, so that the write-down
        # of what this allocation evicts from G1 cannot push them out of it
        moves = self.tiers.take(up)
        for move in moves:
            self._onboarding[move.tier] += len(move.hashes)
            self.tiers.stats.hits[move.tier] += len(move.hashes)
        self.tiers.stats.hits[G1] += len(hits) - len(up)
        self._emit_moves(moves)
        if self.slots is not None:
            self.slots.taken(moves)
        fresh = iter(self._take(need - len(hits) + len(up)))
        placed: dict[int, int] = {}
        run_start = -1
        for i, (h, b) in enumerate(zip(hashes, hits)):
            if b < 0:
                b = placed[h] = next(fresh)
                cached[h] = b
                self._hash[b] = h
                run_start = i if run_start < 0 else run_start
            elif run_start >= 0:
                self._stored(hashes, (), run_start, i)
                run_start = -1
            seq.blocks.append(b)
        if run_start >= 0:
            self._stored(hashes, (), run_start, len(hashes))
        seq.blocks.extend(fresh)
        seq.committed = len(hashes)
        if self.slots is not None:
            self.slots.onboarded(placed)
        return True

    def _grow(self, seq: _SeqBlocks, fresh: int) -> bool:
        empty = self._empty
        if fresh == 1 and empty:  # a decode's next block, never cached: _take(1) without its bookkeeping
            b = empty.pop()
            self._ref[b] = 1
            seq.blocks.append(b)
            return True
        if fresh > self.free_blocks:
            return False
        seq.blocks.extend(self._take(fresh))
        return True

    def _take(self, n: int) -> list[int]:
        """``n`` blocks with reference count 1; caller checked ``n <= free_blocks``."""
        out: list[int] = []
        evicted: list[int] = []
        left: dict[int, int] = {}  # evicted hash -> its G1 block (for self.slots)
        track = self.slots is not None
        empty, lru, hashes, ref = self._empty, self._lru, self._hash, self._ref
        for _ in range(n):
            if empty:
                b = empty.pop()
            else:
                b, _unused = lru.popitem(last=False)
                h = hashes[b]
                if h is not None:
                    del self._cached[h]
                    hashes[b] = None
                    evicted.append(h)
                    if track:
                        left[h] = b
            ref[b] = 1
            out.append(b)
        if evicted:
            self._emit(BlockRemoved(block_hashes=evicted))
            if self.tiers.enabled:
                moves = self.tiers.demote(evicted)
                self._emit_moves(moves)
                if self.slots is not None:
                    self.slots.moved(moves, left)
        return out

    def _emit_moves(self, moves: list[Move]) -> None:
        for tier, stored, hashes in moves:
            self._emit(BlockStored(block_hashes=hashes, tier=tier) if stored else BlockRemoved(block_hashes=hashes, tier=tier))

    def commit(self, seq_id: int, seq_hashes: Sequence[int], local_hashes: Sequence[int], num_full: int) -> None:
        """Register ``seq_id``'s first ``num_full`` blocks as full of computed tokens.

        ``seq_hashes``/``local_hashes`` cover at least ``num_full`` blocks. Blocks
        already committed are skipped; new ones are cached under their hash (unless
        another block holds that content) and announced with ``BlockStored``.
        """
        seq = self._seqs[seq_id]
        start = seq.committed
        if num_full <= start:
            return
        seq.committed = num_full
        if not self.enable_prefix_caching:
            return
        run_start = -1
        for i in range(start, num_full):
            h = seq_hashes[i]
            if h in self._cached:  # duplicate content: keep the block private
                if run_start >= 0:
                    self._stored(seq_hashes, local_hashes, run_start, i)
                    run_start = -1
                continue
            b = seq.blocks[i]
            self._cached[h] = b
            self._hash[b] = h
            if self.tiers.enabled:  # computed again beside a copy in a tier not onboarded from
                moves = self.tiers.discard(h)
                self._emit_moves(moves)
                if self.slots is not None and moves:
                    self.slots.moved(moves, {})
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._stored(seq_hashes, local_hashes, run_start, num_full)

    def _stored(self, seq_hashes: Sequence[int], local_hashes: Sequence[int], lo: int, hi: int) -> None:
        self._emit(
            BlockStored(
                block_hashes=list(seq_hashes[lo:hi]),
                token_hashes=list(local_hashes[lo:hi]),  # (none for onboarded blocks)
                parent_hash=seq_hashes[lo - 1] if lo > 0 else None,
            )
        )

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``'s blocks, tail first (no-op for an unknown id).

        Cached blocks reaching reference count 0 join the end of the LRU list, so
        the tail is evicted before the prefix; uncached ones go back to the empty pool.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        ref, hashes, lru, empty = self._ref, self._hash, self._lru, self._empty
        for b in reversed(seq.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if hashes[b] is not None:
                    lru[b] = None
                else:
                    empty.append(b)

    def reset(self) -> None:
        """Drop every sequence and all cached content (every tier's); emits ``AllBlocksCleared``."""
        self._init_pool()
        self.tiers.clear()
        if self.slots is not None:
            self.slots.cleared()
        if self.enable_prefix_caching:
            self._emit(AllBlocksCleared())

    def _emit(self, data: KvEventData) -> None:
        event = KvEvent(worker_id=self.worker_id, event_id=self._next_event_id, data=data)
        self._next_event_id += 1
        self.ring.append(event)
        self._publisher.publish_kv(event)
