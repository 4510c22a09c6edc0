"""vLLM KV event conversion, on payloads encoded the way vLLM's publisher encodes them:
msgspec structs with the same names, field order and options as vLLM's, in both the
positional (tagged array) and the named (map) wire forms."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.kv.hashing import block_hashes, local_block_hashes
from kvmesh.router.indexer import KvIndexer
from kvmesh.engines.vllm.kv_events import VllmEventConverter, decode_batch

BS = 4


# -- vLLM's schema, first release with KV events: tagged positional arrays.
class V1Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class V1Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V1Stored(V1Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class V1Removed(V1Event, tag="BlockRemoved"):
    block_hashes: list[int]


class V1Cleared(V1Event, tag="AllBlocksCleared"):
    pass


# -- later positional form: medium, lora_name, extra_keys, group_idx and cache-spec fields appended.
class V2Stored(V1Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class V2Removed(V1Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


# -- named form (vLLM after switching its event structs from arrays to maps).
class V3Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class V3Batch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V3Stored(V3Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class V3Removed(V3Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class V3Cleared(V3Event, tag="AllBlocksCleared"):
    pass


def enc(batch: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(batch)


TOKENS = list(range(100, 124))  # 6 full blocks
OURS = block_hashes(TOKENS, BS)
VH = [0xF000_0000_0000_0000 + i for i in range(6)]  # vLLM's own hashes (u64, high bit set)


def test_wire_forms_are_what_vllm_sends() -> None:
    legacy = enc(V1Batch(1.5, [V1Stored([1], None, [1, 2, 3, 4], 4, None)]))
    assert msgspec.msgpack.decode(legacy) == [1.5, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None]], None]
    named = msgspec.msgpack.decode(enc(V3Batch(1.5, [V3Removed([1], "GPU")], 0)))
    assert named == {"ts": 1.5, "events": [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}],
                     "data_parallel_rank": 0}


def test_legacy_stored_chain_removed_cleared() -> None:
    conv = VllmEventConverter(BS)
    out = conv.convert(
        enc(
            V1Batch(
                1.0,
                [
                    V1Stored(VH[:2], None, TOKENS[:8], BS, None),
                    V1Stored(VH[2:6], VH[1], TOKENS[8:24], BS, None),
                ],
            )
        )
    )
    assert out == [
        BlockStored(block_hashes=OURS[:2], token_hashes=local_block_hashes(TOKENS[:8], BS), parent_hash=None),
        BlockStored(block_hashes=OURS[2:], token_hashes=local_block_hashes(TOKENS[8:], BS), parent_hash=OURS[1]),
    ]
    assert conv.last_ts == 1.0 and conv.last_dp_rank is None
    assert conv.tracked_blocks == 6
    out = conv.convert(enc(V1Batch(2.0, [V1Removed([VH[5], VH[4], 12345])])))
    assert out == [BlockRemoved(block_hashes=[OURS[5], OURS[4]])]
    assert conv.convert(enc(V1Batch(3.0, [V1Removed([12345])]))) == []
    assert conv.convert(enc(V1Batch(4.0, [V1Cleared()]))) == [AllBlocksCleared()]
    assert conv.tracked_blocks == 0


def test_newer_positional_fields_and_trailing_extras() -> None:
    conv = VllmEventConverter(BS)
    out = conv.convert(
        enc(
            V1Batch(
                1.0,
                [
                    V2Stored(VH[:3], None, TOKENS[:12], BS, None, "GPU", None, [None] * 3, 0, "full_attention", None),
                    V2Stored(VH[3:6], VH[2], TOKENS[12:24], BS, None, "GPU", None),
                ],
                data_parallel_rank=2,
            )
        )
    )
    assert [h for e in out for h in e.block_hashes] == OURS
    assert conv.last_dp_rank == 2
    assert conv.convert(enc(V1Batch(2.0, [V2Removed(VH[:1], "GPU", 0)]))) == [BlockRemoved(block_hashes=OURS[:1])]


def test_named_form() -> None:
    conv = VllmEventConverter(BS)
    out = conv.convert(
        enc(V3Batch(1.0, [V3Stored(VH[:6], None, TOKENS, BS, None, "GPU", None, [None] * 6, 0, "full_attention")], 0))
    )
    assert out == [BlockStored(block_hashes=OURS, token_hashes=local_block_hashes(TOKENS, BS), parent_hash=None)]
    assert conv.convert(enc(V3Batch(2.0, [V3Removed(VH[2:4], "GPU"), V3Cleared()]))) == [
        BlockRemoved(block_hashes=OURS[2:4]),
        AllBlocksCleared(),
    ]
    # unknown event types and extra fields of known ones are ignored
    raw = msgspec.msgpack.encode(
        [9.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": TOKENS[:4],
                "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "future": 1},
               {"type": "SomethingNew", "x": 1}, ["AlsoNew", 1]], 0]
    )
    assert conv.convert(raw) == [BlockStored(block_hashes=OURS[:1], token_hashes=local_block_hashes(TOKENS[:4], BS))]


def test_bytes_hashes() -> None:
    conv = VllmEventConverter(BS)
    vh = [bytes([i]) * 32 for i in range(2)]
    out = conv.convert(enc(V1Batch(1.0, [V2Stored(vh[:1], None, TOKENS[:4], BS, None, "GPU", None),
                                         V2Stored(vh[1:], vh[0], TOKENS[4:8], BS, None, "GPU", None)])))
    assert [h for e in out for h in e.block_hashes] == OURS[:2]
    assert conv.convert(enc(V1Batch(2.0, [V2Removed(vh, "GPU")]))) == [BlockRemoved(block_hashes=OURS[:2])]


def test_unknown_parent_is_left_out_with_its_descendants() -> None:
    conv = VllmEventConverter(BS)
    out = conv.convert(enc(V1Batch(1.0, [V1Stored(VH[2:4], VH[1], TOKENS[8:16], BS, None),
                                         V1Stored(VH[4:5], VH[3], TOKENS[16:20], BS, None)])))
    assert out == []
    assert conv.skipped_blocks == 3
    assert conv.convert(enc(V1Batch(2.0, [V1Removed(VH[2:5])]))) == []


def test_lora_and_extra_keys_are_left_out() -> None:
    conv = VllmEventConverter(BS)
    lora = enc(V1Batch(1.0, [V2Stored(VH[:2], None, TOKENS[:8], BS, 1, "GPU", "adapter")]))
    assert conv.convert(lora) == []
    # a multimodal block in the middle: the run before it is kept, the rest is not
    mm = enc(V1Batch(1.0, [V2Stored(VH[:4], None, TOKENS[:16], BS, None, "GPU", None,
                                    [None, None, ("img-hash", 0), None])]))
    assert conv.convert(mm) == [BlockStored(block_hashes=OURS[:2], token_hashes=local_block_hashes(TOKENS[:8], BS))]
    child = enc(V1Batch(1.0, [V2Stored(VH[4:5], VH[3], TOKENS[16:20], BS, None, "GPU", None)]))
    assert conv.convert(child) == []
    assert conv.skipped_blocks == 2 + 2 + 1


def test_other_medium_group_and_block_size_are_ignored() -> None:
    conv = VllmEventConverter(BS)
    cpu = V2Stored(VH[:1], None, TOKENS[:4], BS, None, "CPU", None)
    group1 = V2Stored(VH[:1], None, TOKENS[:4], BS, None, "GPU", None, None, 1)
    bs8 = V2Stored(VH[:1], None, TOKENS[:8], 8, None, "GPU", None)
    assert conv.convert(enc(V1Batch(1.0, [cpu, group1, bs8]))) == []
    assert conv.tracked_blocks == 0
    conv.convert(enc(V1Batch(1.0, [V2Stored(VH[:1], None, TOKENS[:4], BS, None, "GPU", None)])))
    assert conv.convert(enc(V1Batch(2.0, [V2Removed(VH[:1], "CPU"), V2Removed(VH[:1], "GPU", 1)]))) == []
    assert conv.convert(enc(V1Batch(3.0, [V2Removed(VH[:1], "GPU", 0)]))) == [BlockRemoved(block_hashes=OURS[:1])]
    # a converter for another group takes that group's events
    conv1 = VllmEventConverter(BS, group_idx=1)
    assert conv1.convert(enc(V1Batch(1.0, [group1]))) == [
        BlockStored(block_hashes=OURS[:1], token_hashes=local_block_hashes(TOKENS[:4], BS))
    ]


def test_duplicate_copies_are_counted() -> None:
    conv = VllmEventConverter(BS)
    stored = V1Stored(VH[:1], None, TOKENS[:4], BS, None)
    conv.convert(enc(V1Batch(1.0, [stored, stored])))
    assert conv.convert(enc(V1Batch(2.0, [V1Removed(VH[:1])]))) == []
    assert conv.convert(enc(V1Batch(3.0, [V1Removed(VH[:1])]))) == [BlockRemoved(block_hashes=OURS[:1])]


def test_into_the_indexer() -> None:
    conv, ix = VllmEventConverter(BS), KvIndexer()
    payload = enc(V1Batch(1.0, [V1Stored(VH[:3], None, TOKENS[:12], BS, None),
                                V1Stored(VH[3:5], VH[2], TOKENS[12:20], BS, None)]))
    for data in conv.convert(payload):
        ix.apply(7, data)
    # the router hashes a request's tokens itself; the worker's blocks line up
    assert ix.find_matches(block_hashes(TOKENS + [1, 2, 3, 4], BS)) == {7: 5}


def test_bad_payloads() -> None:
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode(3))
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode([1.0, 2]))
    with pytest.raises(ValueError):
        VllmEventConverter(0)
