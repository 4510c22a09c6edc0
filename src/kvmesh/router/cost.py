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
* **temperature 0**: the lowest *effective* cost ``(cost(w) + 1) / weight(w)`` wins:
  the cost divided by the weight, shifted by one block so that a zero cost (a fully
  cached prompt on an idle worker) still feels the weight. With all weights 1 this is
  the plain minimum cost. Ties (equal within a relative 1e-9) go to the higher
  weight, then to the fewest cached blocks (``overlap``), then to a random pick;
* **temperature T > 0**: costs are normalised by the largest one,
  ``ĉ(w) = cost(w) / max cost`` (all 0 when the max is 0), and a worker is drawn with
  probability ``∝ weight(w) × exp(−ĉ(w) / T)``: the weight scales its chance
  directly. Small T is nearly greedy; large T nearly uniform (times the weights).

A request for a LoRA adapter (:func:`adapter_load_tokens`, :func:`with_adapter_load`)
costs a worker that does not hold the adapter the time loading it takes, as the prefill
tokens the worker could have computed meanwhile::

    load_tokens       = lora_load_ms × prefill_tokens_per_ms
    prefill_blocks(w) = (in-flight prefill tokens of w + load_tokens + uncached(w)) / block_size   (w lacks it)

so the holders win while they are no busier than that, and another worker is picked
(and loads the adapter) once they are.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import repeat
from typing import NamedTuple

__all__ = [
    "CandidateScore", "CostInputs", "adapter_load_tokens", "check_knobs", "new_blocks", "score", "score_all", "select",
    "select_greedy", "uncached_tokens", "with_adapter_load",
]  # fmt: skip

# Relative tolerance under which two effective costs count as a tie.
_TIE_RTOL = 1e-9


class CandidateScore(NamedTuple):
    """One worker's terms of the cost, as the router saw them for one request.

    Immutable; a named tuple rather than a dataclass because the router makes one per
    worker per request and a tuple is several times cheaper to build."""

    worker_id: int
    overlap_blocks: int
    prefill_blocks: float
    decode_blocks: float
    cost: float
    weight: float = 1.0


class CostInputs(NamedTuple):
    """What every worker's cost for one request is computed from (see the module
    docstring); missing map entries are 0."""

    overlaps: Mapping[int, int]  # worker → leading blocks of the prompt it holds
    prompt_tokens: int
    prefill_load_tokens: Mapping[int, float]  # worker → in-flight prefill tokens (+ an adapter's load)
    active_blocks: Mapping[int, int]  # worker → active KV blocks
    block_size: int
    overlap_weight: float


def check_knobs(overlap_weight: float, temperature: float) -> None:
    """Raise ``ValueError`` unless both knobs are finite and ``>= 0``."""
    if not (math.isfinite(overlap_weight) and overlap_weight >= 0):
        raise ValueError(f"overlap_weight must be a finite number >= 0, got {overlap_weight!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")


def adapter_load_tokens(load_ms: float, prefill_tokens_per_ms: float) -> float:
    """The cost of loading an adapter, in prefill tokens: its load time × the prefill
    rate (both finite, ``>= 0``, else ``ValueError``)."""
    for name, value in (("lora load time", load_ms), ("prefill rate", prefill_tokens_per_ms)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return load_ms * prefill_tokens_per_ms


def with_adapter_load(
    prefill_load_tokens: Mapping[int, float], workers: Iterable[int], holders: Collection[int], load_tokens: float
) -> dict[int, float]:
    """Each worker's in-flight prefill tokens, a worker not in ``holders`` charged
    ``load_tokens`` more (the adapter it must load first); the input is not changed."""
    get = prefill_load_tokens.get
    return {w: get(w, 0) + (0.0 if w in holders else load_tokens) for w in workers}


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


def score_all(
    workers: Iterable[int], inputs: CostInputs, weights: Mapping[int, float] | None = None
) -> list[CandidateScore]:
    """:func:`score` for each of ``workers`` (weight 1 when not in ``weights``), in
    their order. The same formula, unrolled: this runs for every worker on every request."""
    overlaps, prompt_tokens, prefill_load_tokens, active_blocks, block_size, overlap_weight = inputs
    n_blocks = -(-prompt_tokens // block_size)
    out: list[CandidateScore] = []
    append = out.append
    new = tuple.__new__  # the named tuple's own __new__ adds a Python call per worker
    get_overlap, get_prefill, get_active = overlaps.get, prefill_load_tokens.get, active_blocks.get
    for w in workers:
        overlap = get_overlap(w, 0)
        uncached = prompt_tokens - overlap * block_size
        fresh = n_blocks - overlap
        prefill = (get_prefill(w, 0) + (uncached if uncached > 0 else 0)) / block_size
        decode = float(get_active(w, 0) + (fresh if fresh > 0 else 0))
        weight = 1.0 if weights is None else _weight(weights, w)
        append(new(CandidateScore, (w, overlap, prefill, decode, overlap_weight * prefill + decode, weight)))
    return out


def _weight(weights: Mapping[int, float], worker_id: int) -> float:
    weight = weights.get(worker_id, 1.0)
    if not (weight >= 0 and math.isfinite(weight)):
        raise ValueError(f"routing weight of worker {worker_id} must be a finite number >= 0, got {weight!r}")
    return float(weight)


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
        eff = [(c.cost + 1.0) / c.weight for c in pool]
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


def select_greedy(
    workers: Collection[int],
    inputs: CostInputs,
    weights: Mapping[int, float] | None,
    rng: random.Random,
    keep: int = 8,
) -> tuple[CandidateScore, list[CandidateScore]]:
    """Temperature-0 :func:`select` for many workers, without a :class:`CandidateScore`
    per worker. The same rule; what differs is only how the work is done:

    * a worker of weight 1 that carries no load costs what its overlap says, so those
      are scored once per overlap value (those holding nothing of the prompt are one
      group); only loaded workers and workers of another weight are scored one by one
      (weight 0: left out, unless every worker has weight 0);
    * scores are built for the tied best only (ties broken as :func:`select` does,
      a random pick among the last ties) and for the ``keep`` cheapest, which are
      returned for explanations.
    """
    weights = weights or {}
    zero = {w for w, v in weights.items() if v <= 0.0 and w in workers}
    if zero and len(zero) == len(workers):
        return _greedy_weighted(workers, inputs, weights, rng, keep)  # all weight 0: all take part
    overlaps, prompt_tokens, prefill_load_tokens, active_blocks, block_size, overlap_weight = inputs
    n_blocks = -(-prompt_tokens // block_size)
    get_overlap, get_prefill, get_active, get_weight = overlaps.get, prefill_load_tokens.get, active_blocks.get, weights.get

    def cost_of(overlap: int) -> float:  # an unloaded worker's
        return _cost(overlap, 0, 0, prompt_tokens, n_blocks, block_size, overlap_weight)

    # one by one: loaded workers (few: in-flight requests) and those of a weight other
    # than 1; grouped by overlap: the matched others (up to the whole fleet, when every
    # worker caches a popular prefix); one group: the rest (weight 1, idle, nothing cached)
    odd = [w for w, v in weights.items() if v != 1.0] if weights else []  # weights may list every worker, most at 1
    single = [w for w in {*prefill_load_tokens, *active_blocks, *odd} if w in workers and w not in zero]
    skip = set(single)
    skip |= zero
    groups: dict[int, list[int]] = {}
    for w, o in overlaps.items():
        if w in workers and w not in skip:
            group = groups.get(o)
            if group is None:
                groups[o] = [w]
            else:
                group.append(w)
    # effective cost (select's rule): (cost + 1) / weight; the cost is _cost's, inline
    single_cost = [
        overlap_weight * (p + (prompt_tokens - o * block_size if prompt_tokens > o * block_size else 0)) / block_size
        + a + (n_blocks - o if n_blocks > o else 0)
        for o, p, a in zip(map(get_overlap, single, repeat(0)), map(get_prefill, single, repeat(0)), map(get_active, single, repeat(0)))
    ]
    single_eff = [(c + 1.0) / get_weight(w, 1.0) for c, w in zip(single_cost, single)] if weights else [c + 1.0 for c in single_cost]
    group_eff = {o: cost_of(o) + 1.0 for o in groups}
    matched = sum(map(len, groups.values()))
    idle = len(workers) - len(single) - matched - len(zero)  # weight 1, no load, nothing cached
    idle_eff = cost_of(0) + 1.0
    best = min(min(single_eff, default=math.inf), min(group_eff.values(), default=math.inf), idle_eff if idle else math.inf)
    limit = best + _TIE_RTOL * max(1.0, abs(best))

    # ties: the highest weight, then the fewest cached blocks, then chance decide
    tied_single = [w for w, e in zip(single, single_eff) if e <= limit]
    tied_groups = [o for o, e in group_eff.items() if e <= limit]
    idle_ties = idle if idle and idle_eff <= limit else 0  # idle workers hold nothing: overlap 0
    top = 1.0 if tied_groups or idle_ties else max(get_weight(w, 1.0) for w in tied_single)
    tied_single = [w for w in tied_single if get_weight(w, 1.0) == top]
    fewest = 0 if idle_ties else min([get_overlap(w, 0) for w in tied_single] + tied_groups)
    ties = [w for w in tied_single if get_overlap(w, 0) == fewest]
    if fewest in tied_groups:
        ties += groups[fewest]
    pick = 0 if len(ties) + idle_ties == 1 else rng.randrange(len(ties) + idle_ties)
    winner = ties[pick] if pick < len(ties) else _idle_worker(workers, skip, overlaps, rng)

    # the ``keep`` cheapest of the scored-one-by-one and matched workers, for explanations
    cheapest = sorted(zip(single_cost, single))[:keep]
    for o in sorted(groups, key=group_eff.__getitem__):
        if len(cheapest) >= keep and group_eff[o] - 1.0 >= cheapest[keep - 1][0]:
            break
        cheapest += [(group_eff[o] - 1.0, w) for w in groups[o][:keep]]
        cheapest.sort()
    ids = [w for _, w in cheapest[:keep]]
    if winner not in ids:
        ids.append(winner)
    shown = score_all(ids, inputs)  # :func:`score` of each, unrolled
    if weights:
        shown = [c._replace(weight=get_weight(c.worker_id, 1.0)) for c in shown]
    chosen = shown[ids.index(winner)]
    return chosen, shown


def _idle_worker(workers: Collection[int], taken: set[int], overlaps: Mapping[int, int], rng: random.Random) -> int:
    """One of ``workers`` in neither ``taken`` nor ``overlaps``, each equally likely (the
    caller knows there is one): drawn at random until one is (most workers of a big
    fleet are idle), after 16 misses from the list of all of them."""
    pool = workers if isinstance(workers, Sequence) else list(workers)
    for _ in range(16):
        w = pool[rng.randrange(len(pool))]
        if w not in taken and w not in overlaps:
            return w
    rest = [w for w in pool if w not in taken and w not in overlaps]
    return rest[rng.randrange(len(rest))]


def _cost(overlap: int, prefill: int, active: int, prompt_tokens: int, n_blocks: int, block_size: int, ow: float) -> float:
    uncached = prompt_tokens - overlap * block_size
    fresh = n_blocks - overlap
    return ow * (prefill + (uncached if uncached > 0 else 0)) / block_size + active + (fresh if fresh > 0 else 0)


def _greedy_weighted(
    workers: Collection[int], inputs: CostInputs, weights: Mapping[int, float], rng: random.Random, keep: int
) -> tuple[CandidateScore, list[CandidateScore]]:
    """With health weights every worker is scored (weights differ per worker)."""
    pool = score_all(workers, inputs, weights)
    chosen = select(pool, 0.0, rng)
    shown = sorted(pool, key=lambda c: c.cost)[:keep]
    if chosen not in shown:
        shown.append(chosen)
    return chosen, shown
