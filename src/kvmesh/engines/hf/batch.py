"""Turning a scheduler plan into the tensors of one packed forward pass.

Runs on the event loop (cheap index arithmetic in Python, then one ``torch.tensor``
per field); the result is immutable and handed to the forward thread, which never
touches scheduler state. The common shapes need no gather or mask at all:

* every chunk of the same length ``Q`` (a decode batch: ``Q == 1``): queries are the
  packed rows as they are (``q_index`` and ``out_rows`` None);
* every sequence's context of the same length ``L`` and ``Q == 1``, or one sequence
  prefilled from position 0: no mask (``mask`` None; ``causal`` for the prefill).
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


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def make_inputs(chunks: Sequence[Chunk], block_size: int) -> StepInputs:
    """Packed inputs for ``chunks`` (at least one, each with at least one token)."""
    if not chunks or any(not c.tokens for c in chunks):
        raise ValueError("a forward pass needs at least one chunk, each with tokens")
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []  # each new token's place in the (B, L) key slot table
    sample_rows: list[int] = []
    lengths = [len(c.tokens) for c in chunks]
    ends = [c.start + n for c, n in zip(chunks, lengths, strict=True)]
    width, keys = max(lengths), max(ends)
    for b, (c, end) in enumerate(zip(chunks, ends, strict=True)):
        ids.extend(c.tokens)
        positions.extend(range(c.start, end))
        rows.extend(range(b * keys + c.start, b * keys + end))
        if c.wants_logits:
            sample_rows.append(len(ids) - 1)
    key_slots = _key_slots(chunks, block_size, keys)
    uniform = all(n == width for n in lengths)
    return StepInputs(
        input_ids=_long(ids),
        positions=_long(positions),
        slots=key_slots.index_select(0, _long(rows)),
        key_slots=key_slots,
        batch=len(chunks),
        width=width,
        max_position=keys - 1,
        q_index=None if uniform else _q_index(lengths, width),
        out_rows=None if uniform else _out_rows(lengths, width),
        mask=_mask(chunks, lengths, ends, width, keys),
        causal=len(chunks) == 1 and chunks[0].start == 0 and width > 1,
        sample_index=_long(sample_rows),
    )


def _key_slots(chunks: Sequence[Chunk], bs: int, keys: int) -> torch.Tensor:
    """(B·L,): the pool slot of every sequence's positions 0..L-1 (past a sequence's
    blocks: slots of block 0, which the mask hides), from its block table."""
    nb = -(-keys // bs)
    tables = _long([t for c in chunks for t in _padded(c.block_table, nb)]).view(len(chunks), nb, 1)
    return (tables * bs + torch.arange(bs)).view(len(chunks), nb * bs)[:, :keys].reshape(-1)


def _padded(table: Sequence[int], n: int) -> Sequence[int]:
    return table[:n] if len(table) >= n else [*table, *([0] * (n - len(table)))]


def _q_index(lengths: list[int], width: int) -> torch.Tensor:
    """(B, Q): the packed row of each sequence's i-th new token (row 0 where padded)."""
    rows, first = [], 0
    for n in lengths:
        rows.append(list(range(first, first + n)) + [0] * (width - n))
        first += n
    return _long([r for row in rows for r in row]).view(len(lengths), width)


def _out_rows(lengths: list[int], width: int) -> torch.Tensor:
    """(T,): where each packed token's output lies in the flattened (B·Q) attention output."""
    return _long([b * width + i for b, n in enumerate(lengths) for i in range(n)])


def _mask(chunks: Sequence[Chunk], lengths: list[int], ends: list[int], width: int, keys: int) -> torch.Tensor | None:
    """(B, 1, Q, L) bool: the query at position p sees key positions <= p (padding keys
    lie past every query's position); None where no query needs one."""
    if width == 1 and all(e == keys for e in ends):
        return None  # one decode token per sequence, every context as long: each sees all
    if len(chunks) == 1 and chunks[0].start == 0:
        return None  # causal from position 0: SDPA's is_causal
    q_pos = torch.zeros((len(chunks), width), dtype=torch.long)  # padding sees key 0 (discarded)
    for b, (c, n) in enumerate(zip(chunks, lengths, strict=True)):
        q_pos[b, :n] = torch.arange(c.start, c.start + n)
    return (torch.arange(keys)[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
