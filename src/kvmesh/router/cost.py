"""The KV router's cost function and worker selection. Pure: values in, values out;
randomness comes from the ``random.Random`` the caller passes.

Cost of sending a request of ``n`` prompt tokens (``B = ceil(n / block_size)`` blocks)
to worker ``w`` that holds its first ``overlap(w)`` blocks::

    uncached(w)       = n − overlap(w) × block_size                  (at least 0)
    new_blocks(w)     = B − overlap(w)                                (at least 0)
    prefill_blocks(w) = (in-flight prefill tokens of w + uncached(w)) / block_size
    decode_blocks(w)  = active blocks of w + new_blocks(w)
    cost(w)           = overlap_weight × prefill_blocks(w) + decode_blocks(w)   (lower wins)

Selection (:func:`select`), with health weights ``weight(w) ≥ 0`` (1 when not given):

* workers of weight 0 are left out, unless every worker has weight 0 (then all take
  part, as if of weight 1: an all-unhealthy fleet still serves);
* **temperature 0**: the lowest *effective* cost ``cost(w) / weight(w)`` wins (a
  half-healthy worker must be twice as cheap to win). Ties (equal within a relative
  1e-9) go to the higher weight, then to the fewest cached blocks (``overlap``), then
  to a random pick;
* **temperature T > 0**: costs are normalised by the largest one,
  ``ĉ(w) = cost(w) / max cost`` (all 0 when the max is 0), and a worker is drawn with
  probability ``∝ weight(w) × exp(−ĉ(w) / T)``: the weight scales its chance
  directly. Small T is nearly greedy; large T nearly uniform (times the weights).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CandidateScore", "score", "select", "uncached_tokens", "new_blocks", "check_knobs"]

# Relative tolerance under which two effective costs count as a tie.
_TIE_RTOL = 1e-9


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One worker's terms of the cost, as the router saw them for one request."""

    worker_id: int
    overlap_blocks: int
    prefill_blocks: float
    decode_blocks: float
    cost: float
    weight: float = 1.0


def check_knobs(overlap_weight: float, temperature: float) -> None:
    """Raise ``ValueError`` unless both knobs are finite and ``>= 0``."""
    if not (math.isfinite(overlap_weight) and overlap_weight >= 0):
        raise ValueError(f"overlap_weight must be a finite number >= 0, got {overlap_weight!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")


def uncached_tokens(prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """Prompt tokens a worker holding ``overlap_blocks`` leading blocks must prefill."""
    return max(0, prompt_tokens - overlap_blocks * block_size)


def new_blocks(prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """Blocks the prompt needs beyond the ``overlap_blocks`` already cached."""
    return max(0, -(-prompt_tokens // block_size) - overlap_blocks)


def score(
    worker_id: int,
    overlap_blocks: int,
    prompt_tokens: int,
    prefill_load_tokens: int,
    active_blocks: int,
    block_size: int,
    overlap_weight: float,
    weight: float = 1.0,
) -> CandidateScore:
    """The cost terms of one candidate (see the module docstring)."""
    prefill = (prefill_load_tokens + uncached_tokens(prompt_tokens, overlap_blocks, block_size)) / block_size
    decode = active_blocks + new_blocks(prompt_tokens, overlap_blocks, block_size)
    return CandidateScore(worker_id, overlap_blocks, prefill, float(decode), overlap_weight * prefill + decode, weight)


def select(candidates: Sequence[CandidateScore], temperature: float, rng: random.Random) -> CandidateScore:
    """Pick one of ``candidates`` (non-empty) by the rules of the module docstring."""
    if not candidates:
        raise ValueError("select needs at least one candidate")
    pool = [c for c in candidates if c.weight > 0]
    all_zero = not pool
    if all_zero:
        pool = list(candidates)
    if len(pool) == 1:
        return pool[0]
    if temperature > 0:
        return _sample(pool, temperature, rng, all_zero)
    return _greedy(pool, rng, all_zero)


def _greedy(pool: list[CandidateScore], rng: random.Random, all_zero: bool) -> CandidateScore:
    if all_zero:
        eff = [c.cost for c in pool]
    else:
        eff = [c.cost / c.weight for c in pool]
    best = min(eff)
    limit = best + _TIE_RTOL * max(1.0, abs(best))
    ties = [c for c, e in zip(pool, eff) if e <= limit]
    if len(ties) > 1 and not all_zero:
        top = max(c.weight for c in ties)
        ties = [c for c in ties if c.weight == top]
    if len(ties) > 1:
        fewest = min(c.overlap_blocks for c in ties)
        ties = [c for c in ties if c.overlap_blocks == fewest]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


def _sample(pool: list[CandidateScore], temperature: float, rng: random.Random, all_zero: bool) -> CandidateScore:
    top = max(c.cost for c in pool)
    # logits -ĉ/T lie in [-1/T, 0]; shift by the largest so exp never overflows
    logits = [-(c.cost / top) / temperature if top > 0 else 0.0 for c in pool]
    shift = max(logits)
    odds = [(1.0 if all_zero else c.weight) * math.exp(z - shift) for c, z in zip(pool, logits)]
    x = rng.random() * sum(odds)
    for c, p in zip(pool, odds):
        x -= p
        if x < 0:
            return c
    # float rounding left a sliver past the end: the last candidate with a chance
    return next(c for c, p in zip(reversed(pool), reversed(odds)) if p > 0)
