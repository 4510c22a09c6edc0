"""Turning a scheduler plan into the tensors of one packed forward pass.

Runs on the event loop (cheap index arithmetic in Python, then one ``torch.tensor``
per field); the result is immutable and handed to the forward thread, which never
touches scheduler state. The common shapes need no gather or mask at all:

* every chunk of the same length ``Q`` (a decode batch: ``Q == 1``): queries are the
  packed rows as they are (``q_index`` and ``out_rows`` None);
* every sequence's context of the same length ``L`` and ``Q == 1``, or one sequence
  prefilled from position 0: no mask (``mask`` None; ``causal`` for the prefill).

:func:`make_paged_inputs` builds the GPU's pass instead (``StepInputs.paged``): nothing is
padded; the one-token chunks are decode rows read through their block tables, every
longer chunk a prefill span of its own. :class:`DecodeBuffers` holds the fixed tensors a
CUDA graph replays from, and fills them for one decode batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engines.hf.model import DecodeRows, PrefillSpan, StepInputs

__all__ = ["Chunk", "make_inputs", "make_paged_inputs", "DecodeBuffers"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's share of a pass: ``tokens`` at positions ``start ..``, its whole
    ``block_table``, and whether its last token's logits are wanted."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    wants_logits: bool
    lora_slot: int = 0  # the LoRA adapter slot its rows run with (0: the base model)


def _lora(chunks: Sequence[Chunk], device: torch.device | str = "cpu") -> tuple[torch.Tensor | None, tuple[int, int]]:
    """``StepInputs``' LoRA fields: each row's slot and the pass's lowest and highest
    slot; (None, (0, 0)) when no chunk of the pass has an adapter."""
    used = [c.lora_slot for c in chunks if c.lora_slot]
    if not used:
        return None, (0, 0)
    rows = [c.lora_slot for c in chunks for _ in c.tokens]
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True), (min(used), max(used))


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
    lora_rows, lora_span = _lora(chunks)
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
        lora_rows=lora_rows,
        lora_span=lora_span,
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


# ---------------------------------------------------------------------------- paged (GPU)


def _slot(table: Sequence[int], position: int, bs: int) -> int:
    return table[position // bs] * bs + position % bs


def make_paged_inputs(chunks: Sequence[Chunk], block_size: int, device: torch.device | str = "cpu") -> StepInputs:
    """A paged pass for ``chunks`` (at least one, each with at least one token), its
    tensors on ``device``."""
    if not chunks or any(not c.tokens for c in chunks):
        raise ValueError("a forward pass needs at least one chunk, each with tokens")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    decode_rows: list[int] = []
    decode_chunks: list[Chunk] = []
    spans: list[tuple[int, Chunk]] = []
    for c in chunks:
        first, n = len(ids), len(c.tokens)
        ids.extend(c.tokens)
        positions.extend(range(c.start, c.start + n))
        slots.extend(_slot(c.block_table, p, block_size) for p in range(c.start, c.start + n))
        if n == 1:
            decode_rows.append(first)
            decode_chunks.append(c)
        else:
            spans.append((first, c))
        if c.wants_logits:
            sample_rows.append(first + n - 1)

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    lora_rows, lora_span = _lora(chunks, device)
    decode = None
    if decode_chunks:
        every = len(decode_rows) == len(ids)
        decode = DecodeRows(
            rows=None if every else dev(decode_rows),
            block_tables=_tables(decode_chunks, block_size).to(device, non_blocking=True),
            seq_lens=torch.tensor([c.start + 1 for c in decode_chunks], dtype=torch.int32).to(device, non_blocking=True),
        )
    return StepInputs(
        input_ids=dev(ids),
        positions=dev(positions),
        slots=dev(slots),
        key_slots=torch.empty(0, dtype=torch.long, device=device),
        batch=len(chunks),
        width=1,
        max_position=max(c.start + len(c.tokens) for c in chunks) - 1,
        q_index=None,
        out_rows=None,
        mask=None,
        causal=False,
        sample_index=dev(sample_rows),
        paged=True,
        decode=decode,
        prefills=tuple(_span(first, c, block_size, device) for first, c in spans),
        lora_rows=lora_rows,
        lora_span=lora_span,
    )


def _tables(chunks: Sequence[Chunk], bs: int, width: int = 0) -> torch.Tensor:
    """(n, width) int32: each chunk's blocks up to its new token, padded with block 0."""
    need = [-(-(c.start + len(c.tokens)) // bs) for c in chunks]
    width = max(width, *need)
    rows = [list(c.block_table[:n]) + [0] * (width - n) for c, n in zip(chunks, need, strict=True)]
    return torch.tensor(rows, dtype=torch.int32)


def _span(first: int, c: Chunk, bs: int, device: torch.device | str) -> PrefillSpan:
    n = len(c.tokens)
    if c.start == 0:
        return PrefillSpan(first, n, None, None)
    end = c.start + n
    key_slots = [_slot(c.block_table, p, bs) for p in range(end)]
    mask = torch.arange(end)[None, :] <= torch.arange(c.start, end)[:, None]
    return PrefillSpan(
        first, n, torch.tensor(key_slots, dtype=torch.long).to(device), mask.to(device, non_blocking=True)
    )


class DecodeBuffers:
    """The fixed input tensors of the decode graphs: room for ``max_batch`` rows of up to
    ``max_blocks`` blocks each, on ``device``. :meth:`fill` copies one decode batch in
    (rows past it are padding: token 0 at position 0, KV to the pool's scratch block,
    one key); :meth:`inputs` is the pass over the first ``batch`` rows, every tensor a
    view of the buffers, so a graph captured from it replays whatever was filled."""

    def __init__(self, max_batch: int, max_blocks: int, scratch_block: int, block_size: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.scratch, self.block_size = scratch_block, block_size
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.long, device=device)
        # the host side of all five, one pinned buffer sent in one transfer
        self._host = torch.zeros(max_batch, 4 + max_blocks, dtype=torch.long, pin_memory=device.type == "cuda")
        self._np = self._host.numpy()

    def inputs(self, batch: int) -> StepInputs:
        return StepInputs(
            input_ids=self.ids[:batch],
            positions=self.positions[:batch],
            slots=self.slots[:batch],
            key_slots=self.slots[:0],
            batch=batch,
            width=1,
            max_position=0,  # the rope table covers the context: no growth inside a graph
            q_index=None,
            out_rows=None,
            mask=None,
            causal=False,
            sample_index=self.rows[:batch],
            paged=True,
            decode=DecodeRows(None, self.tables[:batch], self.lens[:batch]),
        )

    def fits(self, chunks: Sequence[Chunk]) -> bool:
        limit = self.max_blocks * self.block_size
        return len(chunks) <= self.max_batch and all(len(c.tokens) == 1 and c.start < limit for c in chunks)

    def fill(self, chunks: Sequence[Chunk], batch: int) -> None:
        """Copy the decode ``chunks`` (one token each, ``fits``) into the first ``batch``
        rows, padding the rest. Only the table columns in use travel (the kernel reads a
        row's blocks up to its length)."""
        bs, n = self.block_size, len(chunks)
        width = max((c.start // bs + 1 for c in chunks), default=1)
        host = self._np[:batch]
        host[n:, :4] = (0, 0, self.scratch * bs, 1)  # padding rows: KV into the scratch block
        host[n:, 4 : 4 + width] = self.scratch
        for i, c in enumerate(chunks):
            need = c.start // bs + 1
            host[i, :4] = (c.tokens[0], c.start, _slot(c.block_table, c.start, bs), c.start + 1)
            host[i, 4 : 4 + need] = c.block_table[:need]
        dev = self._host[:batch, : 4 + width].to(self.ids.device, non_blocking=True)
        self.ids[:batch].copy_(dev[:, 0])
        self.positions[:batch].copy_(dev[:, 1])
        self.slots[:batch].copy_(dev[:, 2])
        self.lens[:batch].copy_(dev[:, 3])
        self.tables[:batch, :width].copy_(dev[:, 4:])
