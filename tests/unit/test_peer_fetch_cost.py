"""The peer-fetch decision (router/peer.py, issue 33): pure."""

from __future__ import annotations

import pytest

from kvmesh.protocol import KvEndpoint, KvLayout, PeerPrefix
from kvmesh.router.cost import CandidateScore
from kvmesh.router.peer import PeerFetchSettings, best_peer, fetch_pays, plan_peer_fetch

BS = 16
LAYOUT = KvLayout("mocker", BS, 1024, (BS, 4096), "uint8", BS * 4096, 8, 25e9)


def kv(worker_id: int, serves: bool = True, layout: KvLayout = LAYOUT) -> KvEndpoint:
    return KvEndpoint(f"127.0.0.1:{7000 + worker_id}", layout, serves)


def cand(worker_id: int, overlap: int, weight: float = 1.0) -> CandidateScore:
    return CandidateScore(worker_id, overlap, 0.0, 0.0, 0.0, weight)


def test_fetch_pays_compares_transfer_with_prefill() -> None:
    s = PeerFetchSettings(link_gbps=25.0, prefill_tokens_per_ms=8.0, overhead_ms=1.0)
    # 10 blocks: 10 × 64 KiB ÷ 25 GB/s = 26 µs + 1 ms  <  160 tokens ÷ 8/ms = 20 ms
    assert fetch_pays(10, BS, BS * 4096, s)
    # one block: 1 ms + 2.6 µs  <  2 ms of prefill, still pays; a slow link does not
    assert fetch_pays(1, BS, BS * 4096, s)
    assert not fetch_pays(10, BS, BS * 4096, PeerFetchSettings(link_gbps=0.01))
    # the fixed cost decides short runs: 1 block at 20 ms overhead loses to 2 ms of prefill
    assert not fetch_pays(1, BS, BS * 4096, PeerFetchSettings(overhead_ms=20.0))
    assert fetch_pays(20, BS, BS * 4096, PeerFetchSettings(overhead_ms=20.0))
    assert not fetch_pays(0, BS, BS * 4096, s)
    assert not fetch_pays(3, BS, BS * 4096, PeerFetchSettings(min_blocks=4))


def test_the_break_even_is_where_the_two_times_meet() -> None:
    # bytes per block at which transfer equals prefill: bs / rate × link − overhead share
    s = PeerFetchSettings(link_gbps=1.0, prefill_tokens_per_ms=1.0, overhead_ms=0.0)
    even = BS / 1000.0 * 1e9  # 16 tokens at 1/ms = 16 ms; 16 ms at 1 GB/s = 16 MB
    assert fetch_pays(5, BS, int(even) - 1, s)
    assert not fetch_pays(5, BS, int(even) + 1, s)


@pytest.mark.parametrize("bad", [{"link_gbps": 0.0}, {"prefill_tokens_per_ms": -1.0}, {"overhead_ms": float("nan")}, {"min_blocks": 0}])
def test_settings_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PeerFetchSettings(**bad)  # type: ignore[arg-type]


def test_best_peer_is_the_longest_live_run_longer_than_the_chosen() -> None:
    every = lambda w: True  # noqa: E731
    assert best_peer([cand(1, 2), cand(2, 9), cand(3, 5)], 1, every) == cand(2, 9)
    assert best_peer([cand(1, 9), cand(2, 9)], 1, every) is None  # not longer
    assert best_peer([cand(1, 0), cand(2, 9, weight=0.0), cand(3, 4)], 1, every) == cand(3, 4)  # unhealthy: skipped
    assert best_peer([cand(1, 0), cand(2, 9), cand(3, 4)], 1, lambda w: w != 2) == cand(3, 4)  # cannot serve
    assert best_peer([cand(1, 0), cand(3, 7), cand(2, 7)], 1, every) == cand(2, 7)  # tie: lowest id


def test_plan_names_the_peer_its_endpoint_and_its_run() -> None:
    endpoints = {1: kv(1), 2: kv(2), 3: kv(3)}
    s = PeerFetchSettings()
    plan = plan_peer_fetch([cand(1, 2), cand(2, 12), cand(3, 5)], 1, endpoints.get, BS, s)
    assert plan == PeerPrefix(2, endpoints[2], 12)
    # the chosen worker holds the most, or is alone: no hint
    assert plan_peer_fetch([cand(1, 12), cand(2, 3)], 1, endpoints.get, BS, s) is None
    assert plan_peer_fetch([cand(1, 0)], 1, endpoints.get, BS, s) is None


def test_plan_needs_both_ends_serving_prefixes_with_the_same_block_size() -> None:
    s = PeerFetchSettings()
    cands = [cand(1, 0), cand(2, 12)]
    assert plan_peer_fetch(cands, 1, {1: kv(1, serves=False), 2: kv(2)}.get, BS, s) is None  # chosen: no --peer-fetch
    assert plan_peer_fetch(cands, 1, {1: kv(1), 2: kv(2, serves=False)}.get, BS, s) is None
    assert plan_peer_fetch(cands, 1, {1: kv(1)}.get, BS, s) is None  # the peer's record has no KV endpoint
    other = KvLayout("mocker", 32, 1024, (32, 4096), "uint8", 32 * 4096, 8, 25e9)
    assert plan_peer_fetch(cands, 1, {1: kv(1), 2: kv(2, layout=other)}.get, BS, s) is None


def test_plan_respects_the_cost() -> None:
    cands = [cand(1, 0), cand(2, 12)]
    endpoints = {1: kv(1), 2: kv(2)}.get
    assert plan_peer_fetch(cands, 1, endpoints, BS, PeerFetchSettings(link_gbps=25.0)) is not None
    assert plan_peer_fetch(cands, 1, endpoints, BS, PeerFetchSettings(link_gbps=0.001)) is None
