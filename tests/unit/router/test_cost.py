"""The KV router's cost function and selection rules (pure: values in, values out)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from kvmesh.router.cost import CandidateScore, CostInputs, check_knobs, new_blocks, score, score_all, select, uncached_tokens


def cand(worker_id: int, cost: float, overlap: int = 0, weight: float = 1.0) -> CandidateScore:
    return CandidateScore(worker_id, overlap, 0.0, 0.0, cost, weight)


def draws(candidates: list[CandidateScore], temperature: float, n: int, seed: int = 7) -> Counter[int]:
    rng = random.Random(seed)
    return Counter(select(candidates, temperature, rng).worker_id for _ in range(n))


# ---------------------------------------------------------------------------- the formula


def test_cost_terms_follow_the_definition() -> None:
    # 100 tokens = 7 blocks of 16; 3 cached -> 52 tokens / 4 blocks to compute
    s = score(5, overlap_blocks=3, prompt_tokens=100, prefill_load_tokens=32, active_blocks=10, block_size=16, overlap_weight=2.0)
    assert s.worker_id == 5 and s.overlap_blocks == 3 and s.weight == 1.0
    assert s.prefill_blocks == pytest.approx((32 + 52) / 16)
    assert s.decode_blocks == 10 + 4
    assert s.cost == pytest.approx(2.0 * 5.25 + 14)


def test_uncached_and_new_blocks_never_go_negative() -> None:
    assert uncached_tokens(100, 7, 16) == 0  # the whole prompt is cached (partial tail included)
    assert uncached_tokens(100, 6, 16) == 4
    assert new_blocks(100, 9, 16) == 0
    assert new_blocks(100, 0, 16) == 7
    assert new_blocks(0, 0, 16) == 0


def test_overlap_weight_scales_only_the_prefill_term() -> None:
    a = score(0, 0, 64, 0, 0, 16, overlap_weight=0.0)
    b = score(0, 0, 64, 0, 0, 16, overlap_weight=3.0)
    assert a.cost == 4 and b.cost == 3 * 4 + 4


def test_a_cached_prefix_lowers_the_cost() -> None:
    cold = score(0, 0, 160, 0, 0, 16, 1.0)
    warm = score(1, 8, 160, 0, 0, 16, 1.0)
    assert warm.cost == pytest.approx(2 + 2) and cold.cost == pytest.approx(10 + 10)


def test_score_all_is_score_for_every_worker() -> None:
    overlaps, prefill, active, weights = {1: 3, 2: 7}, {0: 40, 2: 8}, {1: 12}, {2: 0.5}
    got = score_all([0, 1, 2, 3], CostInputs(overlaps, 100, prefill, active, 16, 1.5), weights)
    want = [
        score(w, overlaps.get(w, 0), 100, prefill.get(w, 0), active.get(w, 0), 16, 1.5, weights.get(w, 1.0))
        for w in range(4)
    ]
    assert got == want
    assert all(type(c) is CandidateScore for c in got)
    with pytest.raises(ValueError):
        score_all([0], CostInputs({}, 10, {}, {}, 16, 1.0), {0: math.nan})


@pytest.mark.parametrize("ow,temp", [(-1.0, 0.0), (math.nan, 0.0), (1.0, -0.1), (1.0, math.inf)])
def test_bad_knobs_are_value_errors(ow: float, temp: float) -> None:
    with pytest.raises(ValueError):
        check_knobs(ow, temp)


# ---------------------------------------------------------------------------- temperature 0


def test_lowest_cost_wins() -> None:
    rng = random.Random(0)
    assert select([cand(0, 5.0), cand(1, 3.0), cand(2, 4.0)], 0.0, rng).worker_id == 1


def test_ties_go_to_the_fewest_cached_blocks() -> None:
    rng = random.Random(0)
    cands = [cand(0, 4.0, overlap=3), cand(1, 4.0, overlap=1), cand(2, 4.0, overlap=2), cand(3, 9.0, overlap=0)]
    assert {select(cands, 0.0, rng).worker_id for _ in range(50)} == {1}


def test_costs_equal_within_rounding_are_ties() -> None:
    cands = [cand(0, 0.1 + 0.2, overlap=1), cand(1, 0.3, overlap=0)]
    assert select(cands, 0.0, random.Random(0)).worker_id == 1


def test_full_ties_are_broken_at_random_by_the_given_rng() -> None:
    cands = [cand(0, 2.0, 1), cand(1, 2.0, 1), cand(2, 2.0, 1), cand(3, 5.0, 0)]
    counts = draws(cands, 0.0, 3000)
    assert set(counts) == {0, 1, 2}
    assert all(900 < c < 1100 for c in counts.values())
    seq1 = [select(cands, 0.0, r).worker_id for r in [random.Random(42)] for _ in range(20)]
    seq2 = [select(cands, 0.0, r).worker_id for r in [random.Random(42)] for _ in range(20)]
    assert seq1 == seq2


def test_select_needs_a_candidate() -> None:
    with pytest.raises(ValueError):
        select([], 0.0, random.Random(0))


# ---------------------------------------------------------------------------- temperature > 0


def softmax_odds(costs: list[float], temperature: float, weights: list[float] | None = None) -> list[float]:
    top = max(costs)
    w = weights or [1.0] * len(costs)
    odds = [wi * math.exp(-(c / top) / temperature) for c, wi in zip(costs, w)]
    return [o / sum(odds) for o in odds]


def test_sampling_frequencies_follow_the_softmax_of_normalised_costs() -> None:
    costs = [10.0, 20.0, 40.0]
    n = 20000
    counts = draws([cand(i, c) for i, c in enumerate(costs)], 0.5, n)
    for i, p in enumerate(softmax_odds(costs, 0.5)):
        assert counts[i] / n == pytest.approx(p, abs=0.015)


def test_normalisation_makes_sampling_scale_free() -> None:
    small = draws([cand(0, 1.0), cand(1, 2.0)], 0.3, 2000, seed=3)
    large = draws([cand(0, 1000.0), cand(1, 2000.0)], 0.3, 2000, seed=3)
    assert small == large


def test_low_temperature_is_nearly_greedy_high_is_nearly_uniform() -> None:
    cands = [cand(0, 1.0), cand(1, 2.0), cand(2, 3.0)]
    assert draws(cands, 0.01, 1000)[0] == 1000
    hot = draws(cands, 1000.0, 6000)
    assert all(1800 < hot[i] < 2200 for i in range(3))


def test_all_zero_costs_sample_uniformly() -> None:
    counts = draws([cand(0, 0.0), cand(1, 0.0)], 1.0, 4000)
    assert 1800 < counts[0] < 2200


# ---------------------------------------------------------------------------- health weights


def test_weight_zero_is_never_chosen_even_when_cheapest() -> None:
    cands = [cand(0, 1.0, weight=0.0), cand(1, 50.0), cand(2, 60.0)]
    assert draws(cands, 0.0, 100) == Counter({1: 100})
    assert 0 not in draws(cands, 2.0, 2000)


def test_all_weights_zero_means_all_take_part() -> None:
    cands = [cand(0, 5.0, weight=0.0), cand(1, 2.0, weight=0.0)]
    assert select(cands, 0.0, random.Random(0)).worker_id == 1
    assert set(draws(cands, 5.0, 500)) == {0, 1}


def test_partial_weight_divides_the_cost_at_temperature_0() -> None:
    rng = random.Random(0)
    # effective cost (cost + 1) / weight: half weight doubles it
    assert select([cand(0, 10.0, weight=0.5), cand(1, 15.0)], 0.0, rng).worker_id == 1  # 22 > 16
    assert select([cand(0, 6.0, weight=0.5), cand(1, 15.0)], 0.0, rng).worker_id == 0  # 14 < 16
    # a zero cost does not hide the weight
    assert select([cand(0, 0.0, weight=0.05), cand(1, 15.0)], 0.0, rng).worker_id == 1  # 20 > 16


def test_equal_effective_costs_prefer_the_healthier_worker() -> None:
    rng = random.Random(0)
    cands = [cand(0, 5.0, overlap=0, weight=0.5), cand(1, 11.0, overlap=3, weight=1.0)]  # both 12
    assert {select(cands, 0.0, rng).worker_id for _ in range(20)} == {1}


def test_weights_scale_the_chance_when_sampling() -> None:
    costs, weights = [10.0, 10.0, 20.0], [1.0, 0.25, 1.0]
    n = 20000
    counts = draws([cand(i, c, weight=w) for i, (c, w) in enumerate(zip(costs, weights))], 0.5, n)
    for i, p in enumerate(softmax_odds(costs, 0.5, weights)):
        assert counts[i] / n == pytest.approx(p, abs=0.015)
