"""A Llama-family decoder over a paged KV pool, in plain PyTorch (fp32, CPU).

:class:`LlamaSpec` is what ``config.json`` says; :func:`load_weights` reads the
folder's safetensors; :class:`LlamaModel` runs one *packed* forward pass over any mix
of prefill chunks and decode tokens of many sequences:

* the pass's new tokens are packed into one row dimension ``T`` (sequence after
  sequence), so the projections and the MLP are one matmul each for the whole batch;
* each new token's K and V are written into its slot of the pool first (one
  ``index_copy_`` each), then every sequence's context slots are read back in one
  ``index_select`` and attended over, queries padded to the longest chunk of the pass
  (``q_index``) with a mask that lets query position ``p`` see key positions ``<= p``
  (none for a decode batch whose contexts are equally long, ``is_causal`` for one
  prompt from position 0: :mod:`.batch`);
* logits are computed only for the rows in ``sample_index`` (the last token of every
  sequence that samples in this pass).

Per layer that is about fifteen tensor operations (fused RMSNorm, q and k rotated
together with one ``roll`` and one ``addcmul_``, residuals added in place, cos/sin
looked up once per pass in a table), which is what a decode step of a small model
costs on the CPU.

The maths follows transformers' ``LlamaForCausalLM`` (RMSNorm in fp32, rotate-half
RoPE with ``rope_theta`` and the ``linear``/``llama3`` scalings, grouped-query
attention, SwiGLU, tied embeddings), which the tests use as the reference.
Pure computation: no asyncio, no I/O after loading.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvmesh.engines.hf.kv import KvPool
from kvmesh.engines.hf.lora import LoraBank, LoraMasks
from kvmesh.engines.hf.paged_attention import decode_attention
from kvmesh.errors import InvalidArgument

__all__ = ["LlamaSpec", "LlamaModel", "StepInputs", "DecodeRows", "PrefillSpan", "load_weights", "expected_shapes"]

_ARCHITECTURES = ("LlamaForCausalLM",)
# a GPU's prefill attention: not cuDNN's, which builds a plan per new sequence length
# (milliseconds of CPU per layer the first time a prompt length is seen)
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
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


def load_weights(
    folder: str | Path, spec: LlamaSpec, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files, read straight onto ``device``
    as ``dtype``, checked against ``spec`` (names as transformers saves them)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InvalidArgument(
            f"{folder}: no *.safetensors weights (the hf engine needs trained weights; the mocker engine needs none)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f), device=str(device)).items():
            tensors[name.removeprefix("model.")] = t.to(dtype)
    _check_shapes(tensors, spec, str(folder))
    return tensors


def expected_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
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
    for name, shape in expected_shapes(spec).items():
        t = tensors.get(name)
        if t is None:
            raise InvalidArgument(f"{where}: weight {name!r} is missing from the safetensors files")
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"{where}: weight {name!r} has shape {tuple(t.shape)}, config.json implies {shape}")
    if not spec.tie_word_embeddings and "lm_head.weight" not in tensors:
        raise InvalidArgument(f"{where}: weight 'lm_head.weight' is missing (tie_word_embeddings is false)")


# ---------------------------------------------------------------------------- forward


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The decode tokens of a paged pass (one new token per sequence, :mod:`.paged_attention`):
    the attention reads each one's context in place through its block table."""

    rows: torch.Tensor | None  # (n,) long, their rows in T; None: every row of the pass
    block_tables: torch.Tensor  # (n, max_blocks) int32
    seq_lens: torch.Tensor  # (n,) int32, keys of each (its context, the new token included)


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """A prefill chunk of a paged pass: rows ``first .. first + count`` of T."""

    first: int
    count: int
    key_slots: torch.Tensor | None  # (start + count,) long, its context's slots; None: start 0, keys are the new ones
    mask: torch.Tensor | None  # (count, start + count) bool, query i sees keys <= start + i; None with key_slots None


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One packed forward pass (see the module docstring and :mod:`.batch`). ``T`` new
    tokens, ``B`` sequences, ``Q`` the longest chunk, ``L`` the longest context.

    A *paged* pass (``paged``; the GPU's) attends per kind of chunk instead of padding
    every sequence to ``Q`` and ``L``: the decode tokens (``decode``) through the paged
    decode kernel, each prefill chunk (``prefills``) on its own; the padded fields are
    then unused."""

    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long, absolute position of each new token
    slots: torch.Tensor  # (T,) long, the pool slot (block · block_size + offset) each new token's KV goes to
    key_slots: torch.Tensor  # (B·L,) long, every sequence's context slots, padded with slot 0
    batch: int  # B
    width: int  # Q
    max_position: int  # the largest position in the pass
    q_index: torch.Tensor | None  # (B, Q) long, row in T of each sequence's i-th new token; None: rows as packed
    out_rows: torch.Tensor | None  # (T,) long, row in the flattened (B·Q) attention output; None: as packed
    mask: torch.Tensor | None  # (B, 1, Q, L) bool; None: every query sees every key (or causal)
    causal: bool  # one sequence from position 0: SDPA's own causal mask
    sample_index: torch.Tensor  # (S,) long, rows of T whose logits are wanted
    paged: bool = False
    decode: DecodeRows | None = None
    prefills: tuple[PrefillSpan, ...] = ()
    lora_rows: torch.Tensor | None = None  # (T,) long, each row's LoRA slot (0: none); None: no adapter in the pass
    lora_span: tuple[int, int] = (0, 0)  # the lowest and highest LoRA slot of the pass (with lora_rows)


@dataclass(frozen=True, slots=True)
class _Layer:
    """One layer's weights, each matrix stored transposed, (in, out) contiguous:
    ``x @ w`` with such a ``w`` is up to 2-3x faster than ``F.linear(x, w.T)`` for the
    few rows of a decode batch (MKL repacks a transposed operand on every call) and no
    slower for a long prefill."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_in: torch.Tensor
    norm_post: torch.Tensor


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for a weight stored (in, out) (the CPU's layout)."""
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


class LlamaModel:
    """The weights of one model and its packed forward pass over a :class:`KvPool`.

    On the CPU every matrix is stored (in, out) (:class:`_Layer`); on a GPU as saved,
    (out, in), which is cuBLAS's own layout for ``F.linear``. The weights' device and
    dtype are the model's."""

    def __init__(self, spec: LlamaSpec, weights: dict[str, torch.Tensor], *, transposed: bool | None = None) -> None:
        """``transposed``: store matrices (in, out); None: on the CPU only."""
        self.spec = spec
        first = weights["embed_tokens.weight"]
        self.device, self.dtype = first.device, first.dtype
        self.transposed = self.device.type == "cpu" if transposed is None else transposed
        head = weights["embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
        # the output head; a tied CPU model looks its embeddings up in its columns
        self.lm_head = self._prep(head)
        self.embed = None if spec.tie_word_embeddings and self.transposed else weights["embed_tokens.weight"]
        self.norm = weights["norm.weight"]
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.inv_freq = inv_frequencies(spec)
        self._cos, self._sin = self._rope_table(spec.max_position_embeddings)
        self.lora: LoraBank | None = None  # LoRA adapter slots (.lora), set on the first adapter load

    def _prep(self, w: torch.Tensor) -> torch.Tensor:
        return _t(w) if self.transposed else w.contiguous()

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _matmul(x, w, bias) if self.transposed else F.linear(x, w, bias)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"layers.{i}."
        a = p + "self_attn."
        biases = [b for n in "qkv" if (b := w.get(a + f"{n}_proj.bias")) is not None]
        return _Layer(
            # q, k and v (and gate, up) as one matmul each: their rows stacked
            qkv=self._prep(torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])),
            qkv_bias=torch.cat(biases) if len(biases) == 3 else None,
            o=self._prep(w[a + "o_proj.weight"]),
            o_bias=w.get(a + "o_proj.bias"),
            gate_up=self._prep(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
            down=self._prep(w[p + "mlp.down_proj.weight"]),
            norm_in=w[p + "input_layernorm.weight"],
            norm_post=w[p + "post_attention_layernorm.weight"],
        )

    @classmethod
    def from_folder(
        cls, folder: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> LlamaModel:
        spec = LlamaSpec.from_folder(folder)
        return cls(spec, load_weights(folder, spec, device=device, dtype=dtype))

    def _rope_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin (the first half negated: ``rotate_half(x) · sin`` is
        ``roll(x) · signed_sin``) of positions 0..n-1, (n, head_dim) each, computed in
        fp32 and stored in the model's dtype (as transformers applies them)."""
        freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = self.spec.head_dim // 2
        sin[:, :half].neg_()
        return emb.cos().to(self.device, self.dtype), sin.to(self.device, self.dtype)

    def _rope(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, head_dim) cos and signed sin of the pass's positions."""
        if inp.max_position >= self._cos.shape[0]:  # past the config's context: grow the table
            self._cos, self._sin = self._rope_table(2 * (inp.max_position + 1))
        return self._cos[inp.positions].unsqueeze(1), self._sin[inp.positions].unsqueeze(1)

    @torch.inference_mode()
    def forward(self, inp: StepInputs, pool: KvPool) -> torch.Tensor:
        """Write the new tokens' KV into ``pool``; return logits (S, vocab) in the model's dtype."""
        eps = self.spec.rms_norm_eps
        hidden = (self.spec.hidden_size,)
        x = self._embed(inp.input_ids)
        cos, sin = self._rope(inp)
        bank = self.lora
        masks = bank.masks(inp.lora_rows, inp.lora_span) if bank is not None and inp.lora_rows is not None else None
        for i, layer in enumerate(self.layers):
            x += self._attention(layer, i, F.rms_norm(x, hidden, layer.norm_in, eps), cos, sin, inp, pool, masks)
            x += self._mlp(layer, i, F.rms_norm(x, hidden, layer.norm_post, eps), masks)
        last = F.rms_norm(x.index_select(0, inp.sample_index), hidden, self.norm, eps)
        return self._linear(last, self.lm_head)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return F.embedding(ids, self.embed)
        return self.lm_head.index_select(1, ids).t().contiguous()  # tied on the CPU: columns of the head

    def _adapted(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, index: int, group: str, masks: LoraMasks | None
    ) -> torch.Tensor:
        """``x`` through a fused projection, plus what the rows' LoRA adapters add (.lora)."""
        y = self._linear(x, w, bias)
        if masks is not None:
            assert self.lora is not None
            y += self.lora.delta(index, group, x, masks)
        return y

    def _attention(
        self, layer: _Layer, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inp: StepInputs,
        pool: KvPool, masks: LoraMasks | None = None,
    ) -> torch.Tensor:  # fmt: skip
        s = self.spec
        heads, kv_heads, d = s.num_heads, s.num_kv_heads, s.head_dim
        nq, nqk = heads * d, (heads + kv_heads) * d
        qkv = self._adapted(x, layer.qkv, layer.qkv_bias, index, "qkv", masks)
        qk = qkv[:, :nqk].view(-1, heads + kv_heads, d)
        rotated = qk * cos  # q and k rotated together: x·cos + rotate_half(x)·sin
        rotated.addcmul_(qk.roll(d // 2, -1), sin)
        q, k = rotated[:, :heads], rotated[:, heads:]
        v = qkv[:, nqk:].view(-1, kv_heads, d)
        pool.write(index, inp.slots, k, v)
        if inp.paged:
            out = self._paged_attention(index, q, k, v, inp, pool)
            return self._adapted(out.view(-1, nq), layer.o, layer.o_bias, index, "o", masks)
        b, w = inp.batch, inp.width
        if inp.causal:  # one prompt from position 0: its keys are exactly the new ones
            keys, values = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
        else:
            keys, values = pool.read(index, inp.key_slots, b)  # (B, kv_heads, L, d)
        queries = (q.view(b, w, heads, d) if inp.q_index is None else q[inp.q_index]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=inp.mask, is_causal=inp.causal, enable_gqa=True
        )  # (B, heads, Q, d)
        packed = out.transpose(1, 2).reshape(b * w, nq)
        if inp.out_rows is not None:
            packed = packed.index_select(0, inp.out_rows)
        return self._adapted(packed, layer.o, layer.o_bias, index, "o", masks)

    def _paged_attention(
        self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inp: StepInputs, pool: KvPool
    ) -> torch.Tensor:
        """(T, heads, d): the decode rows through the paged decode kernel, each prefill
        chunk with SDPA over its own keys (no padding to a longest chunk or context)."""
        dec = inp.decode
        if dec is not None and dec.rows is None and not inp.prefills:  # a decode batch (what graphs replay)
            return self._decode(index, q, dec, pool)
        out = torch.empty_like(q)
        if dec is not None:
            assert dec.rows is not None
            out.index_copy_(0, dec.rows, self._decode(index, q.index_select(0, dec.rows), dec, pool))
        for span in inp.prefills:
            rows = slice(span.first, span.first + span.count)
            out[rows] = self._prefill(index, q[rows], k[rows], v[rows], span, pool)
        return out

    def _decode(self, index: int, q: torch.Tensor, dec: DecodeRows, pool: KvPool) -> torch.Tensor:
        kv = pool.data[index]
        splits = max(1, min(8, 256 // (q.shape[0] * self.spec.num_kv_heads)))
        return decode_attention(
            q, kv[0], kv[1], dec.block_tables, dec.seq_lens, pool.block_size, self.spec.head_dim**-0.5,
            num_splits=splits,
        )  # fmt: skip

    def _prefill(
        self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, pool: KvPool
    ) -> torch.Tensor:
        """One chunk's queries (n, heads, d) over its context: the new keys alone and SDPA's
        causal mask from position 0, else the context read from the pool and the span's mask."""
        if span.key_slots is not None:
            kv = pool.data[index].index_select(1, span.key_slots)  # (2, L, kv_heads, d)
            k, v = kv[0], kv[1]
        group = self.spec.num_heads // self.spec.num_kv_heads
        if group > 1:  # K/V per query head: SDPA's fastest kernels take no grouped heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # (1, heads, n, d): the fused kernels (flash for the causal case) take 4-d inputs only
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        with sdpa_kernel(_PREFILL_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=span.mask, is_causal=span.mask is None)
        return out[0].transpose(0, 1)

    def _mlp(self, layer: _Layer, index: int, x: torch.Tensor, masks: LoraMasks | None = None) -> torch.Tensor:
        gate_up = self._adapted(x, layer.gate_up, None, index, "gate_up", masks)
        ff = gate_up.shape[1] // 2
        act = F.silu(gate_up[:, :ff])
        act.mul_(gate_up[:, ff:])
        return self._adapted(act, layer.down, None, index, "down", masks)
