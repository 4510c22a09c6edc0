"""Turning a scheduler plan into the tensors of one packed forward pass.

Runs on the event loop (cheap index arithmetic); the result is immutable and handed
to the forward thread, which never touches scheduler state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engines.hf.model import StepInputs

__all__ = ["Chunk", "make_inputs"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's share of a pass: ``tokens`` at positions ``start ..``, its whole
    ``block_table``, and whether its last token's logits are wanted."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    wants_logits: bool


def make_inputs(chunks: Sequence[Chunk], block_size: int) -> StepInputs:
    """Packed inputs for ``chunks`` (at least one, each with at least one token)."""
    if not chunks or any(not c.tokens for c in chunks):
        raise ValueError("a forward pass needs at least one chunk, each with tokens")
    ids: list[int] = []
    positions: list[int] = []
    q_rows: list[list[int]] = []
    sample_rows: list[int] = []
    for c in chunks:
        first = len(ids)
        ids.extend(c.tokens)
        positions.extend(range(c.start, c.start + len(c.tokens)))
        q_rows.append(list(range(first, len(ids))))
        if c.wants_logits:
            sample_rows.append(len(ids) - 1)
    width = max(len(r) for r in q_rows)
    nb = max(len(c.block_table) for c in chunks)
    pos = torch.tensor(positions, dtype=torch.long)
    tables = torch.tensor([list(c.block_table) + [0] * (nb - len(c.block_table)) for c in chunks], dtype=torch.long)
    seq_of_row = torch.tensor([i for i, r in enumerate(q_rows) for _ in r], dtype=torch.long)
    q_index = torch.tensor([r + [0] * (width - len(r)) for r in q_rows], dtype=torch.long)
    q_valid = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in q_rows], dtype=torch.bool)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=pos,
        slot_blocks=tables[seq_of_row, pos // block_size],
        slot_offsets=pos % block_size,
        q_index=q_index,
        q_valid=q_valid,
        q_positions=torch.where(q_valid, pos[q_index], 0),
        block_table=tables,
        sample_index=torch.tensor(sample_rows, dtype=torch.long),
    )
