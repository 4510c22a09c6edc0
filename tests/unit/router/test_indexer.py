"""KvIndexer against a brute-force oracle (per-worker sets + the definition of a
leading run), and EventSequencer's gap / stale / restart rules."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEventData
from kvmesh.engines.batching.block_manager import BlockManager
from kvmesh.kv.hashing import block_hashes, local_block_hashes
from kvmesh.runtime.events import RecordingPublisher
from kvmesh.router.indexer import EventSequencer, KvIndexer

# A small universe of realistic 64-bit hashes, so random streams collide often.
UNIVERSE = [h for i in range(12) for h in block_hashes([i] * 4, 4)]
# Many worker ids, sparse and large, so masks grow past one machine word.
WORKERS = [0, 1, 2, 5, 2**40 + 3] + [1000 + 7 * i for i in range(75)]


class Oracle:
    def __init__(self) -> None:
        self.held: dict[int, set[int]] = {}

    def apply(self, w: int, data: KvEventData) -> None:
        if isinstance(data, BlockStored):
            self.held.setdefault(w, set()).update(data.block_hashes)
        elif isinstance(data, BlockRemoved):
            if w in self.held:
                self.held[w].difference_update(data.block_hashes)
        elif w in self.held:
            self.held[w].clear()

    def find_matches(self, query: list[int]) -> dict[int, int]:
        out = {}
        for w, held in self.held.items():
            n = 0
            while n < len(query) and query[n] in held:
                n += 1
            if n:
                out[w] = n
        return out

    def num_blocks(self) -> int:
        return len(set().union(*self.held.values())) if self.held else 0


hashes = st.lists(st.sampled_from(UNIVERSE), max_size=8)
worker = st.sampled_from(WORKERS)
op = st.one_of(
    st.tuples(st.just("stored"), worker, hashes),
    st.tuples(st.just("removed"), worker, hashes),
    st.tuples(st.just("cleared"), worker, st.just([])),
    st.tuples(st.just("remove_worker"), worker, st.just([])),
    st.tuples(st.just("load_dump"), worker, hashes),
)


def run(ix: KvIndexer, oracle: Oracle, kind: str, w: int, hs: list[int]) -> None:
    if kind == "stored":
        ix.apply(w, BlockStored(block_hashes=hs))
        oracle.apply(w, BlockStored(block_hashes=hs))
    elif kind == "removed":
        ix.apply(w, BlockRemoved(block_hashes=hs))
        oracle.apply(w, BlockRemoved(block_hashes=hs))
    elif kind == "cleared":
        ix.apply(w, AllBlocksCleared())
        oracle.apply(w, AllBlocksCleared())
    elif kind == "remove_worker":
        ix.remove_worker(w)
        oracle.held.pop(w, None)
    else:
        ix.load_dump(w, hs)
        oracle.held[w] = set(hs)


@given(ops=st.lists(op, max_size=60), queries=st.lists(hashes, min_size=1, max_size=10))
@settings(max_examples=300, deadline=None)
def test_matches_oracle(ops: list[tuple[str, int, list[int]]], queries: list[list[int]]) -> None:
    ix, oracle = KvIndexer(), Oracle()
    for n, (kind, w, hs) in enumerate(ops):
        run(ix, oracle, kind, w, hs)
        assert ix.num_blocks == oracle.num_blocks()
        assert ix.worker_block_count(w) == len(oracle.held.get(w, ()))
        q = queries[n % len(queries)]  # interleaved, so cached decodings meet removals
        assert ix.find_matches(q) == oracle.find_matches(q)
    for q in queries:
        assert ix.find_matches(q) == oracle.find_matches(q)
    # queries built from what workers hold, so long runs are exercised too
    for w, held in oracle.held.items():
        q = sorted(held) + [UNIVERSE[0]]
        assert ix.find_matches(q) == oracle.find_matches(q), w
        assert ix.blocks_of(w) == held


def test_leading_run_semantics() -> None:
    a, b, c, d = UNIVERSE[:4]
    ix = KvIndexer()
    ix.apply(1, BlockStored(block_hashes=[a, b, c]))
    ix.apply(2, BlockStored(block_hashes=[a, b]))
    ix.apply(3, BlockStored(block_hashes=[b, c]))  # no first block: never matches [a, ...]
    assert ix.find_matches([a, b, c, d]) == {1: 3, 2: 2}
    assert ix.find_matches([b, c]) == {3: 2, 1: 2, 2: 1}
    assert ix.find_matches([d]) == {}
    assert ix.find_matches([]) == {}
    # a hole breaks the run even if later blocks are held
    ix.apply(1, BlockRemoved(block_hashes=[b]))
    assert ix.find_matches([a, b, c]) == {1: 1, 2: 2}


def test_thousand_workers_share_a_prefix() -> None:
    prefix = block_hashes(list(range(64)), 4)  # 16 blocks
    ix = KvIndexer()
    for w in range(1000):
        tail = block_hashes(list(range(64)) + [w] * 8, 4)[16:]
        ix.apply(w, BlockStored(block_hashes=prefix[: 1 + w % 16] if w % 2 else prefix + tail))
    got = ix.find_matches(prefix + block_hashes(list(range(64)) + [998] * 8, 4)[16:])
    assert len(got) == 1000
    assert got[998] == 18
    assert all(got[w] == 16 for w in range(0, 1000, 2) if w != 998)
    assert all(got[w] == 1 + w % 16 for w in range(1, 1000, 2))
    assert ix.num_blocks == 16 + 2 * 500


def test_stored_is_idempotent_and_removed_of_unknown_is_noop() -> None:
    a, b = UNIVERSE[:2]
    ix = KvIndexer()
    ix.apply(7, BlockStored(block_hashes=[a, a, b]))
    ix.apply(7, BlockStored(block_hashes=[a, b]))
    assert ix.worker_block_count(7) == 2
    ix.apply(7, BlockRemoved(block_hashes=[b, b, UNIVERSE[5]]))
    ix.apply(8, BlockRemoved(block_hashes=[a]))
    ix.apply(8, AllBlocksCleared())
    assert ix.find_matches([a, b]) == {7: 1}
    assert ix.worker_block_count(7) == 1 and ix.worker_block_count(8) == 0


def test_cleared_is_per_worker() -> None:
    a, b = UNIVERSE[:2]
    ix = KvIndexer()
    ix.apply(1, BlockStored(block_hashes=[a, b]))
    ix.apply(2, BlockStored(block_hashes=[a, b]))
    ix.apply(1, AllBlocksCleared())
    assert ix.find_matches([a, b]) == {2: 2}
    assert ix.worker_block_count(1) == 0
    assert ix.num_blocks == 2


def test_remove_worker_and_index_reuse() -> None:
    a, b = UNIVERSE[:2]
    ix = KvIndexer()
    for w in range(100):
        ix.apply(w, BlockStored(block_hashes=[a]))
    ix.apply(99, BlockStored(block_hashes=[b]))
    for w in range(99):
        ix.remove_worker(w)
    ix.remove_worker(12345)  # unknown: no-op
    assert ix.find_matches([a, b]) == {99: 2}
    assert ix.workers == [99]
    ix.apply(500, BlockStored(block_hashes=[a]))  # takes a freed (low) index
    assert ix.find_matches([a, b]) == {99: 2, 500: 1}
    ix.remove_worker(99)
    ix.remove_worker(500)
    assert ix.num_blocks == 0 and ix.workers == []


def test_wide_masks_follow_worker_churn() -> None:
    a, b = UNIVERSE[:2]
    ix = KvIndexer()
    for w in range(100):
        ix.apply(w, BlockStored(block_hashes=[a, b] if w % 3 else [a]))
    first = ix.find_matches([a, b])
    assert first == {w: 2 if w % 3 else 1 for w in range(100)}
    assert ix.find_matches([a, b]) == first  # the same wide masks again
    for w in range(0, 100, 2):
        ix.remove_worker(w)
    for w in range(1000, 1050):  # take the freed indices
        ix.apply(w, BlockStored(block_hashes=[a]))
    want = {w: 2 if w % 3 else 1 for w in range(1, 100, 2)} | {w: 1 for w in range(1000, 1050)}
    assert ix.find_matches([a, b]) == want
    # the very same mask again, but one bit now names another worker
    ix.remove_worker(1000)
    ix.apply(7777, BlockStored(block_hashes=[a]))
    assert ix.find_matches([a, b]) == {w: v for w, v in want.items() if w != 1000} | {7777: 1}


def test_load_dump_replaces_blocks() -> None:
    a, b, c = UNIVERSE[:3]
    ix = KvIndexer()
    ix.apply(1, BlockStored(block_hashes=[a, b]))
    ix.apply(2, BlockStored(block_hashes=[a]))
    ix.load_dump(1, [a, c])
    assert ix.blocks_of(1) == {a, c}
    assert ix.find_matches([a, b]) == {1: 1, 2: 1}
    assert ix.find_matches([a, c]) == {1: 2, 2: 1}
    ix.load_dump(3, iter([b]))  # a new worker with a warm cache
    assert ix.find_matches([b]) == {3: 1}
    ix.load_dump(1, [])
    assert ix.worker_block_count(1) == 0
    assert ix.num_blocks == 2


def test_event_replay_matches_dump_of_the_mocker() -> None:
    pub = RecordingPublisher()
    bm = BlockManager(6, 4, publisher=pub, worker_id=9)
    ix = KvIndexer()
    for seq in range(5):
        tokens = [seq % 2] * 8 + [seq] * 8
        hs = block_hashes(tokens, 4)
        cached = bm.lookup(hs)
        assert bm.allocate(seq, len(tokens), hs[:cached])
        bm.commit(seq, hs, local_block_hashes(tokens, 4), len(hs))
        bm.free(seq)
    for event in pub.kv_events:
        ix.apply(event.worker_id, event.data)
    assert ix.blocks_of(9) == bm.dump()


# ---------------------------------------------------------------------- sequencer


def test_sequencer_in_order_stale_and_gap() -> None:
    seq = EventSequencer()
    assert seq.accept(1, 0) == "apply"
    assert seq.accept(1, 1) == "apply"
    assert seq.accept(1, 1) == "stale"
    assert seq.accept(1, 3) == "gap"
    assert seq.accept(1, 3) == "gap"  # not recorded until reset
    seq.reset(1, 3)
    assert seq.accept(1, 4) == "apply"
    assert seq.last_event_id(1) == 4
    # workers are independent
    assert seq.accept(2, 17) == "apply"  # first seen: whatever the id
    assert seq.accept(2, 18) == "apply"


def test_sequencer_restart_at_zero() -> None:
    seq = EventSequencer()
    for i in range(5):
        assert seq.accept(1, i) == "apply"
    # the worker restarted: its event 0 is AllBlocksCleared
    assert seq.accept(1, 0, AllBlocksCleared()) == "apply"
    assert seq.accept(1, 1) == "apply"
    assert seq.accept(1, 2) == "apply"
    # an event 0 that is not a clear after a higher id: state unknown, repair
    assert seq.accept(1, 0, BlockStored(block_hashes=[1])) == "gap"
    assert seq.last_event_id(1) == 2
    # without data, 0 after a higher id is taken as a restart
    assert seq.accept(1, 0) == "apply"


def test_sequencer_forget_and_reset_minus_one() -> None:
    seq = EventSequencer()
    assert seq.accept(1, 5) == "apply"
    seq.forget(1)
    assert seq.last_event_id(1) is None
    assert seq.accept(1, 2) == "apply"
    seq.reset(1, -1)  # dump taken before any event: the next is 0
    assert seq.accept(1, 1) == "gap"
    assert seq.accept(1, 0, BlockStored(block_hashes=[1])) == "apply"


def test_log_compaction_keeps_memory_bounded() -> None:
    ix = KvIndexer()
    keep = block_hashes(list(range(400)), 4)  # 100 blocks held throughout
    ix.apply(1, BlockStored(block_hashes=keep))
    for round_ in range(30):
        churn = block_hashes([round_ + 1000] * 800, 4)  # 200 blocks in, then out
        ix.apply(1, BlockStored(block_hashes=churn))
        ix.apply(1, BlockStored(block_hashes=keep[:10]))  # re-stores of held blocks log nothing
        ix.apply(1, BlockRemoved(block_hashes=churn))
        ix.apply(1, BlockRemoved(block_hashes=keep[:5]))
        ix.apply(1, BlockStored(block_hashes=keep[:5]))  # stored again: a second log entry
    assert ix.blocks_of(1) == set(keep)
    assert ix.worker_block_count(1) == 100
    assert ix.find_matches(keep) == {1: 100}
    log = ix._log[ix._index[1]]  # the per-worker log stays within 2 × live + slack
    assert len(log) <= 2 * 100 + 1024 + 200 + 5
    ix.apply(1, AllBlocksCleared())
    assert ix.num_blocks == 0 and ix.blocks_of(1) == set()


def test_hashes_must_be_u64() -> None:
    ix = KvIndexer()
    ix.apply(1, BlockStored(block_hashes=[0, 2**64 - 1]))
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            ix.apply(1, BlockStored(block_hashes=[5, bad]))
    # nothing half-applied for the bad hash itself; earlier ones in the event stay
    assert ix.blocks_of(1) == {0, 2**64 - 1, 5}
    assert ix.worker_block_count(1) == 3 and ix.num_blocks == 3


class _RebuildOnly(KvIndexer):
    """The reference: every compaction rebuilds the log from its live entries."""

    def _compact(self, i: int) -> None:
        from array import array

        self._log[i] = array(self._log[i].typecode, dict.fromkeys(self._live(i)))


def _logged(ix: KvIndexer) -> list[int]:
    """Worker 1's live log entries, each once, read without ``_live``."""
    i = ix._index[1]
    bit = ix._bits[i]
    return list(dict.fromkeys(h for h in ix._log[i] if ix._nodes.get(h, 0) & bit))


@pytest.mark.parametrize("pinned", [False, True])
def test_compaction_cuts_the_dead_front_and_keeps_what_a_rebuild_keeps(pinned: bool) -> None:
    """An engine evicting its least recently stored blocks leaves the log's dead entries
    at its front (dead for this worker: another may hold them): compaction cuts that run. With a block stored first and never evicted
    (``pinned``) the front is live and the log is rebuilt. Either way the live blocks,
    their order (the cap's eviction order) and the log's bound are a rebuild's."""
    import random

    class Counting(KvIndexer):
        rebuilds = 0  # reads of the whole log's live entries (a rebuild; a cut reads none)

        def _live(self, i: int) -> Iterable[int]:
            self.rebuilds += 1
            return super()._live(i)

    rng = random.Random(36)
    cap = 6000
    ix, ref = Counting(max_blocks_per_worker=cap), _RebuildOnly(max_blocks_per_worker=cap)
    stored: list[int] = []
    first = rng.getrandbits(64)
    events: list[KvEventData] = [BlockStored(block_hashes=[first])] if pinned else []
    for step in range(1500):
        new = [rng.getrandbits(64) for _ in range(rng.randint(1, 12))]
        stored += new
        events.append(BlockStored(block_hashes=new))
        if len(stored) > 2000:  # a full cache: the oldest go (an LRU engine), a few others too
            old, stored = stored[:len(new)], stored[len(new):]
            if rng.random() < 0.1:
                old.append(stored.pop(rng.randrange(len(stored))))
            events.append(BlockRemoved(block_hashes=old))
            if rng.random() < 0.3:  # another worker holds some of them: not dead in its log
                for index in (ix, ref):
                    index.apply(2, BlockStored(block_hashes=old))
        if step % 7 == 0:
            ix.apply_many(1, events)
            for e in events:
                ref.apply(1, e)
            events = []
            assert _logged(ix) == _logged(ref)  # every held block in the log, in the reference's order
    ix.apply_many(1, events)
    for e in events:
        ref.apply(1, e)
    rebuilds = ix.rebuilds
    i = ix._index[1]
    live = list(dict.fromkeys(ix._live(i)))
    assert live == list(dict.fromkeys(ref._live(ref._index[1])))  # the same blocks, in the same order
    assert set(live) == set(stored) | ({first} if pinned else set())
    assert ix.worker_block_count(1) == len(live)
    # compacted (~10,000 stores, ~2,000 live), by cuts alone unless the front is pinned
    assert len(ix._log[i]) <= 2 * len(live) + 1024 + 100
    assert (rebuilds > 0) if pinned else (rebuilds == 0)
    # the cap evicts the oldest stored first, as the reference does
    more = [rng.getrandbits(64) for _ in range(cap)]
    ix.apply_many(1, [BlockStored(block_hashes=more)])
    ref.apply(1, BlockStored(block_hashes=more))
    assert ix.blocks_of(1) == ref.blocks_of(1) and ix.evicted == ref.evicted > 0
