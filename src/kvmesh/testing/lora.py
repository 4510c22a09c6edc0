"""A PEFT-format LoRA adapter folder for tests and examples, written without torch or
peft: ``adapter_config.json`` and an ``adapter_model.safetensors`` of float32 tensors
named as peft saves them (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``).
The mocker loads such a folder as is; the hf engine applies its weights (zeros unless
``values`` says otherwise)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from kvmesh.engines.lora import CONFIG_FILE, TARGETS, WEIGHTS_FILE

__all__ = ["write_adapter"]

# kvmesh-tiny's projections: (in, out)
TINY_SHAPES = {
    "q_proj": (256, 256),
    "k_proj": (256, 128),
    "v_proj": (256, 128),
    "o_proj": (256, 256),
    "gate_proj": (256, 688),
    "up_proj": (256, 688),
    "down_proj": (688, 256),
}


def write_adapter(
    folder: str | Path,
    *,
    rank: int = 2,
    alpha: float = 4.0,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    layers: int = 4,
    shapes: dict[str, tuple[int, int]] | None = None,
    values: Callable[[int], float] | None = None,
) -> Path:
    """Write a PEFT LoRA folder for a model of ``layers`` layers with projection
    ``shapes`` (default: kvmesh-tiny's); ``values(i)``: the i-th float of the weights
    (default 0). Returns the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    shapes = shapes or TINY_SHAPES
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}
    (out / CONFIG_FILE).write_text(json.dumps(config))
    header: dict[str, object] = {}
    data = bytearray()
    for layer in range(layers):
        for target in targets:
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[target]}.{target}"
            for kind, shape in (("A", [rank, fan_in]), ("B", [fan_out, rank])):
                n = shape[0] * shape[1]
                floats = [values(len(data) // 4 + i) if values else 0.0 for i in range(n)]
                header[f"{prefix}.lora_{kind}.weight"] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + 4 * n]}
                data += struct.pack(f"<{n}f", *floats)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (out / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return out
