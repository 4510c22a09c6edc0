"""Approximate KV indexer: predicted cache contents from the router's own decisions.

Used in ``kv-approx`` mode, where workers publish no KV events. After routing a
request to a worker, the router records the request's block hashes as cached there;
the prediction decays:

* an entry ``(worker, hash)`` expires ``ttl_s`` after it was last recorded
  (recording it again refreshes it);
* the total number of entries is capped at ``max_blocks``; over the cap, the
  oldest-recorded entries are evicted first. Within one :meth:`ApproxIndexer.record`
  call, later blocks count as older than earlier ones, so a sequence's tail is
  evicted before its prefix (a tail without its prefix can never match).

Pure and synchronous: the clock is the ``now`` argument, which must not go
backwards from one call to the next (entries are kept in recording order, which
is then expiry order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.protocol import BlockRemoved, BlockStored
from kvmesh.router.indexer import KvIndexer

__all__ = ["ApproxIndexer"]


class ApproxIndexer:
    """Predicted ``{worker: blocks}`` with a TTL and a size cap; see the module docstring."""

    __slots__ = ("ttl_s", "max_blocks", "_index", "_expiry")

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._index = KvIndexer()
        # (worker_id, hash) -> expiry time, oldest first.
        self._expiry: OrderedDict[tuple[int, int], float] = OrderedDict()

    def record(self, worker_id: int, block_hashes: Sequence[int], now: float) -> None:
        """Predict that ``worker_id`` now caches ``block_hashes`` (refreshing known ones)."""
        self.expire(now)
        expiry, deadline = self._expiry, now + self.ttl_s
        new = []
        for h in reversed(block_hashes):  # prefix recorded last: it is evicted last
            key = (worker_id, h)
            if key in expiry:
                expiry.move_to_end(key)
            else:
                new.append(h)
            expiry[key] = deadline
        if new:
            self._index.apply(worker_id, BlockStored(block_hashes=new))
        over = len(expiry) - self.max_blocks
        if over > 0:
            self._drop_oldest(over)

    def find_matches(self, block_hashes: Sequence[int], now: float) -> dict[int, int]:
        """Like :meth:`KvIndexer.find_matches`, over entries not expired at ``now``."""
        self.expire(now)
        return self._index.find_matches(block_hashes)

    def expire(self, now: float) -> None:
        """Drop every entry whose expiry time is ``<= now``."""
        expiry = self._expiry
        n = 0
        for deadline in expiry.values():
            if deadline > now:
                break
            n += 1
        if n:
            self._drop_oldest(n)

    def remove_worker(self, worker_id: int) -> None:
        """Forget every prediction about ``worker_id``."""
        expiry = self._expiry
        for h in self._index.blocks_of(worker_id):
            del expiry[(worker_id, h)]
        self._index.remove_worker(worker_id)

    def worker_block_count(self, worker_id: int) -> int:
        return self._index.worker_block_count(worker_id)

    @property
    def num_blocks(self) -> int:
        """Distinct hashes predicted on at least one worker."""
        return self._index.num_blocks

    def __len__(self) -> int:
        """Entries ``(worker, hash)`` held (at most ``max_blocks``)."""
        return len(self._expiry)

    def _drop_oldest(self, n: int) -> None:
        by_worker: dict[int, list[int]] = {}
        popitem = self._expiry.popitem
        for _ in range(n):
            (worker_id, h), _deadline = popitem(last=False)
            by_worker.setdefault(worker_id, []).append(h)
        for worker_id, hashes in by_worker.items():
            self._index.apply(worker_id, BlockRemoved(block_hashes=hashes))
