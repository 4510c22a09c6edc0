"""The hf engine's own Llama forward against transformers' LlamaForCausalLM, on
random folders with the shapes the bundled model lacks (GQA 3:1, untied head, RoPE
scalings, attention biases), and over one packed pass mixing prefill and decode."""

from __future__ import annotations

import pytest

from kvmesh.engines.hf.batch import Chunk, make_inputs
from kvmesh.engines.hf.kv import KvPool
from kvmesh.engines.hf.model import LlamaModel, LlamaSpec
from kvmesh.errors import InvalidArgument
from tests.unit.hf.conftest import torch, transformers, write_random_llama

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip


def _reference_logits(folder, ids: list[int]) -> torch.Tensor:
    ref = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope_scaling": LLAMA3}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {"attention_bias": True},
     {"tie_word_embeddings": True}],
    ids=["plain", "llama3-rope", "linear-rope", "attention-bias", "tied-embeddings"],
)
def test_packed_pass_matches_transformers(tmp_path, overrides):
    folder = write_random_llama(tmp_path / "m", **overrides)
    model = LlamaModel.from_folder(folder)
    s = model.spec
    pool = KvPool(16, 4, s.num_layers, s.num_kv_heads, s.head_dim)
    a = [5, 9, 200, 31, 77, 1000, 4, 8, 15, 16, 23]  # 11 tokens, blocks 3, 7, 9
    b = [300, 301, 302, 303, 304]
    # pass 1: all of a but its last token, and b's first 2 tokens
    first = make_inputs([Chunk(a[:-1], 0, [3, 7, 9], True), Chunk(b[:2], 0, [11, 12], False)], 4)
    model.forward(first, pool)
    # pass 2: a's decode token (reads the cached KV) beside b's remaining prefill
    second = make_inputs([Chunk(a[-1:], 10, [3, 7, 9], True), Chunk(b[2:], 2, [11, 12], True)], 4)
    logits = model.forward(second, pool)
    assert logits.shape == (2, s.vocab_size)
    torch.testing.assert_close(logits[0], _reference_logits(folder, a)[-1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits[1], _reference_logits(folder, b)[-1], atol=2e-5, rtol=1e-4)


def test_every_pass_shape_matches_transformers(tmp_path):
    """The shapes :mod:`kvmesh.engines.hf.batch` treats specially: one prompt from 0
    (causal, no mask), a prompt continued past cached KV (mask), a decode batch with
    equally long contexts (no mask) and with unequal ones (mask, no query gather)."""
    folder = write_random_llama(tmp_path / "m")
    model = LlamaModel.from_folder(folder)
    s = model.spec
    pool = KvPool(32, 4, s.num_layers, s.num_kv_heads, s.head_dim)
    a = [7, 3, 99, 12, 5, 6, 41, 8, 2]
    b = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    ta, tb = [1, 2, 3], [4, 5, 6]

    def check(logits, *seqs):
        for row, seq in zip(logits, seqs, strict=True):
            torch.testing.assert_close(row, _reference_logits(folder, seq)[-1], atol=2e-5, rtol=1e-4)

    first = make_inputs([Chunk(a[:5], 0, ta, True)], 4)
    assert first.mask is None and first.causal and first.q_index is None
    check(model.forward(first, pool), a[:5])
    rest = make_inputs([Chunk(a[5:8], 5, ta, True)], 4)  # continues after 5 cached tokens
    assert rest.mask is not None and not rest.causal
    check(model.forward(rest, pool), a[:8])
    model.forward(make_inputs([Chunk(b[:8], 0, tb, False)], 4), pool)
    same = make_inputs([Chunk(a[8:9], 8, ta, True), Chunk(b[8:9], 8, tb, True)], 4)
    assert same.mask is None and same.q_index is None and same.out_rows is None
    check(model.forward(same, pool), a, b)
    c = [20, 21, 22]
    model.forward(make_inputs([Chunk(c[:2], 0, [9], False)], 4), pool)
    unequal = make_inputs([Chunk(c[2:], 2, [9], True), Chunk([30], 9, tb, True)], 4)
    assert unequal.mask is not None and unequal.q_index is None
    check(model.forward(unequal, pool), c, b + [30])


def test_rope_table_grows_past_the_configured_context(tmp_path):
    folder = write_random_llama(tmp_path / "m")
    model = LlamaModel.from_folder(folder)
    n = model._cos.shape[0]
    s = model.spec
    pool = KvPool(n // 4 + 4, 4, s.num_layers, s.num_kv_heads, s.head_dim)
    inp = make_inputs([Chunk([5], n + 2, list(range(n // 4 + 1)), True)], 4)
    model.forward(inp, pool)
    assert model._cos.shape[0] > n + 2
    torch.testing.assert_close(model._cos[: n], LlamaModel.from_folder(folder)._cos)


def test_spec_refuses_other_architectures():
    with pytest.raises(InvalidArgument, match="Llama-family"):
        LlamaSpec.from_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    with pytest.raises(InvalidArgument, match="rope_scaling type 'yarn'"):
        LlamaSpec.from_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(InvalidArgument, match="missing or bad value"):
        LlamaSpec.from_config({"model_type": "llama", "vocab_size": 10})


def test_missing_or_misshapen_weights_are_named(tmp_path):
    folder = write_random_llama(tmp_path / "m")
    (folder / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(InvalidArgument, match=r"no \*\.safetensors weights"):
        LlamaModel.from_folder(folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "weights.bin"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(InvalidArgument, match="'layers.1.mlp.up_proj.weight' is missing"):
        LlamaModel.from_folder(folder)


def test_kv_pool_wire_form_round_trips_and_checks_sizes():
    pool = KvPool(8, 4, 2, 2, 8)
    pool.data.normal_()
    data = pool.export([5, 1])
    assert len(data) == 2 * pool.bytes_per_block == 2 * 2 * 2 * 2 * 4 * 8 * 4
    other = KvPool(8, 4, 2, 2, 8)
    other.import_([0, 6], data)
    assert torch.equal(other.block(0), pool.block(5)) and torch.equal(other.block(6), pool.block(1))
    assert other.block(0).shape == pool.block_shape == (2, 2, 2, 4, 8)
    assert other.export([0, 6]) == data
    with pytest.raises(InvalidArgument, match="1 blocks needs 1024 bytes, got 2048"):
        other.import_([0], data)
    with pytest.raises(InvalidArgument, match="outside 0..7"):
        pool.export([8])
