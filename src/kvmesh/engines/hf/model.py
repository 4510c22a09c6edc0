"""A Llama-family decoder over a paged KV pool, in plain PyTorch (fp32, CPU).

:class:`LlamaSpec` is what ``config.json`` says; :func:`load_weights` reads the
folder's safetensors; :class:`LlamaModel` runs one *packed* forward pass over any mix
of prefill chunks and decode tokens of many sequences:

* the pass's new tokens are packed into one row dimension ``T`` (sequence after
  sequence), so the projections and the MLP are one matmul each for the whole batch;
* each new token's K and V are written into its slot of the pool first, then every
  sequence gathers its blocks (``block_table``) and attends over them, its queries
  padded to the longest chunk of the pass (``q_index``/``q_valid``), with a mask that
  lets query position ``p`` see key positions ``<= p``;
* logits are computed only for the rows in ``sample_index`` (the last token of every
  sequence that samples in this pass).

The maths follows transformers' ``LlamaForCausalLM`` (RMSNorm in fp32, rotate-half
RoPE with ``rope_theta`` and the ``linear``/``llama3`` scalings, grouped-query
attention, SwiGLU, tied embeddings), which the tests use as the reference.
Pure computation: no asyncio, no I/O after loading.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvmesh.engines.hf.kv import KvPool
from kvmesh.errors import InvalidArgument

__all__ = ["LlamaSpec", "LlamaModel", "StepInputs", "load_weights"]

_ARCHITECTURES = ("LlamaForCausalLM",)
_MODEL_TYPES = ("llama",)


@dataclass(frozen=True, slots=True)
class LlamaSpec:
    """The shape of a Llama-family model, from its ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> LlamaSpec:
        path = Path(folder) / "config.json"
        try:
            cfg = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{path}: cannot read the model config ({exc})") from None
        return cls.from_config(cfg, str(path))

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str = "config.json") -> LlamaSpec:
        arch = cfg.get("architectures") or []
        if cfg.get("model_type") not in _MODEL_TYPES and not set(arch) & set(_ARCHITECTURES):
            raise InvalidArgument(
                f"{where}: the hf engine runs Llama-family models (model_type 'llama'), "
                f"got model_type {cfg.get('model_type')!r}, architectures {arch}"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or {}
            spec = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"{where}: missing or bad value for {exc}") from None
        spec.validate(where)
        return spec

    def validate(self, where: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(f"{where}: {self.num_heads} heads do not divide into {self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise InvalidArgument(f"{where}: head_dim must be even for rotary embeddings, got {self.head_dim}")
        kind = _rope_type(self.rope_scaling)
        if kind not in ("default", "linear", "llama3"):
            raise InvalidArgument(f"{where}: rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def _rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def inv_frequencies(spec: LlamaSpec) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim / 2,), with the config's scaling applied."""
    dim = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling or {}
    kind = _rope_type(spec.rope_scaling)
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_frequencies(inv, scaling)
    return inv


def _llama3_frequencies(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept,
    a linear blend between ``low_freq_factor`` and ``high_freq_factor``."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    blend = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


# ---------------------------------------------------------------------------- weights


def load_weights(folder: str | Path, spec: LlamaSpec) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files, as fp32, checked against
    ``spec`` (names as transformers saves them)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InvalidArgument(
            f"{folder}: no *.safetensors weights (the hf engine needs trained weights; the mocker engine needs none)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            tensors[name.removeprefix("model.")] = t.to(torch.float32)
    _check_shapes(tensors, spec, str(folder))
    return tensors


def _expected_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    q, ff = spec.num_heads * spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, h), "norm.weight": (h,)}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def _check_shapes(tensors: dict[str, torch.Tensor], spec: LlamaSpec, where: str) -> None:
    for name, shape in _expected_shapes(spec).items():
        t = tensors.get(name)
        if t is None:
            raise InvalidArgument(f"{where}: weight {name!r} is missing from the safetensors files")
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"{where}: weight {name!r} has shape {tuple(t.shape)}, config.json implies {shape}")
    if not spec.tie_word_embeddings and "lm_head.weight" not in tensors:
        raise InvalidArgument(f"{where}: weight 'lm_head.weight' is missing (tie_word_embeddings is false)")


# ---------------------------------------------------------------------------- forward


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One packed forward pass (see the module docstring). ``T`` new tokens, ``B``
    sequences, ``Q`` the longest chunk, ``NB`` the longest block table."""

    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long, absolute position of each new token
    slot_blocks: torch.Tensor  # (T,) long, the block each new token's KV goes to
    slot_offsets: torch.Tensor  # (T,) long, its offset in that block
    q_index: torch.Tensor  # (B, Q) long, row in T of each sequence's i-th new token (0 where padded)
    q_valid: torch.Tensor  # (B, Q) bool
    q_positions: torch.Tensor  # (B, Q) long, absolute positions (0 where padded)
    block_table: torch.Tensor  # (B, NB) long, padded with block 0 (masked out)
    sample_index: torch.Tensor  # (S,) long, rows of T whose logits are wanted


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_in: torch.Tensor
    norm_post: torch.Tensor


class LlamaModel:
    """The weights of one model and its packed forward pass over a :class:`KvPool`."""

    def __init__(self, spec: LlamaSpec, weights: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self.embed = weights["embed_tokens.weight"]
        self.lm_head = self.embed if spec.tie_word_embeddings else weights["lm_head.weight"]
        self.norm = weights["norm.weight"]
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.inv_freq = inv_frequencies(spec)

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"layers.{i}."
        a = p + "self_attn."
        biases = [b for n in "qkv" if (b := w.get(a + f"{n}_proj.bias")) is not None]
        return _Layer(
            # q, k and v (and gate, up) as one matmul each: their rows stacked
            qkv=torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
            qkv_bias=torch.cat(biases) if len(biases) == 3 else None,
            o=w[a + "o_proj.weight"],
            o_bias=w.get(a + "o_proj.bias"),
            gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            down=w[p + "mlp.down_proj.weight"],
            norm_in=w[p + "input_layernorm.weight"],
            norm_post=w[p + "post_attention_layernorm.weight"],
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> LlamaModel:
        spec = LlamaSpec.from_folder(folder)
        return cls(spec, load_weights(folder, spec))

    @torch.inference_mode()
    def forward(self, inp: StepInputs, pool: KvPool) -> torch.Tensor:
        """Write the new tokens' KV into ``pool``; return logits (S, vocab) fp32."""
        x = F.embedding(inp.input_ids, self.embed)
        cos, sin = self._rope(inp.positions)
        mask = _attention_mask(inp, pool.block_size)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, i, _rms_norm(x, layer.norm_in, self.spec.rms_norm_eps), cos, sin, inp, mask, pool)
            x = x + self._mlp(layer, _rms_norm(x, layer.norm_post, self.spec.rms_norm_eps))
        last = _rms_norm(x[inp.sample_index], self.norm, self.spec.rms_norm_eps)
        return F.linear(last, self.lm_head)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def _attention(
        self,
        layer: _Layer,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        inp: StepInputs,
        mask: torch.Tensor,
        pool: KvPool,
    ) -> torch.Tensor:
        s = self.spec
        nq, nkv, d = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.head_dim
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        q = _rotate(qkv[:, :nq].view(-1, s.num_heads, d), cos, sin)
        k = _rotate(qkv[:, nq : nq + nkv].view(-1, s.num_kv_heads, d), cos, sin)
        v = qkv[:, nq + nkv :].view(-1, s.num_kv_heads, d)
        pool.write(index, inp.slot_blocks, inp.slot_offsets, k, v)
        keys, values = pool.gather(index, inp.block_table)  # (B, kv_heads, NB·bs, d)
        queries = q[inp.q_index].transpose(1, 2)  # (B, heads, Q, d)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
        packed = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], nq)[inp.q_valid]
        return F.linear(packed, layer.o, layer.o_bias)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention_mask(inp: StepInputs, block_size: int) -> torch.Tensor:
    """(B, 1, Q, NB·bs) bool: query at position p sees key positions <= p. Keys past a
    sequence's context (padding blocks, unwritten slots) are always beyond p."""
    keys = torch.arange(inp.block_table.shape[1] * block_size)
    return (keys[None, None, :] <= inp.q_positions[:, :, None]).unsqueeze(1)
