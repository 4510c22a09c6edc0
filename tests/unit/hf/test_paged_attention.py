"""Paged decode attention: the PyTorch reference against a naive per-sequence attention
(CPU), and the Triton kernel against the reference (CUDA with triton; or the CPU under
``TRITON_INTERPRET=1`` with triton importable, otherwise skipped).

Every case fills the pool with NaN except the positions its sequences really own, and
pads the block tables with random (valid) block ids, so a mask that lets one key too
many in, or a table read past a sequence's blocks, turns the output into NaN.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from kvmesh.engines.hf import paged_attention as pa  # noqa: E402

F = torch.nn.functional


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...] = (1, 16, 17, 45, 64, 300)  # 1 key, on / off a block boundary, long
    kv_heads: int = 2
    group: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    pad_blocks: int = 2  # table columns past the longest sequence's blocks
    layout: str = "pool"  # pool: a layer of (layers, 2, slots, kv_heads, D); heads_major / dim_strided: other strides
    seed: int = 0

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        shape = f"d{self.head_dim}-kv{self.kv_heads}-g{self.group}-bs{self.block_size}"
        return f"{dtype}-{shape}-{self.layout}-L{max(self.lens)}"


def make_args(case: Case, device: str | torch.device = "cpu") -> tuple:
    """(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale) for one call:
    shuffled blocks, random table padding, NaN wherever no sequence has a key."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, kvh, d = case.block_size, case.kv_heads, case.head_dim
    need = [-(-n // bs) for n in case.lens]
    num_blocks = sum(need) + 5
    slots = num_blocks * bs
    if case.layout == "pool":
        kv = torch.empty(3, 2, slots, kvh, d)[1]  # layer 1 of 3: a view with an offset
    elif case.layout == "heads_major":
        kv = torch.empty(2, kvh, slots, d).transpose(1, 2)  # (2, slots, kvh, d), slots not outermost
    else:  # dim_strided: head_dim is not the contiguous axis
        kv = torch.empty(2, slots, d, kvh).transpose(2, 3)
    kv.fill_(float("nan"))
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(need) + case.pad_blocks
    tables = torch.randint(0, num_blocks, (len(case.lens), width), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(case.lens):
        tables[b, : need[b]] = order[used : used + need[b]]
        used += need[b]
        pos = torch.arange(n)
        own = tables[b, pos // bs].long() * bs + pos % bs
        kv[:, own] = torch.randn(2, n, kvh, d, generator=gen)
    q = torch.randn(len(case.lens), kvh * case.group, d, generator=gen)
    kv, q = kv.to(device, case.dtype), q.to(device, case.dtype)
    seq_lens = torch.tensor(case.lens, dtype=torch.int32, device=device)
    return q, kv[0], kv[1], tables.to(device), seq_lens, bs, d**-0.5


def naive_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale):
    """Sequence by sequence: gather its keys, repeat them over the GQA group, SDPA in fp32."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for b in range(q.shape[0]):
        pos = torch.arange(int(seq_lens[b]), device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # (H, n, D)
        v = v_cache[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None, :], k, v, scale=scale)[:, 0])
    return torch.stack(out)


TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # atol = rtol


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any(), "NaN in the output: a masked or unowned slot was read"
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --------------------------------------------------------------------------- reference (CPU)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_naive_attention(group, dtype, device):
    for case in (
        Case(group=group, dtype=dtype),
        Case(group=group, dtype=dtype, kv_heads=3, head_dim=128, block_size=8, pad_blocks=0, seed=1),
        Case(group=group, dtype=dtype, lens=(5, 1, 33), block_size=32, layout="heads_major", seed=2),
        Case(group=group, dtype=dtype, lens=(7, 100), kv_heads=1, block_size=12, layout="dim_strided", seed=3),
    ):
        args = make_args(case, device)
        got = pa.decode_attention_ref(*args)
        assert got.shape == args[0].shape and got.dtype == dtype
        assert_close(got, naive_attention(*args), dtype)


def test_reference_maps_query_head_h_to_kv_head_h_div_group():
    """V of kv head j is all j: query head h must come out as h // group (repeat_kv order)."""
    q, k, v, tables, lens, bs, scale = make_args(Case(kv_heads=4, group=3, lens=(3, 20)))
    v_heads = torch.arange(4, dtype=torch.float32)[None, :, None].expand_as(v)
    v = torch.where(v.isnan(), v, v_heads)  # keep the NaN of unowned slots
    out = pa.decode_attention_ref(q, k, v, tables, lens, bs, scale)
    want = (torch.arange(12) // 3).float()[None, :, None].expand_as(out)
    torch.testing.assert_close(out, want)


def test_decode_attention_falls_back_to_the_reference_and_fills_out():
    args = make_args(Case(group=4))
    assert not pa.triton_available(torch.device("cpu"))
    buf = torch.full_like(args[0], 7.0)
    got = pa.decode_attention(*args, out=buf, num_splits=4)
    assert got is buf
    torch.testing.assert_close(got, pa.decode_attention_ref(*args), atol=0, rtol=0)


def test_reference_is_graph_safe():
    """No op that syncs with the host or has a data-dependent shape (CUDA-graph capture)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        pa.decode_attention_ref(*make_args(Case(lens=(3, 40))))
    syncing = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "repeat_interleave"}
    assert seen and not seen & syncing, seen & syncing


# --------------------------------------------------------------------------- Triton kernel


def _kernel_device() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


KERNEL_DEVICE = _kernel_device()
needs_kernel = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA and triton (or TRITON_INTERPRET=1)")

KERNEL_CASES = [
    (Case(dtype=dtype, head_dim=d, group=g), splits)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for d in (64, 128)
    for g in (1, 2, 4)
    for splits in (1, 4)
] + [
    (Case(dtype=torch.bfloat16, lens=(1, 2, 3), group=8), 16),  # more splits than tiles: empty splits
    (Case(dtype=torch.bfloat16, lens=(64, 128, 129, 1000), kv_heads=1, group=16, head_dim=128), 3),
    (Case(dtype=torch.bfloat16, head_dim=16, kv_heads=2, group=3, block_size=8), 2),  # the test models' shape
    (Case(dtype=torch.float32, layout="heads_major", block_size=32, pad_blocks=0, group=2), 2),
    (Case(dtype=torch.bfloat16, layout="dim_strided", block_size=12, group=4, head_dim=128), 1),
]


@needs_kernel
@pytest.mark.parametrize("case, splits", [pytest.param(c, s, id=f"{c}-s{s}") for c, s in KERNEL_CASES])
def test_triton_kernel_matches_reference(case, splits):
    q, k, v, tables, lens, bs, scale = make_args(case, KERNEL_DEVICE)
    want = pa.decode_attention_ref(q, k, v, tables, lens, bs, scale)
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device).transpose(0, 1)
    got = pa._launch_triton(q, k, v, tables, lens, bs, scale, out, splits)  # a strided `out`
    assert got is out
    assert_close(got, want, case.dtype)


@pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="needs CUDA and triton")
def test_decode_attention_dispatches_to_the_kernel_on_cuda(monkeypatch):
    args = make_args(Case(dtype=torch.bfloat16, group=4), "cuda")
    want = pa.decode_attention_ref(*args)
    monkeypatch.setattr(pa, "decode_attention_ref", None)  # the CUDA path must not reach it
    for splits in (1, 2):
        assert_close(pa.decode_attention(*args, num_splits=splits), want, torch.bfloat16)


@needs_kernel
def test_self_check():
    errors = pa.self_check(torch.device(KERNEL_DEVICE))
    assert errors and all(err < (1e-4 if "float32" in name else 2e-2) for name, err in errors.items()), errors
