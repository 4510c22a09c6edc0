"""KV tiers below the device pool: which evicted blocks a worker keeps, and where. Pure.

The device pool (G1) is :class:`~kvmesh.engines.batching.block_manager.BlockManager`'s;
this module holds the tiers under it, G2 (host memory, ``--host-kv-blocks``) and G3
(local disk, ``--disk-kv-blocks``), as LRU lists of sequence hashes (what a block holds
is the engine's business: the mocker models it, an engine with real tensors keeps a
slot per hash).

Moves (a block is in one tier at a time; a tier of capacity 0 is skipped):

* **write-down**: a cached block evicted from G1 enters the highest lower tier with room
  (:meth:`LowerTiers.demote`); a tier over its capacity pushes its least recently used
  blocks one tier down, and the lowest tier drops them. Blocks written down together
  enter most-recently-used in the order given, so a sequence's prefix (freed last,
  evicted last) stays longest.
* **onboarding**: a prefix hit in G2/G3 takes the blocks out of their tier
  (:meth:`LowerTiers.take`); the block manager gives them G1 blocks again. Only tiers
  in ``onboard`` count as hits (the mocker leaves out a tier slower than recomputing);
  a block computed again in G1 leaves its lower tier (:meth:`LowerTiers.discard`).

Every move is reported as :class:`Move` values in order (``removed`` from / ``stored``
into one tier), which the block manager turns into KV events; applying them in order
to a set per tier gives :meth:`LowerTiers.blocks`. :class:`TierStats` counts blocks:
prefix hits per tier, blocks written into each lower tier and onboarded from it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.kv.tiers import G1, G2, G3, TIERS

__all__ = ["G1", "G2", "G3", "TIERS", "LowerTiers", "Move", "TierStats"]


class Move(NamedTuple):
    """Blocks that left (``stored=False``) or entered (``stored=True``) ``tier``."""

    tier: int
    stored: bool
    hashes: list[int]


@dataclass(slots=True)
class TierStats:
    """Block counts since start, by tier (keys: :data:`TIERS`)."""

    hits: dict[int, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    written: dict[int, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    onboarded: dict[int, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))


class LowerTiers:
    """G2 and G3 of one worker (see the module docstring). ``capacity`` maps a tier to
    its size in blocks; tiers of size 0 do not exist."""

    def __init__(self, host_blocks: int = 0, disk_blocks: int = 0, onboard: tuple[int, ...] = (G2, G3)) -> None:
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError(f"tier sizes must be >= 0 blocks, got host {host_blocks}, disk {disk_blocks}")
        self.capacity = {G2: host_blocks, G3: disk_blocks}
        self._order = [t for t in (G2, G3) if self.capacity[t] > 0]
        # the tiers a prefix hit is brought up from (one slower than recomputing is not)
        self._onboard = [t for t in self._order if t in onboard]
        self._lru: dict[int, OrderedDict[int, None]] = {t: OrderedDict() for t in (G2, G3)}
        self.stats = TierStats()

    @property
    def enabled(self) -> bool:
        """Whether any lower tier exists."""
        return bool(self._order)

    def tier_of(self, h: int) -> int | None:
        """The lower tier holding ``h``, or None."""
        for t in self._order:
            if h in self._lru[t]:
                return t
        return None

    def __contains__(self, h: object) -> bool:
        """Whether ``h`` is in a tier it may be onboarded from (a prefix hit)."""
        return any(h in self._lru[t] for t in self._onboard)

    def discard(self, h: int) -> list[Move]:
        """Drop ``h`` from its tier, if any (its content was computed again in G1)."""
        t = self.tier_of(h)
        if t is None:
            return []
        del self._lru[t][h]
        return [Move(t, False, [h])]

    def blocks(self, tier: int) -> set[int]:
        """The hashes ``tier`` (G2 or G3) holds."""
        return set(self._lru[tier]) if tier in self._lru else set()

    def size(self, tier: int) -> int:
        return len(self._lru[tier]) if tier in self._lru else 0

    def demote(self, hashes: Sequence[int]) -> list[Move]:
        """Write ``hashes`` (just evicted from G1, none held here) down; the moves made."""
        moves: list[Move] = []
        carry = list(hashes)
        for t in self._order:
            if not carry:
                break
            moves.append(Move(t, True, carry))
            self.stats.written[t] += len(carry)
            lru = self._lru[t]
            lru.update(dict.fromkeys(carry))
            over = len(lru) - self.capacity[t]
            carry = [lru.popitem(last=False)[0] for _ in range(over)] if over > 0 else []
            if carry:
                moves.append(Move(t, False, carry))
        return moves

    def take(self, hashes: Iterable[int]) -> list[Move]:
        """Take ``hashes`` (each held here) out of their tiers for onboarding; the moves
        made, one per tier, and the onboarded counts updated."""
        out: dict[int, list[int]] = {}
        for h in hashes:
            t = self.tier_of(h)
            if t is None:
                raise KeyError(f"block {h:#x} is in no lower tier")
            del self._lru[t][h]
            out.setdefault(t, []).append(h)
        for t, hs in out.items():
            self.stats.onboarded[t] += len(hs)
        return [Move(t, False, hs) for t, hs in out.items()]

    def clear(self) -> None:
        """Forget every block (the engine's reset: its events clear all tiers)."""
        for lru in self._lru.values():
            lru.clear()
