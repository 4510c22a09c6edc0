"""vLLM's KV events (its ZMQ PUB wire format) through VllmKvEventBridge into kvmesh
events and the router's indexer, with a real ZMQ publisher standing in for vLLM's
engine core (the opt-in tests in tests/vllm/ use vLLM itself)."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from kvmesh.engines.vllm.events import VllmKvEventBridge
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.kv.hashing import block_hashes
from kvmesh.router.indexer import KvIndexer
from kvmesh.runtime.events import RecordingPublisher

BS = 4


def _stored(vhashes, parent, tokens):
    # vLLM 0.32 encodes events as tagged maps inside an array-like batch
    return {"type": "BlockStored", "block_hashes": vhashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None,
            "group_idx": 0}  # fmt: skip


def _frames(seq: int, *events) -> list[bytes]:
    payload = msgspec.msgpack.encode([1700000000.0, list(events)])
    return [b"", seq.to_bytes(8, "big"), payload]


async def _wait_for(cond, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_events_from_a_zmq_publisher_reach_the_indexer():
    rec = RecordingPublisher()
    bridge = VllmKvEventBridge(worker_id=7, block_size=BS, publisher=rec)
    bridge.start()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(bridge.endpoint)  # what vLLM does with an ipc:// endpoint
    try:
        tokens = list(range(100, 112))  # three blocks
        ours = block_hashes(tokens, BS)
        # the SUB may join a moment after bind: resend the first batch until it lands
        first = _frames(0, _stored([b"h0", b"h1"], None, tokens[:8]))
        for _ in range(200):
            await pub.send_multipart(first)
            await asyncio.sleep(0.01)
            if bridge.batches:
                break
        assert bridge.batches == 1
        await pub.send_multipart(_frames(1, _stored([b"h2"], b"h1", tokens[8:12])))
        await pub.send_multipart(_frames(2, {"type": "BlockRemoved", "block_hashes": [b"h2"], "medium": "GPU"}))
        await _wait_for(lambda: bridge.batches == 3)

        kinds = [type(e.data) for e in rec.kv_events]
        assert kinds == [AllBlocksCleared, BlockStored, BlockStored, BlockRemoved]
        assert [e.event_id for e in rec.kv_events] == [0, 1, 2, 3] and {e.worker_id for e in rec.kv_events} == {7}
        assert rec.kv_events[1].data.block_hashes == ours[:2]
        assert rec.kv_events[2].data.block_hashes == ours[2:] and rec.kv_events[2].data.parent_hash == ours[1]

        index = KvIndexer()
        for e in rec.kv_events:
            index.apply(e.worker_id, e.data)
        assert index.find_matches(ours) == {7: 2}  # the third block was removed again
        assert bridge.snapshot().block_hashes == sorted(ours[:2]) and bridge.snapshot().last_event_id == 3
        assert [e.event_id for e in bridge.events_since(1)] == [2, 3]
        assert bridge.gaps == 0
    finally:
        pub.close(linger=0)
        ctx.term()
        await bridge.close()
    assert type(rec.kv_events[-1].data) is AllBlocksCleared  # the worker's cache is gone


def test_a_gap_in_vllm_sequence_numbers_is_counted_and_orphans_left_out():
    bridge = VllmKvEventBridge(worker_id=1, block_size=BS)
    tokens = list(range(8))
    assert len(bridge.handle(_frames(0, _stored([1], None, tokens[:4])))) == 1
    # batch 1 (which stored block 2 with vLLM hash 2) was lost; block 3 chains to it
    assert bridge.handle(_frames(2, _stored([3], 2, tokens[4:8]))) == []
    assert bridge.gaps == 1 and bridge.skipped_blocks == 1
