"""Canary answers learnt from the fleet: adopted only when three workers agree (all of
a smaller fleet; a strict majority once everyone answered), so one corrupt worker
cannot poison them; and degradation levels 3-4 relax the latency threshold x2."""

from __future__ import annotations

import pytest

from kvmesh.health.canary import CanaryOutput, CanaryVotes, agree
from kvmesh.health.degradation import ACTIONS, DegradationLevel
from kvmesh.health.state import CheckKind, CheckResult, HealthConfig, HealthTracker, LatencyContext

PROMPT = [1, 2, 3]
GOOD = [CanaryOutput(PROMPT, [7, 8, 9], [-0.3, -0.2, -0.1])]
WRONG_TOKENS = [CanaryOutput(PROMPT, [7, 8, 10], [-0.3, -0.2, -0.1])]
FLAT = [CanaryOutput(PROMPT, [7, 8, 9], [-2.8, -2.7, -2.6])]  # same argmax, shifted logprobs


def test_agreement_is_tokens_and_logprobs_within_tolerance() -> None:
    assert agree(GOOD, [CanaryOutput(PROMPT, [7, 8, 9], [-0.6])], 0.5)
    assert not agree(GOOD, FLAT, 0.5)
    assert not agree(GOOD, WRONG_TOKENS, 0.5)
    assert agree(GOOD, [CanaryOutput(PROMPT, [7, 8, 9], None)], 0.5)  # no logprobs: tokens decide


def test_three_agreeing_workers_are_needed_in_a_large_fleet() -> None:
    votes = CanaryVotes("m")
    assert votes.offer(1, GOOD, live_workers=5) is None
    assert votes.offer(2, GOOD, live_workers=5) is None
    got = votes.offer(3, GOOD, live_workers=5)
    assert got is not None and got.canaries[0].expected_token_ids == [7, 8, 9]
    lo, hi = got.canaries[0].top_logprob_range or (0.0, 0.0)
    assert lo <= -0.3 <= hi


@pytest.mark.parametrize("bad", [WRONG_TOKENS, FLAT])
@pytest.mark.parametrize("position", [0, 1, 2, 3])
def test_one_corrupt_worker_cannot_poison_the_answers(bad: list[CanaryOutput], position: int) -> None:
    votes = CanaryVotes("m")
    order = [GOOD] * 3
    order.insert(position, bad)
    results = [votes.offer(w, outputs, live_workers=4) for w, outputs in enumerate(order)]
    adopted = [r for r in results if r is not None]
    assert adopted, "three good workers agreed"
    assert all(r.canaries[0].top_logprob_range is not None for r in adopted)
    for r in adopted:
        lo, hi = r.canaries[0].top_logprob_range or (0.0, 0.0)
        assert r.canaries[0].expected_token_ids == [7, 8, 9] and lo <= -0.3 <= hi
    assert votes.disagreeing() == 2


def test_a_fleet_of_three_with_one_corrupt_takes_the_majority_once_all_answered() -> None:
    votes = CanaryVotes("m")
    assert votes.offer(1, FLAT, live_workers=3) is None
    assert votes.offer(2, GOOD, live_workers=3) is None
    got = votes.offer(3, GOOD, live_workers=3)
    assert got is not None and got.canaries[0].top_logprob_range is not None
    assert got.canaries[0].top_logprob_range[0] <= -0.3


def test_two_workers_must_both_agree_and_one_alone_is_trusted() -> None:
    votes = CanaryVotes("m")
    assert votes.offer(1, GOOD, live_workers=2) is None
    assert votes.offer(2, FLAT, live_workers=2) is None  # no majority of two
    assert CanaryVotes("m").offer(1, GOOD, live_workers=1) is not None


def test_a_worker_voting_twice_counts_once() -> None:
    votes = CanaryVotes("m")
    for _ in range(3):
        assert votes.offer(1, GOOD, live_workers=4) is None


def test_levels_3_and_4_relax_the_latency_threshold_x2() -> None:
    cfg = HealthConfig(latency_spike_min_s=0.0)
    tracker = HealthTracker(1, cfg)
    slow = CheckResult(CheckKind.OK, 0.5, compute_s=0.5)  # 5x the expected 0.1 s; the factor is 3
    for level in DegradationLevel:
        relax = ACTIONS[level].latency_multiplier
        judged = tracker.classify_latency(slow, LatencyContext(0.1, relax=relax))
        assert judged.ok is (level >= DegradationLevel.RELAX_LATENCY), level
    too_slow = CheckResult(CheckKind.OK, 0.7, compute_s=0.7)  # beyond 2 x 3 x 0.1
    assert not tracker.classify_latency(too_slow, LatencyContext(0.1, relax=2.0)).ok
