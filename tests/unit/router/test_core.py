"""KvRouterCore: events → overlap → choice, booked load, release, expiry, kv-approx.
Uses the real indexer and approximate indexer."""

from __future__ import annotations

import pytest

from kvmesh.errors import NoWorkers
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvmesh.router.core import Decision, KvRouterCore, RouterSettings
from kvmesh.kv.hashing import block_hashes

BS = 4
PROMPT = list(range(100, 132))  # 32 tokens = 8 blocks
OTHER = list(range(500, 532))


def make_core(workers: int = 3, **kw: object) -> KvRouterCore:
    core = KvRouterCore(RouterSettings(block_size=BS, seed=1, **kw))  # type: ignore[arg-type]
    for w in range(workers):
        core.add_worker(w)
    return core


class Events:
    """Numbered KV events per worker, as a worker's block manager emits them."""

    def __init__(self) -> None:
        self.next_id: dict[int, int] = {}

    def __call__(self, worker: int, data: BlockStored | BlockRemoved | AllBlocksCleared) -> KvEvent:
        eid = self.next_id.get(worker, 0)
        self.next_id[worker] = eid + 1
        return KvEvent(worker_id=worker, event_id=eid, data=data)


def stored(tokens: list[int], blocks: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=block_hashes(tokens, BS)[:blocks])


def costs(d: Decision) -> dict[int, float]:
    return {c.worker_id: c.cost for c in d.candidates}


# ---------------------------------------------------------------------------- events and overlap


def test_the_worker_holding_the_prefix_wins_when_load_is_equal() -> None:
    core, ev = make_core(), Events()
    assert core.apply_event(ev(2, stored(PROMPT, 6))) == "apply"
    assert core.apply_event(ev(1, stored(PROMPT, 2))) == "apply"
    d = core.route("r1", PROMPT, now=0.0)
    assert (d.worker_id, d.overlap_blocks) == (2, 6)
    assert {c.worker_id: c.overlap_blocks for c in d.candidates} == {0: 0, 1: 2, 2: 6}
    by_worker = {c.worker_id: c for c in d.candidates}
    assert by_worker[2].prefill_blocks == 2 and by_worker[2].decode_blocks == 2 and by_worker[2].cost == 4
    assert by_worker[0].cost == 8 + 8  # a worker with no blocks is still a candidate


def test_removed_and_cleared_blocks_stop_matching() -> None:
    core, ev = make_core(2), Events()
    core.apply_event(ev(0, stored(PROMPT)))
    hashes = block_hashes(PROMPT, BS)
    core.apply_event(ev(0, BlockRemoved(block_hashes=hashes[3:])))
    assert core.route("a", PROMPT, 0.0).overlap_blocks == 3
    core.finished("a", 0.0)
    core.apply_event(ev(0, AllBlocksCleared()))
    d = core.route("b", PROMPT, 0.0)
    assert all(c.overlap_blocks == 0 for c in d.candidates)


def test_stale_and_gap_events_are_not_applied_and_a_dump_repairs() -> None:
    core = make_core(2)
    hashes = block_hashes(PROMPT, BS)
    assert core.apply_event(KvEvent(0, 0, BlockStored(block_hashes=hashes[:2]))) == "apply"
    assert core.apply_event(KvEvent(0, 0, BlockStored(block_hashes=hashes[:2]))) == "stale"
    assert core.apply_event(KvEvent(0, 5, BlockStored(block_hashes=hashes[:8]))) == "gap"
    assert core.route("a", PROMPT, 0.0).overlap_blocks == 2  # the gapped event was dropped
    core.finished("a", 0.0)
    core.load_dump(0, hashes[:5], last_event_id=5)
    assert core.route("b", PROMPT, 0.0).overlap_blocks == 5
    assert core.apply_event(KvEvent(0, 6, BlockRemoved(block_hashes=hashes[4:5]))) == "apply"


def test_given_block_hashes_skip_hashing() -> None:
    core, ev = make_core(2), Events()
    core.apply_event(ev(1, stored(PROMPT)))
    d = core.route("a", PROMPT, 0.0, block_hashes=block_hashes(PROMPT, BS)[:3])
    assert (d.worker_id, d.overlap_blocks) == (1, 3)


def test_empty_prompt_routes_on_load_alone() -> None:
    core = make_core(2)
    core.route("big", OTHER, 0.0, weights={1: 0.0})  # force onto worker 0
    assert core.route("empty", [], 0.0).worker_id == 1


# ---------------------------------------------------------------------------- load


def test_load_makes_the_holder_lose() -> None:
    core, ev = make_core(2), Events()
    core.apply_event(ev(0, stored(PROMPT)))
    big = list(range(10_000, 10_400))  # 100 blocks booked on worker 0
    assert core.route("big", big, 0.0, weights={1: 0.0}).worker_id == 0
    assert core.load.prefill_tokens(0) == 400 and core.load.decode_blocks(0) == 100
    d = core.route("r", PROMPT, 0.0)
    assert d.worker_id == 1 and costs(d)[0] > costs(d)[1]


def test_first_token_releases_prefill_and_finished_releases_blocks() -> None:
    core, ev = make_core(2), Events()
    core.apply_event(ev(0, stored(PROMPT)))
    core.route("big", list(range(10_000, 10_400)), 0.0, weights={1: 0.0})
    core.first_token("big", 1.0)
    assert core.load.prefill_tokens(0) == 0 and core.load.decode_blocks(0) == 100
    assert core.route("r1", PROMPT, 1.0).worker_id == 1  # 100 active blocks still outweigh 8 cached
    core.finished("r1", 1.5)
    core.finished("big", 2.0)
    assert core.load.decode_blocks(0) == 0 and core.load.requests(0) == 0
    assert core.route("r2", PROMPT, 2.0).worker_id == 0
    core.finished("unknown", 2.0)  # harmless


def test_booked_requests_spread_over_equal_workers() -> None:
    core = make_core(4)
    chosen = [core.route(f"r{i}", list(range(i * 100, i * 100 + 32)), 0.0).worker_id for i in range(8)]
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_stale_load_expires_after_the_ttl() -> None:
    core = make_core(2, load_ttl_s=10.0)
    core.route("lost", list(range(10_000, 10_400)), 0.0, weights={1: 0.0})
    core.route("b", PROMPT, 5.0)
    assert core.load.decode_blocks(0) == 100
    core.route("c", OTHER, 10.5)  # "lost" untouched for 10.5 s: dropped
    assert "lost" not in core.load and core.load.prefill_tokens(0) in (0, 32)
    assert core.load.decode_blocks(0) + core.load.decode_blocks(1) == 16


def test_first_token_refreshes_the_expiry_clock() -> None:
    core = make_core(1, load_ttl_s=10.0)
    core.route("a", PROMPT, 0.0)
    core.first_token("a", 8.0)
    core.route("b", OTHER, 15.0)
    assert "a" in core.load
    core.route("c", OTHER, 18.5)
    assert "a" not in core.load


def test_rerouting_a_request_moves_its_load() -> None:
    core = make_core(2)
    core.route("a", PROMPT, 0.0, weights={1: 0.0})
    core.route("a", PROMPT, 0.0, weights={0: 0.0})
    assert core.load.requests(0) == 0 and core.load.requests(1) == 1


# ---------------------------------------------------------------------------- knobs and weights


def test_per_request_overrides() -> None:
    core, ev = make_core(2, overlap_weight=1.0), Events()
    core.apply_event(ev(0, stored(PROMPT, 4)))
    d = core.route("a", PROMPT, 0.0, overlap_weight=3.0)
    assert costs(d) == {0: 3 * 4 + 4, 1: 3 * 8 + 8}
    core.finished("a", 0.0)
    hot = set()
    for i in range(40):  # nearly uniform despite the cached prefix
        hot.add(core.route(f"h{i}", PROMPT, 0.0, temperature=100.0).worker_id)
        core.finished(f"h{i}", 0.0)
    assert hot == {0, 1}
    with pytest.raises(ValueError):
        core.route("bad", PROMPT, 0.0, temperature=-1.0)


def test_weight_zero_excludes_and_partial_weight_penalises() -> None:
    core, ev = make_core(3), Events()
    core.apply_event(ev(0, stored(PROMPT, 6)))  # worker 0 costs 2 + 2, the others 8 + 8
    d = core.route("a", PROMPT, 0.0, weights={0: 0.0})
    assert d.worker_id != 0 and {c.worker_id: c.weight for c in d.candidates}[0] == 0.0
    core.finished("a", 0.0)
    assert core.route("b", PROMPT, 0.0, weights={0: 0.5}).worker_id == 0  # (4 + 1) / 0.5 = 10 < 17
    core.finished("b", 0.0)
    assert core.route("c", PROMPT, 0.0, weights={0: 0.2}).worker_id != 0  # (4 + 1) / 0.2 = 25 > 17
    core.finished("c", 0.0)
    assert core.route("d", PROMPT, 0.0, weights={0: 0.0, 1: 0.0, 2: 0.0}).worker_id == 0  # all 0: all take part
    with pytest.raises(ValueError):
        core.route("e", PROMPT, 0.0, weights={0: -1.0})


def test_removed_workers_are_no_longer_candidates() -> None:
    core, ev = make_core(2), Events()
    core.apply_event(ev(0, stored(PROMPT)))
    core.route("a", PROMPT, 0.0)
    core.remove_worker(0)
    assert core.workers == [1] and core.load.requests(0) == 0
    assert core.route("b", PROMPT, 0.0).worker_id == 1
    core.remove_worker(1)
    with pytest.raises(NoWorkers):
        core.route("c", PROMPT, 0.0)


def test_re_added_worker_starts_cold_and_its_event_ids_restart() -> None:
    core = make_core(1)
    core.apply_event(KvEvent(0, 7, stored(PROMPT)))
    core.remove_worker(0)
    core.add_worker(0)
    assert core.route("a", PROMPT, 0.0).overlap_blocks == 0
    assert core.apply_event(KvEvent(0, 0, stored(PROMPT))) == "apply"


def test_same_seed_same_decisions() -> None:
    def run() -> list[int]:
        core = make_core(4)
        out = []
        for i in range(30):
            out.append(core.route(f"r{i}", PROMPT, float(i), temperature=0.5).worker_id)
            core.finished(f"r{i}", float(i))
        return out

    assert run() == run()


@pytest.mark.parametrize(
    "kw", [{"block_size": 0}, {"mode": "fast"}, {"overlap_weight": -1.0}, {"temperature": float("nan")}, {"load_ttl_s": 0.0}]
)
def test_bad_settings_are_value_errors(kw: dict[str, object]) -> None:
    args: dict[str, object] = {"block_size": BS, **kw}
    with pytest.raises(ValueError):
        RouterSettings(**args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- kv-approx


def test_kv_approx_learns_from_its_own_decisions_and_forgets_after_the_ttl() -> None:
    core = make_core(3, mode="kv-approx", approx_ttl_s=60.0)
    first = core.route("a", PROMPT, 0.0)
    assert first.overlap_blocks == 0
    core.finished("a", 1.0)
    again = core.route("b", PROMPT + [7, 7, 7, 7], 10.0)  # the next turn of the conversation
    assert (again.worker_id, again.overlap_blocks) == (first.worker_id, 8)
    core.finished("b", 11.0)
    later = core.route("c", PROMPT, 75.0)  # recorded at 10 s, expired at 70 s
    assert all(c.overlap_blocks == 0 for c in later.candidates)


def test_kv_approx_ignores_kv_events() -> None:
    core = make_core(2, mode="kv-approx")
    assert core.apply_event(KvEvent(1, 0, stored(PROMPT))) == "stale"
    core.load_dump(1, block_hashes(PROMPT, BS), 0)
    assert core.route("a", PROMPT, 0.0).overlap_blocks == 0


def test_kv_approx_forgets_a_removed_worker() -> None:
    core = make_core(2, mode="kv-approx")
    w = core.route("a", PROMPT, 0.0).worker_id
    core.finished("a", 0.0)
    core.remove_worker(w)
    core.add_worker(w)
    assert all(c.overlap_blocks == 0 for c in core.route("b", PROMPT, 1.0).candidates)


def test_load_maps_list_only_loaded_workers() -> None:
    """A worker whose requests all ended leaves the load maps: the fast selection
    (select_greedy) then scores it with its overlap group, not one by one."""
    from kvmesh.router.load import ActiveLoad

    load = ActiveLoad()
    load.add("a", 1, 32, 3, 0.0)
    load.add("b", 1, 16, 2, 0.0)
    load.add("c", 2, 0, 1, 0.0)
    assert dict(load.prefill_by_worker) == {1: 48} and dict(load.blocks_by_worker) == {1: 5, 2: 1}
    load.first_token("a", 1.0)
    load.first_token("b", 1.0)
    assert dict(load.prefill_by_worker) == {}
    assert load.decode_blocks(1) == 5 and load.requests(1) == 2
    for rid in ("a", "b", "c"):
        load.finished(rid)
    assert dict(load.prefill_by_worker) == {} and dict(load.blocks_by_worker) == {}
    assert load.requests(1) == 0 and load.prefill_tokens(2) == 0
