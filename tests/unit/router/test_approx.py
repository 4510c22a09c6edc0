"""ApproxIndexer: predictions expire after the TTL, refresh when recorded again, and
are capped in number with the oldest evicted first (a sequence's tail before its prefix)."""

from __future__ import annotations

import pytest

from kvmesh.router.approx import ApproxIndexer

A, B, C, D = 11, 22, 33, 44


def test_records_and_matches() -> None:
    ax = ApproxIndexer(ttl_s=10, max_blocks=100)
    ax.record(1, [A, B, C], now=0)
    ax.record(2, [A, B], now=0)
    assert ax.find_matches([A, B, C, D], now=1) == {1: 3, 2: 2}
    assert ax.find_matches([D, A], now=1) == {}
    assert len(ax) == 5 and ax.num_blocks == 3
    assert ax.worker_block_count(1) == 3


def test_expiry() -> None:
    ax = ApproxIndexer(ttl_s=10, max_blocks=100)
    ax.record(1, [A, B], now=0)
    ax.record(2, [A], now=5)
    assert ax.find_matches([A, B], now=9.99) == {1: 2, 2: 1}
    assert ax.find_matches([A, B], now=10) == {2: 1}  # expiry is inclusive
    assert ax.find_matches([A, B], now=15) == {}
    assert len(ax) == 0 and ax.num_blocks == 0


def test_refresh_extends_life_and_order() -> None:
    ax = ApproxIndexer(ttl_s=10, max_blocks=100)
    ax.record(1, [A, B], now=0)
    ax.record(1, [A], now=8)  # A refreshed, B not
    assert ax.find_matches([A, B], now=12) == {1: 1}
    assert ax.find_matches([A], now=17.9) == {1: 1}
    assert ax.find_matches([A], now=18) == {}


def test_size_cap_evicts_oldest_first() -> None:
    ax = ApproxIndexer(ttl_s=100, max_blocks=3)
    ax.record(1, [A], now=0)
    ax.record(2, [B], now=1)
    ax.record(3, [C], now=2)
    ax.record(1, [A], now=3)  # refresh: A is now the newest
    ax.record(4, [D], now=4)  # over the cap: evicts B (the oldest)
    assert len(ax) == 3
    assert ax.find_matches([B], now=5) == {}
    assert ax.find_matches([A], now=5) == {1: 1}
    ax.record(4, [A], now=6)  # evicts C
    assert ax.find_matches([C], now=7) == {}
    assert ax.find_matches([A], now=7) == {1: 1, 4: 1}


def test_size_cap_evicts_tail_before_prefix() -> None:
    ax = ApproxIndexer(ttl_s=100, max_blocks=4)
    ax.record(1, [A, B, C], now=0)
    ax.record(2, [A, D], now=1)  # one too many: worker 1 loses its last block, C
    assert ax.find_matches([A, B, C], now=2) == {1: 2, 2: 1}
    # one call larger than the cap keeps its prefix
    ax.record(3, [1, 2, 3, 4, 5, 6], now=3)
    assert ax.find_matches([1, 2, 3, 4, 5, 6], now=4) == {3: 4}
    assert len(ax) == 4


def test_remove_worker() -> None:
    ax = ApproxIndexer(ttl_s=10, max_blocks=100)
    ax.record(1, [A, B], now=0)
    ax.record(2, [A, B], now=0)
    ax.remove_worker(1)
    ax.remove_worker(99)
    assert ax.find_matches([A, B], now=1) == {2: 2}
    assert len(ax) == 2
    # the removed worker's entries do not linger in the expiry order
    ax.record(1, [C], now=2)
    assert ax.find_matches([C], now=11.5) == {1: 1}
    assert ax.find_matches([A], now=11.5) == {}


def test_validation() -> None:
    with pytest.raises(ValueError):
        ApproxIndexer(ttl_s=0, max_blocks=1)
    with pytest.raises(ValueError):
        ApproxIndexer(ttl_s=1, max_blocks=0)
