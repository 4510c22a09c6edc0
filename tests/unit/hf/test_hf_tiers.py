"""The hf engine's KV tiers (engines/hf/tiers.py): real K/V written down from the device
pool to host memory and a memory-mapped file, and copied back for a prefix hit."""

from __future__ import annotations

import random

import pytest

from kvmesh.engines.batching.block_manager import BlockManager
from kvmesh.engines.batching.tiers import G1, G2, G3
from kvmesh.engines.hf import HfEngine, HfOptions
from kvmesh.engines.hf.kv import KvPool
from kvmesh.engines.hf.tiers import HfTiers
from kvmesh.errors import InvalidArgument
from kvmesh.preprocess.tokenizer import load_tokenizers_file
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.testing import mock_context
from tests.unit.hf.conftest import torch

BS = 16


def _fill(pool: KvPool, block: int, h: int) -> None:
    """Block content that names its hash."""
    pool.block_view(block).copy_(torch.full_like(pool.block_view(block), float(h % 100_003)))


def _holds(t: torch.Tensor, h: int) -> bool:
    return bool((t == float(h % 100_003)).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host,disk", [(6, 0), (0, 6), (2, 5), (1, 1)])
def test_every_block_keeps_its_content_through_write_down_and_onboarding(tmp_path, host, disk):
    """Random allocations over a 6-block pool: whatever tier a hash is in, its slot (or
    G1 block) holds the content it was computed with."""
    pool = KvPool(6, 4, layers=2, kv_heads=1, head_dim=2)
    bm = BlockManager(6, 4, host_blocks=host, disk_blocks=disk)
    tiers = HfTiers(pool, host, disk, str(tmp_path))
    bm.slots = tiers
    rng = random.Random(host * 10 + disk)
    onboarded = 0
    for step in range(300):
        prefix = [rng.randrange(8) for _ in range(rng.randrange(1, 4))]
        hashes = [hash(tuple(prefix[: i + 1])) & 0xFFFFFF for i in range(len(prefix))]
        hit = bm.lookup(hashes)
        if not bm.allocate(step, len(hashes) * 4, hashes[:hit]):
            continue
        onboarded += sum(bm.take_onboarded().values())
        table = bm.block_table(step)
        for i in range(hit):  # reused or onboarded: the content is already there
            assert _holds(pool.block_view(table[i]), hashes[i]), f"step {step}: block {i} of a hit is wrong"
        for i in range(hit, len(hashes)):  # "computed"
            _fill(pool, table[i], hashes[i])
        bm.commit(step, hashes, hashes, len(hashes))
        bm.free(step)
        for t in (G2, G3):
            store = tiers.stores.get(t)
            if store is not None:
                assert set(store.where) == bm.dump_tiers()[t]
                for h, slot in store.where.items():
                    assert _holds(store.data[slot], h)
    assert onboarded > 0 and tiers.copied["up"] == onboarded
    assert bm.dump_tiers()[G1]


def test_disk_tier_needs_a_writable_folder(tmp_path):
    pool = KvPool(2, 4, layers=1, kv_heads=1, head_dim=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InvalidArgument, match="--hf-disk-kv-path"):
        HfTiers(pool, 0, 4, str(blocker / "kv"))
    tiers = HfTiers(pool, 0, 4, str(tmp_path / "new"))
    assert tiers.stores[G3].capacity == 4
    assert list((tmp_path / "new").iterdir()) == []  # mapped, then unlinked
    with pytest.raises(ValueError, match="--hf-disk-kv-path"):
        HfOptions("m", disk_kv_blocks=4)


def test_host_tier_too_big_for_memory_is_a_clear_error(monkeypatch):
    from kvmesh.errors import ResourceExhausted

    real = torch.empty

    def no_memory(*args, **kw):
        if kw.get("pin_memory") is not None:  # the tier's allocation
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        return real(*args, **kw)

    pool = KvPool(2, 4, layers=1, kv_heads=1, head_dim=2)
    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(ResourceExhausted, match="--hf-host-kv-blocks 1000"):
        HfTiers(pool, 1000, 0)


def test_disk_tier_without_room_fails_at_start(tmp_path, monkeypatch):
    import errno
    import os

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    pool = KvPool(2, 4, layers=1, kv_heads=1, head_dim=2)
    with pytest.raises(InvalidArgument, match="No space left"):
        HfTiers(pool, 0, 4, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the half-made file is gone


# ---------------------------------------------------------------------------- the engine


def _request(ids: list[int], rid: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="kvmesh-tiny", token_ids=list(ids), sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=8, ignore_eos=True),
    )  # fmt: skip


async def _three(tiny_path, ids_a, ids_b, **tiers) -> tuple[list[list[int]], int, dict[str, int]]:
    """A, then B (which evicts A from an 8-block pool), then A again: the three outputs,
    the third's cached tokens and the blocks copied down/up."""
    engine = HfEngine(HfOptions(str(tiny_path), num_blocks=8, max_num_batched_tokens=256, seed=0, **tiers))
    await engine.start()
    try:
        outs, cached = [], 0
        for rid, ids in (("a1", ids_a), ("b", ids_b), ("a2", ids_a)):
            req = _request(ids, rid)
            chunks = [c async for c in engine.generate(req, mock_context(rid))]
            outs.append([t for c in chunks for t in c.token_ids])
            cached = chunks[-1].usage.cached_tokens or 0
        loaded = engine._require()
        copied = dict(loaded.tiers.copied) if loaded.tiers is not None else {}
        return outs, cached, copied
    finally:
        await engine.cleanup()


@pytest.mark.timeout(120)
async def test_greedy_output_is_identical_with_and_without_tiers(tiny_path, tmp_path):
    tok = load_tokenizers_file(tiny_path / "tokenizer.json")
    text = "import os\nimport sys\n\n\nclass Cache:\n    \"\"\"A small LRU cache.\"\"\"\n\n    def __init__(self, size):\n"
    ids = tok.encode(text * 6, add_special_tokens=False).ids
    ids_a, ids_b = ids[:96], ids[1:113]  # A: 6 blocks (+8 out); B: 7 blocks + 8 out = all 8 blocks
    base, cached0, _ = await _three(tiny_path, ids_a, ids_b)
    assert cached0 == 0  # without tiers, B evicted every block of A
    for tiers in (
        {"host_kv_blocks": 16},
        {"disk_kv_blocks": 16, "disk_kv_path": str(tmp_path / "d")},
        {"host_kv_blocks": 2, "disk_kv_blocks": 16, "disk_kv_path": str(tmp_path / "d2")},  # G2 -> G3 pushes
    ):
        outs, cached, copied = await _three(tiny_path, ids_a, ids_b, **tiers)
        assert outs == base, tiers
        assert cached >= 5 * BS, (tiers, cached)  # A's prefix came back from a tier
        assert copied["up"] * BS >= cached and copied["down"] > 0, (tiers, copied)
