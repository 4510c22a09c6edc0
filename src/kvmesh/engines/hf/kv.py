"""The ``hf`` engine's paged KV pool: one tensor of token slots on the model's device, in
the model's dtype, and its wire form.

Storage: ``(layers, 2, (num_blocks + 1) · block_size, kv_heads, head_dim)``; index 0 of the
second axis is K, 1 is V, and token slot ``block · block_size + offset`` is one row.
Per layer, writing a pass's new tokens is one ``index_copy_`` for K and one for V, and
reading every sequence's context is one ``index_select`` of its slots (no block
gather followed by a permuting copy), which the attention reads as a strided view; the
GPU's decode attention reads the slots in place through block tables
(:mod:`.paged_attention`). The block past the last one (:attr:`KvPool.scratch_block`)
belongs to nobody: the padding rows of a CUDA graph's batch write their KV there.

The wire form is block-major: one block is ``(layers, 2, kv_heads, block_size,
head_dim)`` little-endian values of the pool's dtype (:attr:`KvPool.block_shape`,
:attr:`KvPool.dtype_name`), ``bytes_per_block`` bytes,
and ``n`` blocks are those runs back to back in the order asked for;
:meth:`KvPool.export` and :meth:`KvPool.import_` permute between the two.

KV tiers below the pool (host memory, disk) are :mod:`.tiers`'s: it copies whole blocks
through :meth:`KvPool.block_view`.

Which blocks belong to whom is the block manager's business
(:class:`~kvmesh.engines.batching.block_manager.BlockManager`); the pool only stores.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from kvmesh.errors import InvalidArgument

__all__ = ["KvPool"]


class KvPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens for every layer."""

    def __init__(
        self, num_blocks: int, block_size: int, layers: int, kv_heads: int, head_dim: int, *,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        if min(num_blocks, block_size, layers, kv_heads, head_dim) <= 0:
            raise ValueError("KV pool dimensions must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = (num_blocks + 1) * block_size  # + the scratch block
        self.data = torch.zeros(layers, 2, slots, kv_heads, head_dim, dtype=dtype, device=device)

    @property
    def scratch_block(self) -> int:
        """The block no sequence owns (graph padding writes there)."""
        return self.num_blocks

    @property
    def dtype_name(self) -> str:
        return str(self.data.dtype).removeprefix("torch.")

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block on the wire: (layers, 2, kv_heads, block_size, head_dim)."""
        layers, _, _, kv_heads, head_dim = self.data.shape
        return (layers, 2, kv_heads, self.block_size, head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.data[:, :, : self.block_size].numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block_for(block_size: int, layers: int, kv_heads: int, head_dim: int, item_bytes: int = 4) -> int:
        return block_size * layers * 2 * kv_heads * head_dim * item_bytes

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store token ``t``'s K/V (``k[t]``: (kv_heads, head_dim)) at token slot ``slots[t]``."""
        kv = self.data[layer]
        kv[0].index_copy_(0, slots, k)
        kv[1].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (``batch`` sequences' slots back to back, ``L`` each), as
        (batch, kv_heads, L, head_dim) strided views of one gathered copy."""
        kv = self.data[layer].index_select(1, slots)  # (2, batch·L, kv_heads, d)
        _, n, h, d = kv.shape
        kv = kv.view(2, batch, n // batch, h, d).transpose(2, 3)
        return kv[0], kv[1]

    def _blocks(self) -> torch.Tensor:
        """The storage as (layers, 2, num_blocks, block_size, kv_heads, head_dim) (a view)."""
        layers, _, _, h, d = self.data.shape
        return self.data.view(layers, 2, self.num_blocks + 1, self.block_size, h, d)

    def block_view(self, block_id: int) -> torch.Tensor:
        """One block's storage, (layers, 2, block_size, kv_heads, head_dim), as a view
        (what a KV tier slot holds: :mod:`.tiers` copies it out and back in)."""
        return self._blocks()[:, :, block_id]

    def block(self, block_id: int) -> torch.Tensor:
        """One block in its wire layout (a copy)."""
        return self._blocks()[:, :, block_id].transpose(2, 3).contiguous()

    def check_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = list(block_ids)
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidArgument(f"KV block ids {bad[:4]} are outside 0..{self.num_blocks - 1}")
        return ids

    def export(self, block_ids: Sequence[int]) -> bytes:
        """These blocks' KV, ``bytes_per_block`` each, in order."""
        ids = self.check_ids(block_ids)
        if not ids:
            return b""
        index = torch.tensor(ids, dtype=torch.long, device=self.data.device)
        blocks = self._blocks()[:, :, index]  # (layers, 2, n, bs, h, d)
        return _le_bytes(blocks.permute(2, 0, 1, 4, 3, 5))

    def import_(self, block_ids: Sequence[int], data: bytes) -> None:
        """Overwrite these blocks with ``data`` from :meth:`export` of a same-layout pool."""
        ids = self.check_ids(block_ids)
        need = len(ids) * self.bytes_per_block
        if len(data) != need:
            raise InvalidArgument(f"KV import of {len(ids)} blocks needs {need} bytes, got {len(data)}")
        if not ids:
            return
        dtype, size = self.data.dtype, self.data.element_size()
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if sys.byteorder == "big":  # pragma: no cover - the wire is little-endian
            raw = raw.view(-1, size).flip(1).reshape(-1)
        wire = raw.to(self.data.device).view(dtype).view(len(ids), *self.block_shape)  # (n, layers, 2, h, bs, d)
        index = torch.tensor(ids, dtype=torch.long, device=self.data.device)
        self._blocks()[:, :, index] = wire.permute(1, 2, 0, 4, 3, 5)


def _le_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as little-endian bytes (any dtype: numpy has no bfloat16, so
    the bytes are read as bytes), copied to the host once."""
    raw = t.contiguous().view(torch.uint8).cpu().numpy()
    if sys.byteorder == "big":  # pragma: no cover
        raw = raw.reshape(-1, t.element_size())[:, ::-1]
    return raw.tobytes()
