"""select_greedy (the router's path for more than 32 workers at temperature 0) picks
what select over every worker's score would: the same lowest cost, then the fewest
cached blocks, at random among what is left; checked on random fleets."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.cost import _TIE_RTOL, CostInputs, score_all, select_greedy


def _fleet(rng: random.Random) -> tuple[dict[int, None], dict[int, int], dict[int, int], dict[int, int], int]:
    workers = dict.fromkeys(rng.sample(range(1, 10_000), rng.randrange(33, 400)))
    ids = list(workers)
    depth = rng.choice([1, 4, 12])
    overlaps = {w: rng.randrange(1, depth + 1) for w in rng.sample(ids, rng.randrange(0, len(ids) + 1))}
    overlaps.update({w: 3 for w in rng.sample(range(20_000, 30_000), 5)})  # indexed, not (yet) candidates
    prefill = {w: rng.choice([0, 16, 200]) for w in rng.sample(ids, rng.randrange(0, 20))}
    active = {w: rng.randrange(0, 30) for w in rng.sample(ids, rng.randrange(0, 20))}
    return workers, overlaps, prefill, active, rng.choice([1, 17, 64, 200])


def _allowed(workers, overlaps, prompt, prefill, active, ow, weights=None) -> set[int]:  # type: ignore[no-untyped-def]
    """What select's rule may pick (at temperature 0): the lowest effective cost, then the
    highest weight, then the fewest cached blocks."""
    scores = score_all(workers, CostInputs(overlaps, prompt, prefill, active, 16, ow), weights)
    pool = [s for s in scores if s.weight > 0] or scores
    eff = {s.worker_id: (s.cost + 1.0) / s.weight if s.weight > 0 else s.cost for s in pool}
    best = min(eff.values())
    ties = [s for s in pool if eff[s.worker_id] <= best + 1e-6 * max(1.0, abs(best))]
    top = max(s.weight for s in ties)
    ties = [s for s in ties if s.weight == top]
    fewest = min(s.overlap_blocks for s in ties)
    return {s.worker_id for s in ties if s.overlap_blocks == fewest}


@pytest.mark.parametrize("seed", range(40))
def test_the_pick_is_one_select_could_make(seed: int) -> None:
    rng = random.Random(seed)
    workers, overlaps, prefill, active, prompt = _fleet(rng)
    ow = rng.choice([0.0, 1.0, 2.5])
    allowed = _allowed(workers, overlaps, prompt, prefill, active, ow)
    chosen, shown = select_greedy(workers, CostInputs(overlaps, prompt, prefill, active, 16, ow), None, random.Random(seed))
    assert chosen.worker_id in allowed
    assert chosen in shown
    costs = sorted(s.cost for s in score_all(workers, CostInputs(overlaps, prompt, prefill, active, 16, ow), None))
    listed = sorted(s.cost for s in shown if s != chosen or len(shown) <= 8)[:8]
    busy = {w for w in {*overlaps, *prefill, *active} if w in workers}
    if len(busy) >= 8:  # the explanations are the cheapest of the matched or loaded workers
        cheapest_busy = sorted(s.cost for s in score_all(list(busy), CostInputs(overlaps, prompt, prefill, active, 16, ow), None))[:8]
        assert listed == pytest.approx(cheapest_busy)
    assert chosen.cost == pytest.approx(costs[0])


@pytest.mark.parametrize("seed", range(40))
def test_with_health_weights_the_pick_is_one_select_could_make(seed: int) -> None:
    rng = random.Random(1000 + seed)
    workers, overlaps, prefill, active, prompt = _fleet(rng)
    ids = list(workers)
    weights = {w: rng.choice([0.0, 0.25, 0.5, 1.0]) for w in rng.sample(ids, rng.randrange(0, min(30, len(ids))))}
    if seed % 3 == 1:
        weights = {w: weights.get(w, 1.0) for w in ids}  # every worker listed (the health monitor does that)
    if seed % 10 == 0:
        weights = dict.fromkeys(ids, 0.0)  # all unhealthy: all take part
    allowed = _allowed(workers, overlaps, prompt, prefill, active, 1.0, weights)
    chosen, shown = select_greedy(workers, CostInputs(overlaps, prompt, prefill, active, 16, 1.0), weights, random.Random(seed))
    assert chosen.worker_id in allowed
    assert chosen in shown
    assert chosen.weight == weights.get(chosen.worker_id, 1.0)


def test_ties_are_spread_over_every_tied_worker() -> None:
    workers = dict.fromkeys(range(1, 101))
    overlaps = {w: 12 for w in workers}  # every worker holds the prompt's prefix, none is loaded
    rng = random.Random(3)
    picks = {select_greedy(workers, CostInputs(overlaps, 256, {}, {}, 16, 1.0), None, rng)[0].worker_id for _ in range(2000)}
    assert len(picks) > 90


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(33, 300),
    idle_left=st.integers(0, 40),
    loaded_cost=st.sampled_from([0, 16, 64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_idle_ties_are_drawn_from_exactly_the_idle_workers(n: int, idle_left: int, loaded_cost: int, seed: int) -> None:
    """Idle workers tied for the best are drawn at random without listing them (most of
    a big fleet is idle) and from the list when few are: either way the pick is one
    select could make, and over many draws every tied worker comes up."""
    rng = random.Random(seed)
    workers = dict.fromkeys(rng.sample(range(1, 100_000), n))
    ids = list(workers)
    busy = ids[: n - idle_left]
    # the busy ones: loaded with 0 tokens left to prefill (ties with idle at cost 0 when loaded_cost is 0)
    prefill = {w: loaded_cost for w in busy[::2] if loaded_cost}
    active = {w: loaded_cost for w in busy[1::2] if loaded_cost}
    overlaps = {w: 1 for w in busy if w not in prefill and w not in active}
    inputs = CostInputs(overlaps, 0, prefill, active, 16, 1.0)  # an empty prompt: overlap does not lower the cost
    allowed = _allowed(workers, overlaps, 0, prefill, active, 1.0)
    draw = random.Random(seed ^ 1)
    picks = {select_greedy(workers, inputs, None, draw)[0].worker_id for _ in range(min(40 * len(allowed), 300))}
    assert picks <= allowed
    if len(allowed) <= 6:
        assert picks == allowed
