"""Weighted fair queuing across tenants (kvmesh.router.fair)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.fair import FairQueue

pytestmark = pytest.mark.timeout(60)


def test_a_heavy_tenant_waits_behind_its_own_requests():
    q: FairQueue[str] = FairQueue()
    for i in range(10):
        q.push(f"a{i}", "a", cost=100)
    q.push("b0", "b", cost=100)
    order = [q.pop() for _ in range(len(q))]
    assert order.index("b0") <= 1  # b's first request goes before a's second, not after a's tenth


def test_weights_share_in_proportion():
    q: FairQueue[str] = FairQueue()
    for i in range(30):
        q.push(f"a{i}", "a", weight=2.0, cost=10)
        q.push(f"b{i}", "b", weight=1.0, cost=10)
    first = [q.pop() for _ in range(30)]
    a = sum(1 for x in first if x.startswith("a"))
    assert 19 <= a <= 21  # 2:1


def test_tiers_go_first_then_fairness_inside_each():
    q: FairQueue[str] = FairQueue()
    q.push("be", "a", tier="best_effort")
    q.push("std", "a", tier="standard")
    q.push("prem", "b", tier="premium")
    assert [q.pop(), q.pop(), q.pop()] == ["prem", "std", "be"]


def test_removed_items_never_pop_and_state_is_dropped_when_empty():
    q: FairQueue[str] = FairQueue()
    q.push("x", "a")
    q.push("y", "b")
    assert q.remove("x") and not q.remove("x")
    assert q.pop() == "y" and len(q) == 0
    with pytest.raises(IndexError):
        q.pop()
    assert not q._finish and not q._waiting and not q._heap


def test_a_newcomer_is_not_punished_for_idle_time():
    """A tenant that was idle starts at the virtual clock, not at zero (no credit hoarding)
    nor far behind it."""
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push(f"a{i}", "a", cost=10)
    for _ in range(4):
        q.pop()
    q.push("b0", "b", cost=10)
    q.push("a5", "a", cost=10)
    assert [q.pop(), q.pop(), q.pop()] == ["b0", "a4", "a5"]  # b starts at the clock, a4 one step past it


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 40), st.integers(1, 5))
def test_backlogged_light_tenant_is_served_within_one_round(heavy, light):
    """However much a heavy tenant has queued, each of a light tenant's requests (same
    cost, same weight) waits behind at most one of the heavy tenant's per earlier light request."""
    q: FairQueue[str] = FairQueue()
    for i in range(heavy):
        q.push(f"h{i}", "h", cost=5)
    for i in range(light):
        q.push(f"l{i}", "l", cost=5)
    order = [q.pop() for _ in range(len(q))]
    for i in range(light):
        assert order.index(f"l{i}") <= 2 * i + 1
