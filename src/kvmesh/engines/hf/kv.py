"""The ``hf`` engine's paged KV pool: one fp32 tensor of blocks, and its wire form.

Layout: ``(num_blocks, layers, 2, kv_heads, block_size, head_dim)``; index 0 of the
third axis is K, 1 is V. Blocks are the outer axis, so one block is one contiguous
run of ``bytes_per_block`` bytes and :meth:`KvPool.export` is a gather and a copy.
The wire form of ``n`` blocks is those runs back to back, little-endian fp32, in the
order asked for.

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

    def __init__(self, num_blocks: int, block_size: int, layers: int, kv_heads: int, head_dim: int) -> None:
        if min(num_blocks, block_size, layers, kv_heads, head_dim) <= 0:
            raise ValueError("KV pool dimensions must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(num_blocks, layers, 2, kv_heads, block_size, head_dim, dtype=torch.float32)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[1:])

    @property
    def bytes_per_block(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block_for(block_size: int, layers: int, kv_heads: int, head_dim: int) -> int:
        return block_size * layers * 2 * kv_heads * head_dim * 4

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store token ``t``'s K/V (``k[t]``: (kv_heads, head_dim)) at slot ``offsets[t]`` of ``blocks[t]``."""
        self.data[blocks, layer, 0, :, offsets] = k
        self.data[blocks, layer, 1, :, offsets] = v

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every sequence's blocks, (B, kv_heads, NB·block_size, head_dim) each."""
        kv = self.data[block_table, layer]  # (B, NB, 2, kv_heads, bs, d)
        b, nb, _, h, bs, d = kv.shape
        kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, b, h, nb * bs, d)
        return kv[0], kv[1]

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
        blocks = self.data[torch.tensor(ids, dtype=torch.long)]
        return _le_bytes(blocks)

    def import_(self, block_ids: Sequence[int], data: bytes) -> None:
        """Overwrite these blocks with ``data`` from :meth:`export` of a same-layout pool."""
        ids = self.check_ids(block_ids)
        need = len(ids) * self.bytes_per_block
        if len(data) != need:
            raise InvalidArgument(f"KV import of {len(ids)} blocks needs {need} bytes, got {len(data)}")
        if not ids:
            return
        values = torch.frombuffer(bytearray(data), dtype=torch.float32)
        if sys.byteorder == "big":  # pragma: no cover - the wire is little-endian
            values = values.view(torch.uint8).view(-1, 4).flip(1).reshape(-1).view(torch.float32)
        self.data[torch.tensor(ids, dtype=torch.long)] = values.view(len(ids), *self.block_shape)


def _le_bytes(t: torch.Tensor) -> bytes:
    arr = t.contiguous().numpy()
    if sys.byteorder == "big":  # pragma: no cover
        arr = arr.byteswap()
    return arr.tobytes()
