"""KV tiers (issue 33): G1 → G2 → G3 write-down and onboarding in the block pool, the
tier field of KV events on the wire, the router's index of every tier, onboarding time
on the mocker's virtual clock, and the replay's tier arms."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cli.replay import main as replay_main
from kvmesh.engines.batching.block_manager import BlockManager
from kvmesh.engines.batching.tiers import G1, G2, G3, TIERS, LowerTiers
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import VirtualWorker
from kvmesh.kv.events import decode_kv_payload, decode_kv_view
from kvmesh.kv.hashing import block_hashes
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, PreprocessedRequest, StopConditions
from kvmesh.router.core import KvRouterCore, RouterSettings
from kvmesh.router.indexer import KvIndexer
from kvmesh.runtime.events import RecordingPublisher

BS = 4
W = 7
_MASK = (1 << 63) - 1


def chain(path: tuple[int, ...]) -> list[int]:
    """Chained block hashes of a path of block contents (shared prefix ⇒ shared hashes)."""
    return [hash(path[: i + 1]) & _MASK for i in range(len(path))]


def index_of(events: list[KvEvent], through_wire: bool = True) -> KvIndexer:
    """The router's index after ``events``: as batches of 3 on the wire, decoded as the
    router does (a batch with no tier move takes the G1 fast path), or one by one."""
    index = KvIndexer()
    if through_wire:
        for k in range(0, len(events), 3):
            batch = KvEventBatch(W, events[k].event_id, [e.data for e in events[k : k + 3]])
            index.apply_many(W, decode_kv_view(msgspec.msgpack.encode(batch)).events)
    else:
        for e in events:
            index.apply(W, e.data)
    return index


# ---------------------------------------------------------------------------- the pool


def test_eviction_writes_down_and_a_hit_onboards() -> None:
    pub = RecordingPublisher()
    bm = BlockManager(4, BS, publisher=pub, worker_id=W, host_blocks=4, disk_blocks=4)
    a = chain((1, 2, 3, 4))
    assert bm.allocate(0, 4 * BS)
    bm.commit(0, a, a, 4)
    bm.free(0)
    b = chain((9, 8, 7, 6))
    assert bm.allocate(1, 4 * BS)  # evicts all of a from G1: written down to G2
    bm.commit(1, b, b, 4)
    bm.free(1)
    assert bm.dump_tiers() == {G1: set(b), G2: set(a), G3: set()}
    assert bm.lookup(a) == 4  # a hit in any tier
    assert bm.allocate(2, 4 * BS, a)  # onboarding a pushes b down
    tiers = bm.dump_tiers()
    assert tiers[G1] == set(a) and tiers[G2] == set(b)
    assert bm.take_onboarded() == {G1: 0, G2: 4, G3: 0}
    assert bm.take_onboarded() == {G1: 0, G2: 0, G3: 0}
    assert bm.tiers.stats.hits[G2] == 4 and bm.tiers.stats.written[G2] == 8


def test_g2_overflow_goes_to_disk_then_is_dropped() -> None:
    lower = LowerTiers(host_blocks=2, disk_blocks=2)
    moves = lower.demote([1, 2, 3])
    assert lower.blocks(G2) == {2, 3} and lower.blocks(G3) == {1}
    assert [(m.tier, m.stored) for m in moves] == [(G2, True), (G2, False), (G3, True)]
    lower.demote([4, 5, 6])
    assert lower.blocks(G2) == {5, 6} and lower.blocks(G3) == {3, 4}  # 1, 2 fell off the bottom


def test_a_tier_slower_than_recomputing_is_not_onboarded_and_its_copy_goes() -> None:
    assert MockerOptions(block_size=512).onboard_tiers == (G2, G3)
    assert MockerOptions(block_size=512, kv_bytes_per_token=131072).onboard_tiers == (G2,)  # disk: 22 ms a block
    pub = RecordingPublisher()
    bm = BlockManager(4, BS, publisher=pub, worker_id=W, disk_blocks=8, onboard_tiers=())
    a = chain((1, 2, 3, 4))
    assert bm.allocate(0, 4 * BS)
    bm.commit(0, a, a, 4)
    bm.free(0)
    assert bm.allocate(1, 4 * BS)  # a goes to disk
    bm.free(1)
    assert bm.dump_tiers()[G3] == set(a) and bm.lookup(a) == 0  # not a hit: computed again
    assert bm.allocate(2, 4 * BS)
    bm.commit(2, a, a, 4)
    assert bm.dump_tiers()[G1] == set(a) and bm.dump_tiers()[G3] == set()  # one tier at a time
    assert index_of(pub.kv_events).blocks_of(W, G3) == set()


def test_without_tiers_no_tier_event_and_hits_only_in_g1() -> None:
    pub = RecordingPublisher()
    bm = BlockManager(4, BS, publisher=pub, worker_id=W)
    a = chain((1, 2, 3, 4))
    assert bm.allocate(0, 4 * BS)
    bm.commit(0, a, a, 4)
    bm.free(0)
    assert bm.allocate(1, 4 * BS)
    assert bm.lookup(a) == 0
    assert all(getattr(e.data, "tier", G1) == G1 for e in pub.kv_events)


# ---------------------------------------------------------------------------- storms: pool vs index

paths = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), paths),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=60,
)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(
    ops=ops, host=st.integers(0, 6), disk=st.integers(0, 6), wire=st.booleans(),
    onboard=st.sampled_from([(G2, G3), (G2,), (G3,), ()]),
)  # fmt: skip
def test_index_agrees_with_every_tier_under_eviction_storms(
    ops: list[tuple[str, object]], host: int, disk: int, wire: bool, onboard: tuple[int, ...]
) -> None:
    pub = RecordingPublisher()
    bm = BlockManager(6, BS, publisher=pub, worker_id=W, host_blocks=host, disk_blocks=disk, onboard_tiers=onboard)
    live: list[int] = []
    sid = 0
    for op, arg in ops:
        if op == "start":
            assert isinstance(arg, tuple)
            hashes = chain(arg)
            hit = bm.lookup(hashes)
            if bm.allocate(sid, len(hashes) * BS, hashes[:hit]):
                bm.commit(sid, hashes, hashes, len(hashes))
                live.append(sid)
            sid += 1
        elif op == "free" and live:
            assert isinstance(arg, int)
            bm.free(live.pop(arg % len(live)))
        elif op == "reset" and not live:
            bm.reset()
        tiers = bm.dump_tiers()
        assert sum(map(len, tiers.values())) == len(set().union(*tiers.values())), "a block in two tiers"
        assert len(tiers[G2]) <= host and len(tiers[G3]) <= disk
    index = index_of(pub.kv_events, through_wire=wire)
    tiers = bm.dump_tiers()
    for t in TIERS:
        assert index.blocks_of(W, t) == tiers[t], f"tier {t}"


def test_find_tier_matches_counts_a_run_across_tiers() -> None:
    index = KvIndexer()
    h = chain((1, 2, 3, 4, 5))
    index.apply(W, BlockStored(block_hashes=h[:2]))
    index.apply(W, BlockStored(block_hashes=h[2:4], tier=G2))
    index.apply(W, BlockStored(block_hashes=h[4:], tier=G3))
    index.apply(W + 1, BlockStored(block_hashes=h[:3]))
    assert index.find_matches(h) == {W: 2, W + 1: 3}  # G1 alone, as before
    assert index.find_tier_matches(h) == {W: (2, 2, 1), W + 1: (3, 0, 0)}
    index.apply(W, BlockRemoved(block_hashes=h[2:3], tier=G2))
    assert index.find_tier_matches(h)[W] == (2, 0, 0)
    index.apply(W, AllBlocksCleared())
    assert index.find_tier_matches(h) == {W + 1: (3, 0, 0)}


# ---------------------------------------------------------------------------- the wire


def test_events_decode_with_and_without_the_tier_field() -> None:
    plain = KvEventBatch(W, 0, [BlockStored([1, 2], [3, 4], None), BlockRemoved([1])])
    encoded = msgspec.msgpack.encode(plain)
    assert b"tier" not in encoded  # G1 events: the bytes they always were
    decoded = decode_kv_payload(encoded)
    assert [e.tier for e in decoded.events if not isinstance(e, AllBlocksCleared)] == [G1, G1]
    tiered = KvEventBatch(W, 0, [BlockStored([5], tier=G2), BlockRemoved([5], tier=G3)])
    for decode in (decode_kv_payload, decode_kv_view):
        got = decode(msgspec.msgpack.encode(tiered)).events
        assert [(type(e).__name__, e.tier) for e in got if not isinstance(e, AllBlocksCleared)][1] == ("BlockRemoved", G3)
        assert got[0].tier == G2  # type: ignore[union-attr]
    # an event written before tiers existed (no field) is G1
    old = msgspec.msgpack.encode({"type": "removed", "block_hashes": [9]})
    assert msgspec.msgpack.decode(old, type=BlockRemoved).tier == G1


@pytest.mark.parametrize("tier", [0, 4, -1])
def test_a_tier_out_of_range_does_not_decode(tier: int) -> None:
    bad = msgspec.msgpack.encode([W, 0, [{"type": "stored", "block_hashes": [1], "tier": tier}]])
    with pytest.raises(msgspec.ValidationError):
        decode_kv_payload(bad)
    with pytest.raises(msgspec.ValidationError):
        decode_kv_view(bad)


# ---------------------------------------------------------------------------- the mocker's clock


def _request(rid: str, tokens: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(model="mocker", request_id=rid, token_ids=tokens, stop=StopConditions(max_tokens=1, ignore_eos=True))


def _ttft_of_revisit(host_blocks: int, gbps: float) -> tuple[float, int]:
    """TTFT of prompt A asked again after B pushed it out of a 8-block device pool."""
    opts = MockerOptions(block_size=16, num_blocks=8, host_kv_blocks=host_blocks, host_kv_gbps=gbps, kv_bytes_per_token=4096)
    worker = VirtualWorker(opts)
    a, b = list(range(1, 113)), list(range(1000, 1127))  # 7 blocks; b and its token fill the pool
    t = 0.0
    for rid, tokens in (("a", a), ("b", b), ("a2", a)):
        record = worker.submit(_request(rid, tokens), t)
        worker.run_until_idle()
        t = worker.now_ms + 1.0
    assert record.ttft_ms is not None
    return record.ttft_ms, record.cached_tokens


@pytest.mark.timeout(60)
def test_onboarding_costs_time_on_the_virtual_clock() -> None:
    recompute, cached_none = _ttft_of_revisit(0, 25.0)
    fast, cached_fast = _ttft_of_revisit(64, 25.0)
    slow, cached_slow = _ttft_of_revisit(64, 0.5)  # 0.5 GB/s: 6 blocks × 64 KiB ≈ 0.79 ms (still < prefilling them)
    assert cached_none == 0 and cached_fast == cached_slow == 96  # 6 full blocks of the 7 (the last token is computed)
    assert fast < recompute  # a host hit beats prefilling again
    opts = MockerOptions(block_size=16, kv_bytes_per_token=4096)
    copy_ms = 6 * opts.kv_block_bytes / (0.5 * 1e6)
    assert slow > fast
    assert slow == pytest.approx(fast + copy_ms - 6 * opts.kv_block_bytes / (25.0 * 1e6), rel=1e-6)


def test_onboarding_overlaps_the_decode_part_of_a_pass() -> None:
    opts = MockerOptions(block_size=16)
    decode = opts.decode_ms(0.5)
    assert opts.tiered_step_ms(100, 3, 0.5, decode / 2) == opts.step_ms(100, 3, 0.5)  # hidden behind decodes
    assert opts.tiered_step_ms(100, 3, 0.5, decode + 5.0) == pytest.approx(opts.step_ms(100, 3, 0.5) + 5.0)
    assert opts.tiered_step_ms(100, 0, 0.0, 5.0) == pytest.approx(opts.step_ms(100, 0, 0.0) + 5.0)


# ---------------------------------------------------------------------------- the router


def test_the_router_prices_a_hit_by_tier() -> None:
    core = KvRouterCore(RouterSettings(block_size=BS, tier_weights=(0.25, 0.5)))
    for w in (1, 2, 3):
        core.add_worker(w)
    prompt = list(range(8 * BS))
    hashes = block_hashes(prompt, BS)
    core.apply_event(KvEvent(1, 0, BlockStored(block_hashes=hashes[:6], tier=G2)))  # 6 blocks in host memory
    core.apply_event(KvEvent(2, 0, BlockStored(block_hashes=hashes[:3])))  # 3 on the device
    d = core.route("r", prompt, 0.0)
    assert d.worker_id == 1 and d.overlap_blocks == 6  # 6 G2 blocks at a quarter price beat 3 G1 blocks
    assert d.tiers[1] == (0, 6, 0) and d.tiers[2] == (3, 0, 0)
    by = {c.worker_id: c for c in d.candidates}
    assert by[1].prefill_blocks == pytest.approx((8 - 6) + 0.25 * 6)  # a G2 hit: dearer than G1, cheaper than prefill
    core.finished("r", 0.0)
    core.apply_event(KvEvent(3, 0, BlockStored(block_hashes=hashes[:6])))  # the same run on a device
    assert core.route("r2", prompt, 0.0).worker_id == 3


# ---------------------------------------------------------------------------- the replay's tier arms


def _conversations(tmp_path: Path) -> Path:
    """10 conversations × 4 turns, each turn the last one's blocks plus 4: revisits a
    device pool of 24 blocks cannot keep, and a host tier of 512 can."""
    rows = []
    for turn in range(4):
        for c in range(10):
            ids = [c * 1000 + j for j in range(4 * (turn + 1))]
            rows.append({"timestamp": (turn * 10 + c) * 300, "input_length": 64 * len(ids), "output_length": 4, "hash_ids": ids})
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(120)
def test_cli_tier_arms_write_the_tier_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "arms.json"
    status = replay_main([
        str(_conversations(tmp_path)), "--workers", "2", "--block-size", "64", "--num-blocks", "24", "--no-progress",
        "--arms", "g1,g1+g2,g1+g2+g3", "--host-kv-blocks", "512", "--disk-kv-blocks", "512", "--json", str(out),
    ])  # fmt: skip
    assert status == 0
    assert "g1+g2 vs g1: TTFT p50" in capsys.readouterr().out
    arms = {a["arm"]: a for a in json.loads(out.read_text())}
    assert list(arms) == ["g1", "g1+g2", "g1+g2+g3"]
    for a in arms.values():
        assert {"cache_hit_rate", "tier_hits", "tier_hit_rate", "bytes_written", "bytes_onboarded", "ttft_p50_ms"} <= set(a)
        assert set(a["tier_hits"]) == {"g1", "g2", "g3"} and set(a["bytes_onboarded"]) == {"g2", "g3"}
        assert a["completed"] == 40
    g1, g2 = arms["g1"], arms["g1+g2"]
    assert g1["tier_hits"]["g2"] == 0 and g1["bytes_written"] == {"g2": 0, "g3": 0}
    assert g2["tier_hits"]["g2"] > 0 and g2["bytes_onboarded"]["g2"] == g2["tier_hits"]["g2"] * 64 * 4096
    assert g2["cache_hit_rate"] > 2 * g1["cache_hit_rate"]
    assert g2["cache_hit_rate"] == pytest.approx(sum(g2["tier_hit_rate"].values()), rel=0.01)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arms", "g1,g1+g2"], "needs a host tier: set --host-kv-blocks"),
        (["--arms", "g1,g1+g2+g3", "--host-kv-blocks", "8"], "needs a disk tier: set --disk-kv-blocks"),
        (["--arms", "g1,aggregated"], "unknown tier arm 'aggregated'"),
        (["--arms", "g1,g1"], "names an arm twice"),
    ],
)
def test_cli_bad_tier_arms_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert replay_main([str(_conversations(tmp_path)), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err
