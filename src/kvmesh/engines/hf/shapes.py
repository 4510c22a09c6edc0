"""Synthetic weights in known Llama shapes (``--random-weights SHAPE``), for benchmarks on
a machine without the model files.

A step's cost depends on a model's shapes, not on its weights' values, so a randomly
initialised model in Llama-3.2-1B's or Llama-3.1-8B's shape costs what the real one does.
The values follow transformers' own initialisation (normal, std ``initializer_range``;
norms 1), drawn from a seeded generator on the target device, so the same seed gives the
same weights in any process (the GPU check hands them to transformers as well:
:func:`hf_state_dict`). Everything that uses them logs that they are synthetic: the text
they produce is noise.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmesh.engines.hf.model import LlamaSpec, expected_shapes
from kvmesh.engines.settings import RANDOM_SHAPES
from kvmesh.errors import InvalidArgument

__all__ = ["SHAPES", "shape_config", "random_weights", "hf_state_dict"]

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

# config.json values of the shapes (their public configs' architecture fields)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": _LLAMA3
    | {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": _LLAMA3_ROPE | {"factor": 32.0},
    },
    "llama-8b": _LLAMA3
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
        "rope_scaling": _LLAMA3_ROPE | {"factor": 8.0},
    },
}


assert tuple(SHAPES) == RANDOM_SHAPES, "the settings name the same shapes"


def shape_config(name: str) -> dict[str, Any]:
    """The ``config.json`` of a named shape (a copy); InvalidArgument for an unknown one."""
    try:
        return dict(SHAPES[name])
    except KeyError:
        raise InvalidArgument(f"unknown --random-weights shape {name!r}: one of {', '.join(SHAPES)}") from None


def random_weights(
    spec: LlamaSpec, *, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    std: float = 0.02,
) -> dict[str, torch.Tensor]:
    """Every weight of ``spec`` (names as :func:`~kvmesh.engines.hf.model.load_weights`
    returns them), normal(0, ``std``) matrices and unit norms, made on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    shapes = expected_shapes(spec)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    for name, shape in shapes.items():
        if len(shape) == 1:  # RMSNorm weights
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            t = torch.empty(shape, device=device, dtype=dtype)
            out[name] = t.normal_(0.0, std, generator=gen)
    return out


def hf_state_dict(spec: LlamaSpec, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` under transformers' ``LlamaForCausalLM`` names (``model.`` prefixes,
    the head), sharing storage."""
    out = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): t for n, t in weights.items()}
    if spec.tie_word_embeddings:
        out["lm_head.weight"] = weights["embed_tokens.weight"]
    return out
