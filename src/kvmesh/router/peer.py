"""A prefix from a peer (issue 33): when another worker holds more of a request's prefix
(in any KV tier) than the worker the router chose, is reading the difference over the
KV-transfer plane cheaper than prefilling it? Pure: no I/O, no clock.

For ``gain`` blocks (the peer's leading run minus the chosen worker's)::

    transfer_s = overhead_s + gain × bytes_per_block ÷ link_bytes_per_s
    prefill_s  = gain × block_size ÷ prefill_tokens_per_s
    fetch  iff  gain ≥ min_blocks  and  transfer_s < prefill_s

``bytes_per_block`` is the peer's (its :class:`~kvmesh.protocol.KvLayout`: the real
bytes, also for the mocker's simulated KV); the link and prefill rates are settings
(``--peer-fetch-gbps``, ``--router-prefill-rate``). The peer is the candidate with the
longest run (ties: the lowest id) among those of weight > 0 whose KV endpoint serves
prefixes; the chosen worker must serve them too (it runs ``--peer-fetch``, so it acts
on the hint). The answer is a :class:`~kvmesh.protocol.PeerPrefix` routing hint, or
None. The worker side (read, adopt, fall back to prefill) is
:class:`~kvmesh.disagg.engine.DisaggEngine`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvmesh.protocol import KvEndpoint, PeerPrefix
from kvmesh.router.cost import CandidateScore

__all__ = ["PeerFetchSettings", "fetch_pays", "best_peer", "plan_peer_fetch"]


@dataclass(frozen=True)
class PeerFetchSettings:
    link_gbps: float = 25.0  # the KV-transfer link between workers, GB/s
    prefill_tokens_per_ms: float = 8.0  # a worker's prefill rate (--router-prefill-rate)
    overhead_ms: float = 1.0  # a fetch's fixed cost: the connection, the round trip
    min_blocks: int = 1

    def __post_init__(self) -> None:
        for name in ("link_gbps", "prefill_tokens_per_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.overhead_ms) and self.overhead_ms >= 0):
            raise ValueError(f"overhead_ms must be a finite number >= 0, got {self.overhead_ms!r}")
        if self.min_blocks < 1:
            raise ValueError(f"min_blocks must be >= 1, got {self.min_blocks!r}")


def fetch_pays(gain_blocks: int, block_size: int, bytes_per_block: int, s: PeerFetchSettings) -> bool:
    """Whether reading ``gain_blocks`` blocks costs less time than prefilling them."""
    if gain_blocks < s.min_blocks:
        return False
    transfer_s = s.overhead_ms / 1000.0 + gain_blocks * bytes_per_block / (s.link_gbps * 1e9)
    prefill_s = gain_blocks * block_size / (s.prefill_tokens_per_ms * 1000.0)
    return transfer_s < prefill_s


def best_peer(candidates: Iterable[CandidateScore], chosen: int, able: Callable[[int], bool]) -> CandidateScore | None:
    """The candidate other than ``chosen`` with the longest prefix run (weight > 0 and
    ``able``), if it is longer than the chosen worker's."""
    mine, best = 0, None
    for c in candidates:
        if c.worker_id == chosen:
            mine = c.overlap_blocks
        elif c.weight > 0 and (best is None or (c.overlap_blocks, -c.worker_id) > (best.overlap_blocks, -best.worker_id)):
            if able(c.worker_id):
                best = c
    return best if best is not None and best.overlap_blocks > mine else None


def plan_peer_fetch(
    candidates: list[CandidateScore],
    chosen: int,
    endpoint_of: Callable[[int], KvEndpoint | None],
    block_size: int,
    s: PeerFetchSettings,
) -> PeerPrefix | None:
    """The hint for the chosen worker, or None (see the module docstring)."""
    mine = endpoint_of(chosen)
    if mine is None or not mine.serves_prefixes or len(candidates) < 2:
        return None

    def able(worker_id: int) -> bool:
        kv = endpoint_of(worker_id)
        return kv is not None and kv.serves_prefixes and kv.layout.block_size == block_size

    peer = best_peer(candidates, chosen, able)
    if peer is None:
        return None
    kv = endpoint_of(peer.worker_id)
    assert kv is not None  # able() said so
    have = next(c.overlap_blocks for c in candidates if c.worker_id == chosen)
    if not fetch_pays(peer.overlap_blocks - have, block_size, kv.layout.bytes_per_block, s):
        return None
    return PeerPrefix(peer.worker_id, kv, peer.overlap_blocks)
