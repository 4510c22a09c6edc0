"""KV tiers, named once: G1 the device pool, G2 host memory, G3 local disk (the block
pools: :mod:`kvmesh.engines.batching.tiers`; the wire: :mod:`kvmesh.kv.events`), and
what a prefix hit in each is worth to a router.

A hit's *price* (:func:`hit_weights`) is the fraction of prefilling those tokens that
it still costs: 0 in G1 (the blocks are there), and in a lower tier the time to copy a
token's KV up ÷ the time to prefill it, capped at 1 (a tier slower than recomputing is
worth nothing). :data:`DEFAULT_TIER_WEIGHTS` derives them from the mocker's defaults
(4096 bytes of KV per token, host 25 GB/s, disk 3 GB/s) and its timing model's prefill
rate (~66k tokens/s: 1.518e-2 ms per token), so a G2 hit is dearer than a G1 hit and
far cheaper than a prefill. Pure.
"""

from __future__ import annotations

import math

__all__ = ["DEFAULT_TIER_WEIGHTS", "G1", "G2", "G3", "TIERS", "hit_weights", "check_tier_weights"]

G1, G2, G3 = 1, 2, 3
TIERS = (G1, G2, G3)


def hit_weights(bytes_per_token: float, prefill_tokens_per_s: float, host_gbps: float, disk_gbps: float) -> tuple[float, float]:
    """The price of a G2 and a G3 hit per token, as a fraction of prefilling it (see the
    module docstring)."""
    host, disk = (min(1.0, bytes_per_token / (gbps * 1e9) * prefill_tokens_per_s) for gbps in (host_gbps, disk_gbps))
    return host, disk


def check_tier_weights(weights: tuple[float, ...]) -> None:
    """ValueError unless ``weights`` is two numbers in [0, 1] (G2's, G3's)."""
    if len(weights) != 2 or not all(isinstance(w, (int, float)) and math.isfinite(w) and 0 <= w <= 1 for w in weights):
        raise ValueError(f"KV tier weights must be two numbers in [0, 1] (host, disk), got {weights!r}")


DEFAULT_TIER_WEIGHTS = hit_weights(4096, 1000 / 1.518e-2, 25.0, 3.0)
