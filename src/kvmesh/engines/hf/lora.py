"""LoRA adapters in the hf engine's forward pass: many adapters in one batch.

Every adapter target of a Llama layer feeds one of the model's fused matmuls (``qkv``:
q, k, v; ``o``; ``gate_up``: gate, up; ``down``). For each such group and layer,
:class:`LoraBank` stacks the adapter slots side by side:

* ``A`` is ``(in, S·W)``: slot ``s`` (1..S) owns columns ``(s-1)·W .. s·W``, ``W`` being
  ``max_rank`` per projection of the group; projection ``j`` of the group takes ``r``
  of the slot's columns from ``j·max_rank`` (the rest stay zero);
* ``B`` is ``(S·W, out)``: the same rows, each projection's ``scale · B^T`` placed in
  its output columns of the fused matmul.

A pass whose rows carry adapters (``StepInputs.lora_rows``: each row's slot, 0 for the
base model) adds, after each fused matmul ``y = x W``, ``((x A) ⊙ M) B`` where the mask
``M`` keeps the columns of each row's own slot: two dense matmuls for the whole batch,
whatever mix of adapters it holds (no per-adapter batch, no per-row gather), and a row
of the base model gets exactly 0. Only the columns of the slots from the pass's lowest to
its highest (``StepInputs.lora_span``) take part, as views: a pass with one adapter
costs one slot's columns whatever ``max_loras`` is. A pass without adapters does none of
it. Every slot's weights are finite (checked on load), so masked-out columns are exact zeros.

The bank is allocated on the first adapter load (a worker that never loads one pays
nothing) and written only by the forward thread (:meth:`write`, between passes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engines.lora import AdapterFiles
from kvmesh.errors import InvalidArgument

__all__ = ["GROUPS", "LoraBank", "LoraMasks", "projection_shapes"]

# fused matmul -> its projections in output order
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_GROUP_OF = {p: g for g, parts in GROUPS.items() for p in parts}


def projection_shapes(hidden: int, q: int, kv: int, ff: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama layer."""
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, ff), "up_proj": (hidden, ff), "down_proj": (ff, hidden),
    }  # fmt: skip


@dataclass(frozen=True, slots=True)
class LoraMasks:
    """One pass's masks, per group: (T, n·W) with 1 where the column belongs to the row's
    slot, over the columns ``columns[group]`` of the slots ``lo .. hi`` the pass uses."""

    by_group: dict[str, torch.Tensor]
    columns: dict[str, slice]


class LoraBank:
    """The stacked A and B of ``slots`` adapter slots for every layer and group."""

    def __init__(
        self, num_layers: int, shapes: dict[str, tuple[int, int]], slots: int, max_rank: int,
        device: torch.device, dtype: torch.dtype,
    ) -> None:  # fmt: skip
        self.slots, self.max_rank, self.shapes = slots, max_rank, shapes
        self.device, self.dtype = device, dtype
        self.width = {g: len(parts) * max_rank for g, parts in GROUPS.items()}
        self.offsets: dict[str, int] = {}  # a projection's first output column in its group
        self.group_out: dict[str, int] = {}
        for g, parts in GROUPS.items():
            col = 0
            for p in parts:
                self.offsets[p] = col
                col += shapes[p][1]
            self.group_out[g] = col
        self.a = [{g: self._zeros(shapes[GROUPS[g][0]][0], slots * self.width[g]) for g in GROUPS} for _ in range(num_layers)]
        self.b = [{g: self._zeros(slots * self.width[g], self.group_out[g]) for g in GROUPS} for _ in range(num_layers)]
        # the slot each column belongs to, per group (1..S)
        self._col_slot = {
            g: torch.arange(slots * w, device=device) // w + 1 for g, w in self.width.items()
        }  # fmt: skip

    def _zeros(self, rows: int, cols: int) -> torch.Tensor:
        return torch.zeros(rows, cols, device=self.device, dtype=self.dtype)

    def write(self, slot: int, files: AdapterFiles, tensors: dict[str, torch.Tensor]) -> None:
        """Slot ``slot`` (1..S) holds the adapter ``files`` describes (``tensors``: its
        safetensors, by name); the projections it does not target are zero."""
        if not 1 <= slot <= self.slots:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.slots}")
        r, R = files.rank, self.max_rank
        for layer_a, layer_b in zip(self.a, self.b, strict=True):
            for g in GROUPS:
                w = self.width[g]
                layer_a[g][:, (slot - 1) * w : slot * w].zero_()
                layer_b[g][(slot - 1) * w : slot * w].zero_()
        for (layer, proj), (a_name, _, b_name, _) in files.tensors.items():
            g = _GROUP_OF[proj]
            first = (slot - 1) * self.width[g] + GROUPS[g].index(proj) * R
            out0, out1 = self.offsets[proj], self.offsets[proj] + self.shapes[proj][1]
            a = tensors[a_name].to(self.device, self.dtype)  # (r, in)
            b = tensors[b_name].to(self.device, self.dtype)  # (out, r)
            self.a[layer][g][:, first : first + r] = a.t()
            self.b[layer][g][first : first + r, out0:out1] = b.t() * files.scale

    def masks(self, rows: torch.Tensor, span: tuple[int, int]) -> LoraMasks:
        """The masks of a pass whose row ``i`` runs with slot ``rows[i]`` (0: no adapter),
        every slot it uses within ``span`` (lowest, highest)."""
        lo, hi = span
        if not 1 <= lo <= hi <= self.slots:
            raise ValueError(f"LoRA slots {lo}..{hi} are outside 1..{self.slots}")
        columns = {g: slice((lo - 1) * w, hi * w) for g, w in self.width.items()}
        by_group = {g: (cols[columns[g]] == rows[:, None]).to(self.dtype) for g, cols in self._col_slot.items()}
        return LoraMasks(by_group, columns)

    def delta(self, layer: int, group: str, x: torch.Tensor, masks: LoraMasks) -> torch.Tensor:
        """``((x A) ⊙ M) B``: what the rows' adapters add to ``group``'s output, (T, out)."""
        cols = masks.columns[group]
        xa = torch.mm(x, self.a[layer][group][:, cols])
        xa.mul_(masks.by_group[group])
        return torch.mm(xa, self.b[layer][group][cols])


def load_tensors(files: AdapterFiles) -> dict[str, torch.Tensor]:
    """The adapter's tensors (CPU), each finite; InvalidArgument otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(files.weights_file))
    except (OSError, SafetensorError) as exc:
        raise InvalidArgument(f"{files.weights_file}: cannot load the adapter weights ({exc})") from None
    for a_name, a_shape, b_name, b_shape in files.tensors.values():
        for name, shape in ((a_name, a_shape), (b_name, b_shape)):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape:
                raise InvalidArgument(f"{files.weights_file}: tensor {name!r} changed since it was checked")
            if not torch.isfinite(t).all():
                raise InvalidArgument(f"{files.weights_file}: tensor {name!r} holds NaN or infinite values")
    return tensors
