"""The mocker's KV block pool: prefix reuse, eviction order, all-or-nothing allocation,
and KV events that replay into exactly the cached set."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engines.batching.block_manager import BlockManager
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvmesh.runtime.events import RecordingPublisher

BS = 4


def replay(events: list[KvEvent]) -> set[int]:
    """Apply events to a set, checking each makes sense against the set so far."""
    cached: set[int] = set()
    for event in events:
        data = event.data
        if isinstance(data, BlockStored):
            assert cached.isdisjoint(data.block_hashes), "stored a hash that was already cached"
            assert len(data.token_hashes) == len(data.block_hashes)
            cached.update(data.block_hashes)
        elif isinstance(data, BlockRemoved):
            assert set(data.block_hashes) <= cached, "removed a hash that was not cached"
            cached.difference_update(data.block_hashes)
        else:
            assert isinstance(data, AllBlocksCleared)
            cached.clear()
    return cached


def manager(num_blocks: int = 8, **kwargs: object) -> tuple[BlockManager, RecordingPublisher]:
    pub = RecordingPublisher()
    return BlockManager(num_blocks, BS, publisher=pub, worker_id=3, **kwargs), pub  # type: ignore[arg-type]


def fill(bm: BlockManager, seq_id: int, hashes: list[int], prefix: int = 0) -> None:
    """Allocate ``seq_id`` for ``len(hashes)`` full blocks (reusing ``prefix`` cached
    ones) and commit them all."""
    assert bm.allocate(seq_id, len(hashes) * BS, hashes[:prefix])
    bm.commit(seq_id, hashes, [h + 1000 for h in hashes], len(hashes))


def evictions(pub: RecordingPublisher) -> list[int]:
    return [h for e in pub.kv_events if isinstance(e.data, BlockRemoved) for h in e.data.block_hashes]


def test_shared_prefix_is_reused_with_a_reference_count() -> None:
    bm, pub = manager()
    fill(bm, 0, [10, 11, 12])
    assert bm.lookup([10, 11, 99, 12]) == 2
    fill(bm, 1, [10, 11, 20], prefix=2)
    assert bm.active_blocks == 4  # 3 + 1 fresh block; the prefix is shared
    stored = [e.data for e in pub.kv_events]
    assert stored == [
        BlockStored(block_hashes=[10, 11, 12], token_hashes=[1010, 1011, 1012], parent_hash=None),
        BlockStored(block_hashes=[20], token_hashes=[1020], parent_hash=11),
    ]
    bm.free(0)
    assert bm.active_blocks == 3  # the shared prefix is still held by seq 1
    bm.free(1)
    assert bm.active_blocks == 0
    assert bm.dump() == {10, 11, 12, 20}  # freed blocks stay cached


def test_eviction_takes_tails_before_shared_prefixes() -> None:
    bm, pub = manager(num_blocks=6)
    fill(bm, 0, [1, 2, 3, 4])
    fill(bm, 1, [1, 2, 5], prefix=2)  # 5 blocks in use, 1 never used
    bm.free(0)  # tail 4, 3 join the LRU list; 1, 2 still held
    bm.free(1)  # then 5, 2, 1
    assert bm.active_blocks == 0
    # Grow a fresh sequence one block at a time: the never-used block goes first,
    # then cached blocks in least-recently-freed order, each sequence's tail first.
    for n in range(1, 7):
        assert bm.allocate(9, n * BS)
    assert evictions(pub) == [4, 3, 5, 2, 1]
    assert bm.dump() == set()
    assert [len(e.data.block_hashes) for e in pub.kv_events if isinstance(e.data, BlockRemoved)] == [1] * 5


def test_lru_order_follows_the_last_free() -> None:
    bm, pub = manager(num_blocks=3)
    fill(bm, 0, [1])
    fill(bm, 1, [2])
    bm.free(0)
    bm.free(1)
    fill(bm, 2, [1], prefix=1)  # reuse block 1: it leaves the free list...
    bm.free(2)  # ...and re-enters it as the most recently freed
    assert bm.allocate(3, 3 * BS)  # the never-used block, then two evictions
    assert evictions(pub) == [2, 1]


def test_unused_blocks_are_taken_before_any_cached_block_is_evicted() -> None:
    bm, pub = manager(num_blocks=4)
    fill(bm, 0, [1, 2])
    bm.free(0)
    assert bm.allocate(1, 2 * BS)
    assert evictions(pub) == []
    assert bm.dump() == {1, 2}


def test_allocation_is_all_or_nothing() -> None:
    bm, pub = manager(num_blocks=4)
    fill(bm, 0, [1, 2, 3])
    assert not bm.allocate(1, 2 * BS)
    assert bm.held_blocks(1) == 0 and bm.active_blocks == 3
    assert not bm.allocate(0, 5 * BS)  # growing past the pool
    assert bm.held_blocks(0) == 3
    bm.free(0)
    # A reused cached block is not counted twice as free space.
    assert bm.allocate(1, 4 * BS, [1, 2, 3])
    assert bm.active_blocks == 4 and evictions(pub) == []


def test_duplicate_content_is_cached_once() -> None:
    bm, pub = manager()
    assert bm.allocate(0, 2 * BS) and bm.allocate(1, 2 * BS)
    bm.commit(0, [1, 2], [11, 12], 2)
    bm.commit(1, [1, 2], [11, 12], 2)  # computed concurrently: stays private
    assert len(pub.kv_events) == 1
    bm.free(0)
    bm.free(1)
    assert bm.dump() == {1, 2}
    assert replay(pub.kv_events) == bm.dump()


def test_partial_duplicate_splits_stored_runs_with_correct_parents() -> None:
    bm, pub = manager()
    fill(bm, 0, [1, 2])
    assert bm.allocate(1, 3 * BS)  # computed without reuse: block 0 duplicates hash 1
    bm.commit(1, [1, 7, 8], [11, 17, 18], 3)
    assert pub.kv_events[-1].data == BlockStored(block_hashes=[7, 8], token_hashes=[17, 18], parent_hash=1)


def test_reset_clears_and_event_ids_count_from_zero() -> None:
    bm, pub = manager()
    fill(bm, 0, [1, 2])
    bm.reset()
    fill(bm, 1, [3])
    assert [e.event_id for e in pub.kv_events] == [0, 1, 2]
    assert all(e.worker_id == 3 for e in pub.kv_events)
    assert isinstance(pub.kv_events[1].data, AllBlocksCleared)
    assert bm.dump() == {3} == replay(pub.kv_events)
    assert bm.ring.since(-1) == pub.kv_events
    assert bm.next_event_id == 3


def test_without_prefix_caching_nothing_is_shared_or_published() -> None:
    bm, pub = manager(enable_prefix_caching=False)
    fill(bm, 0, [1, 2])
    assert bm.lookup([1, 2]) == 0
    bm.free(0)
    bm.reset()
    assert pub.kv_events == [] and bm.dump() == set() and bm.active_blocks == 0


# One operation of a random workload: (kind, seq slot, path choice, length).
_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(0, 3), st.integers(1, 4)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_random_operations_keep_events_and_accounting_consistent(ops: list[tuple[str, int, int, int]]) -> None:
    bm, pub = manager(num_blocks=10)
    live: dict[int, list[int]] = {}
    for kind, slot, path, length in ops:
        # Hashes are paths in a small binary tree (block i depends on the first i bits
        # of ``path``), so prefixes are shared often.
        hashes = [1 + 10 * i + (path >> max(0, 2 - i)) for i in range(length)]
        if kind == "alloc" and slot not in live:
            prefix = bm.lookup(hashes)
            if bm.allocate(slot, length * BS, hashes[:prefix]):
                bm.commit(slot, hashes, hashes, length)
                live[slot] = hashes
        elif kind == "grow" and slot in live:
            grown = live[slot] + [live[slot][-1] * 7 + 1]
            if bm.allocate(slot, len(grown) * BS):
                bm.commit(slot, grown, grown, len(grown))
                live[slot] = grown
        elif kind == "free":
            bm.free(slot)
            live.pop(slot, None)
        assert replay(pub.kv_events) == bm.dump()
        assert bm.active_blocks <= bm.num_blocks
    assert [e.event_id for e in pub.kv_events] == list(range(len(pub.kv_events)))
    for slot in list(live):
        bm.free(slot)
    assert bm.active_blocks == 0 and bm.free_blocks == bm.num_blocks
