"""Decode attention over the paged KV pool: a Triton kernel for CUDA and a PyTorch reference.

Layout. Per layer the pool holds ``k_cache`` and ``v_cache`` of shape
``(num_slots, kv_heads, head_dim)`` (views ``pool.data[layer, 0]`` and
``pool.data[layer, 1]``; any strides are accepted). Sequence ``b``'s key at position
``p`` lives in token slot ``block_tables[b, p // block_size] * block_size + p % block_size``.
``block_tables`` is ``(B, max_blocks)`` int32; entries past a sequence's last block
are never read for their data (any in-range value, e.g. 0, will do).

Semantics. ``q`` is ``(B, H, head_dim)``: one query token per sequence, whose own K/V
is already in the pool at position ``seq_lens[b] - 1``. The result is
``softmax(q · kᵀ · scale) · v`` over keys ``0 .. seq_lens[b] - 1`` (``seq_lens`` is
``(B,)`` int32, each ``>= 1``), accumulated in float32 and returned as ``(B, H, head_dim)``
in q's dtype (bfloat16, float16 or float32).

GQA. ``H`` is a multiple of ``kv_heads``; with ``group = H // kv_heads``, query head
``h`` reads kv head ``h // group`` (the order of transformers' ``repeat_kv``: query heads
``[j·group, (j+1)·group)`` share kv head ``j``).

Both implementations are CUDA-graph capturable: no host synchronisation, and every
shape (launch grid, scratch buffers, the reference's gathered keys) follows from the
input shapes alone, never from the values in ``seq_lens`` or ``block_tables``.

* :func:`decode_attention_ref` gathers all ``max_blocks · block_size`` slots of every
  row, masks positions ``>= seq_lens[b]`` and takes a float32 softmax.
* The Triton kernel runs one program per (sequence, kv head, split): the program loads
  the ``[group, head_dim]`` query tile of its GQA group (padded to 16 rows for
  ``tl.dot``), walks its range of key positions in tiles of ``BLOCK_N`` tokens, looks
  each token's slot up in the block table (a gather of ``head_dim``-element rows) and
  keeps an online softmax in float32 (base 2: the scale is pre-multiplied by log2 e).
  With ``num_splits > 1`` (flash decoding) the key positions are cut into
  ``num_splits`` contiguous ranges; each writes a partial (max, sum, unnormalised
  output) to float32 scratch and a second kernel combines them per head.

:func:`decode_attention` dispatches: the kernel on a CUDA tensor when triton imports,
else the reference. Triton is imported lazily (it is not a dependency), so this module
imports and type-checks on machines without it. :func:`self_check` compares the two.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple, no_type_check

import torch

__all__ = ["decode_attention", "decode_attention_ref", "triton_available", "self_check"]

BLOCK_N = 64  # keys per inner-loop tile of the kernel
NUM_WARPS = 4

# triton.language, bound by _kernels() before the kernels are compiled: Triton resolves
# `tl` in the kernels' source through this module's globals. The kernels are
# @no_type_check: they are Triton code, not Python that mypy could follow.
tl: Any = None


# --------------------------------------------------------------------------- reference


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """The semantics in plain PyTorch (CPU or GPU; CUDA-graph capturable)."""
    batch, heads, head_dim = q.shape
    kv_heads = _check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    group = heads // kv_heads
    width = block_tables.shape[1] * block_size
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables.long()[:, :, None] * block_size + offsets).reshape(batch, width)
    masked = torch.arange(width, device=q.device)[None, :] >= seq_lens.long()[:, None]  # (B, width)
    k = k_cache[slots].float()  # (B, width, kv_heads, D)
    v = v_cache[slots].float().masked_fill(masked[:, :, None, None], 0.0)  # unused slots may hold NaN
    qg = q.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bjgd,bljd->bjgl", qg, k) * scale
    scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
    out = torch.einsum("bjgl,bljd->bjgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(batch, heads, head_dim).to(q.dtype)


def _check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:
    """Validate the arguments' shapes and dtypes (static checks only); return kv_heads."""
    assert q.dim() == 3 and k_cache.dim() == 3, "q: (B, H, D); caches: (slots, kv_heads, D)"
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape"
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    assert k_cache.shape[2] == head_dim, f"head_dim mismatch: q {head_dim}, cache {k_cache.shape[2]}"
    assert heads % kv_heads == 0, f"{heads} query heads are not a multiple of {kv_heads} kv heads"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.dtype == torch.int32
    assert seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32
    return kv_heads


# --------------------------------------------------------------------------- dispatch


def triton_available(device: torch.device) -> bool:
    """True when ``device`` is a CUDA device and triton imports."""
    return device.type == "cuda" and _triton() is not None


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    """Decode attention (see the module docstring): the Triton kernel on CUDA when triton
    imports, else :func:`decode_attention_ref`. ``out`` (B, H, D) in q's dtype receives the
    result when given; ``num_splits`` is the kernel's split-K factor (the reference ignores it)."""
    assert num_splits >= 1, "num_splits must be positive"
    if triton_available(q.device):
        with torch.cuda.device(q.device):
            return _launch_triton(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out, num_splits)
    result = decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale)
    return result if out is None else out.copy_(result)


# --------------------------------------------------------------------------- triton


class _Kernels(NamedTuple):
    decode: Any
    combine: Any


@functools.cache
def _triton() -> Any:
    """The triton module, or None when it does not import."""
    try:
        return importlib.import_module("triton")
    except ImportError:
        return None


@functools.cache
def _kernels() -> _Kernels:
    """Compile-ready (jitted) kernels; imports triton on first use."""
    triton = _triton()
    if triton is None:
        raise RuntimeError("triton is not installed")
    global tl
    tl = importlib.import_module("triton.language")
    return _Kernels(decode=triton.jit(_decode_kernel), combine=triton.jit(_combine_kernel))


def _launch_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None,
    num_splits: int,
) -> torch.Tensor:
    """Launch the kernel(s) on the current device. Every decision here depends on shapes
    only (graph-safe); under TRITON_INTERPRET=1 it also runs on CPU tensors."""
    batch, heads, head_dim = q.shape
    kv_heads = _check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    group = heads // kv_heads
    assert 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two in [16, 256]"
    assert num_splits >= 1 and block_size >= 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype
    if num_splits > 1:
        part_m = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    else:  # unused by the single-split kernel
        part_m = part_l = part_acc = out
    kernels = _kernels()
    kernels.decode[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_m, part_l, part_acc,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        block_tables.shape[1],
        GROUP=group,
        GROUP_PAD=max(16, _next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # "tf32" is moot for 16-bit inputs
        num_warps=NUM_WARPS,
    )
    if num_splits > 1:
        kernels.combine[(batch, heads)](
            part_m, part_l, part_acc, out,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=_next_power_of_2(num_splits),
            num_warps=NUM_WARPS,
        )
    return out


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@no_type_check
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    max_blocks,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (sequence, kv head, split): all GROUP query heads of the kv head at once."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, GROUP_PAD)  # query heads kvh·GROUP + rows (rows < GROUP are real)
    dims = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )

    # this split's key positions [lo, hi): whole tiles, the last split takes the rest
    n_keys = tl.minimum(tl.load(lens_ptr + b), max_blocks * BLOCK_SIZE)
    tiles_per_split = tl.cdiv(tl.cdiv(n_keys, BLOCK_N), NUM_SPLITS)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, n_keys)

    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)  # running unnormalised output
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        block = tl.load(bt_ptr + b * stride_btb + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(
            k_head + slot[:, None] * stride_ks + dims[None, :] * stride_kd, mask=valid[:, None], other=0.0
        )  # [BLOCK_N, HEAD_DIM]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + slot[:, None] * stride_vs + dims[None, :] * stride_vd, mask=valid[:, None], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:  # partials at [b, head, split] of contiguous (B, H, NUM_SPLITS[, HEAD_DIM]) scratch
        part = (b * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])


@no_type_check
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One (sequence, query head): merge the splits' partial softmaxes. Empty splits
    carry max -inf and weigh 0; split 0 is never empty (seq_lens >= 1)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    ok = splits < NUM_SPLITS
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + splits
    m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=ok, other=0.0)  # noqa: E741
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # [SPLITS_PAD]
    o = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims * stride_od, o.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------- self check


def self_check(device: torch.device, seed: int = 0) -> dict[str, float]:
    """Max abs error of the Triton kernel against the reference on random paged batches
    (bfloat16 and float32, head_dim 64 and 128, GQA groups 1, 2, 4 and 8, num_splits 1 and 4),
    one entry per case; on CUDA also ``graph/...`` entries: kernel and reference captured
    in a CUDA graph, replayed after the lengths and block tables changed in place.
    bfloat16 errors are expected below ~2e-2, float32 below ~1e-4.

    Needs triton; on a CPU device only under TRITON_INTERPRET=1."""
    if _triton() is None:
        raise RuntimeError("self_check needs triton")
    gen = torch.Generator().manual_seed(seed)
    errors: dict[str, float] = {}
    cases = [(torch.bfloat16, 128, 8, 4), (torch.bfloat16, 64, 2, 2), (torch.bfloat16, 128, 4, 1), (torch.float32, 64, 1, 8)]
    lens = [1, 16, 37, 300, 1000]  # one key, a block boundary, off a boundary, long
    for dtype, head_dim, kv_heads, group in cases:
        args = _random_batch(gen, device, dtype, head_dim, kv_heads, group, block_size=16, lens=lens)
        ref = decode_attention_ref(*args)
        for splits in (1, 4):
            got = _launch_triton(*args, None, splits)
            name = f"{str(dtype).removeprefix('torch.')}/d{head_dim}/kv{kv_heads}/g{group}/splits{splits}"
            errors[name] = (got.float() - ref.float()).abs().max().item()
    if device.type == "cuda":
        errors.update(_graph_check(gen, device))
    return errors


def _random_batch(
    gen: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    kv_heads: int,
    group: int,
    block_size: int,
    lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
    """Arguments for one call: a 2-layer pool (layer 1 used), shuffled block tables padded
    with 0, and NaN in every slot no sequence owns."""
    need = [-(-n // block_size) for n in lens]
    max_blocks, num_blocks = max(need) + 1, sum(need) + 3
    slots = num_blocks * block_size
    pool = torch.full((2, 2, slots, kv_heads, head_dim), float("nan"))
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used : used + n].to(torch.int32)
        used += n
        owned = (tables[b, :n].long()[:, None] * block_size + torch.arange(block_size)).flatten()
        pool[1, :, owned] = torch.randn(2, owned.numel(), kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    pool, q = pool.to(device, dtype), q.to(device, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, pool[1, 0], pool[1, 1], tables.to(device), seq_lens, block_size, head_dim**-0.5


def _graph_check(gen: torch.Generator, device: torch.device) -> dict[str, float]:
    """Capture kernel (2 splits) and reference in one CUDA graph, change the lengths and
    tables in place, replay, and compare with fresh eager results."""
    q, k, v, tables, lens, block_size, scale = _random_batch(
        gen, device, torch.bfloat16, 128, 2, 4, block_size=16, lens=[5, 40, 200]
    )
    for splits in (1, 2):  # compile and warm up outside the capture
        _launch_triton(q, k, v, tables, lens, block_size, scale, None, splits)
    decode_attention_ref(q, k, v, tables, lens, block_size, scale)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on its own side stream
        got1 = _launch_triton(q, k, v, tables, lens, block_size, scale, None, 1)
        got2 = _launch_triton(q, k, v, tables, lens, block_size, scale, None, 2)
        ref = decode_attention_ref(q, k, v, tables, lens, block_size, scale)
    lens.copy_(torch.tensor([200, 3, 33], dtype=torch.int32))
    tables.copy_(tables.roll(1, 0))  # sequence b now reads what sequence b-1 owned
    graph.replay()
    torch.cuda.synchronize(device)
    want = decode_attention_ref(q, k, v, tables, lens, block_size, scale).float()
    return {
        "graph/kernel_splits1": (got1.float() - want).abs().max().item(),
        "graph/kernel_splits2": (got2.float() - want).abs().max().item(),
        "graph/ref": (ref.float() - want).abs().max().item(),
    }
