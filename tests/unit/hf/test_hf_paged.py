"""The GPU's pass shapes, run on the CPU: paged passes (decode rows through the paged
decode attention's reference, prefill chunks each on their own), the decode graphs'
fixed buffers with padding rows, the pool in 16-bit dtypes, synthetic weights in Llama
shapes, and the device options. The CUDA-only parts (the Triton kernel, graph capture)
are compared with these references by bench/gpu.py on a GPU."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.engines.hf import HfEngine, HfOptions
from kvmesh.engines.hf.batch import Chunk, DecodeBuffers, make_inputs, make_paged_inputs
from kvmesh.engines.hf.device import graph_buckets, kv_budget, resolve_device, resolve_dtype
from kvmesh.engines.hf.kv import KvPool
from kvmesh.engines.hf.model import LlamaModel, LlamaSpec
from kvmesh.errors import InvalidArgument
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.testing import mock_context
from tests.unit.hf.conftest import torch, transformers, write_random_llama

A = [5, 9, 200, 31, 77, 1000, 4, 8, 15, 16, 23]
B = [300, 301, 302, 303, 304, 305, 306]
C = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("m") / "m")


def _pool(model: LlamaModel, blocks: int = 32) -> KvPool:
    s = model.spec
    return KvPool(blocks, 4, s.num_layers, s.num_kv_heads, s.head_dim, dtype=model.dtype)


def _passes(make):
    """Three passes: two prefills from 0; then A's decode token, B's prefill continued past
    its cached part and C's prompt from 0 together; then a decode batch of all three."""
    ta, tb, tc = [3, 7, 9], [11, 12], [20, 21]
    return [
        make([Chunk(A[:-1], 0, ta, True), Chunk(B[:3], 0, tb, False)]),
        make([Chunk(A[-1:], 10, ta, True), Chunk(B[3:], 3, tb, True), Chunk(C, 0, tc, True)]),
        make([Chunk([17], 11, ta, True), Chunk([18], 7, tb, True), Chunk([19], 6, tc, True)]),
    ]


@pytest.mark.parametrize("transposed", [True, False], ids=["cpu-layout", "gpu-layout"])
def test_paged_passes_equal_packed_ones(folder, transposed):
    model = LlamaModel.from_folder(folder)
    other = LlamaModel(model.spec, _weights(folder), transposed=transposed)
    packed_pool, paged_pool = _pool(model), _pool(other)
    packed = [model.forward(i, packed_pool) for i in _passes(lambda c: make_inputs(c, 4))]
    paged_inputs = _passes(lambda c: make_paged_inputs(c, 4))
    assert paged_inputs[1].decode is not None and paged_inputs[1].decode.rows is not None
    assert [s.key_slots is None for s in paged_inputs[1].prefills] == [False, True]
    assert paged_inputs[2].decode is not None and paged_inputs[2].decode.rows is None and not paged_inputs[2].prefills
    paged = [other.forward(i, paged_pool) for i in paged_inputs]
    for x, y in zip(packed, paged, strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(packed_pool.data, paged_pool.data, atol=1e-5, rtol=1e-5)


def _weights(folder):
    from kvmesh.engines.hf.model import load_weights

    return load_weights(folder, LlamaSpec.from_folder(folder))


def test_decode_buffers_replay_a_batch_with_padding_rows(folder):
    """What a graph replays: a decode batch of 3 copied into buffers of 8 rows, run as the
    bucket of 4 (one padding row). Same logits as an ordinary pass; the padding row's KV
    lands in the scratch block and nowhere else."""
    model = LlamaModel.from_folder(folder)
    eager_pool, graph_pool = _pool(model), _pool(model)
    first, second, decode = _passes(lambda c: make_paged_inputs(c, 4))
    for pool in (eager_pool, graph_pool):
        model.forward(first, pool)
        model.forward(second, pool)
    want = model.forward(decode, eager_pool)
    buffers = DecodeBuffers(8, 6, graph_pool.scratch_block, 4, torch.device("cpu"))
    chunks = [Chunk([17], 11, [3, 7, 9], True), Chunk([18], 7, [11, 12], True), Chunk([19], 6, [20, 21], True)]
    assert buffers.fits(chunks)
    buffers.fill(chunks, 4)
    got = model.forward(buffers.inputs(4), graph_pool)[:3]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    real = graph_pool.num_blocks * 4
    torch.testing.assert_close(graph_pool.data[:, :, :real], eager_pool.data[:, :, :real])
    assert graph_pool.data[:, :, real:].abs().sum() > 0  # the padding row wrote its KV there
    assert not buffers.fits([Chunk([1], 6 * 4, [0] * 7, True)])  # a context past the buffers' blocks
    assert not buffers.fits([Chunk([1, 2], 0, [0], True)])  # not a decode chunk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pool_round_trips_16_bit_blocks_and_hides_the_scratch_block(dtype):
    pool = KvPool(4, 2, 3, 2, 8, dtype=dtype)
    pool.data.normal_()
    assert pool.dtype_name == str(dtype).removeprefix("torch.")
    assert pool.bytes_per_block == 3 * 2 * 2 * 2 * 8 * 2 == KvPool.bytes_per_block_for(2, 3, 2, 8, 2)
    wire = pool.export([2, 0])
    other = KvPool(4, 2, 3, 2, 8, dtype=dtype)
    other.import_([1, 3], wire)
    torch.testing.assert_close(other.block(1), pool.block(2), atol=0, rtol=0)
    torch.testing.assert_close(other.block(3), pool.block(0), atol=0, rtol=0)
    with pytest.raises(InvalidArgument):
        pool.export([pool.scratch_block])


def test_synthetic_weights_are_seeded_and_load_into_transformers():
    from kvmesh.engines.hf.shapes import hf_state_dict, random_weights, shape_config

    cfg = shape_config("llama-8b") | {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                      "vocab_size": 300}  # fmt: skip
    spec = LlamaSpec.from_config(cfg)
    w = random_weights(spec, seed=3)
    assert all(torch.equal(w[n], t) for n, t in random_weights(spec, seed=3).items())
    assert not torch.equal(w["layers.0.mlp.up_proj.weight"], random_weights(spec, seed=4)["layers.0.mlp.up_proj.weight"])
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    ref.load_state_dict(hf_state_dict(spec, w), strict=True)
    ours = LlamaModel(spec, w)
    ids = [1, 50, 7, 299, 3]
    logits = ours.forward(make_inputs([Chunk(ids, 0, [0, 1], True)], 4), KvPool(4, 4, 2, 2, 16))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidArgument, match="llama-1b"):
        shape_config("llama-70b")


def test_device_and_dtype_resolution(tmp_path):
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(InvalidArgument, match="no CUDA GPU"):
            resolve_device("cuda")
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) is torch.float16
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    assert resolve_dtype("auto", cuda, tmp_path) is torch.float16
    (tmp_path / "config.json").write_text('{"torch_dtype": "float32"}')
    assert resolve_dtype("auto", cuda, tmp_path) is torch.bfloat16
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256]
    assert graph_buckets(6) == [1, 2, 4, 6]


def _request(ids, rid, max_tokens=12):
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=list(ids), sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )  # fmt: skip


async def _tokens(engine, request):
    return [t async for c in engine.generate(request, mock_context(request.request_id)) for t in c.token_ids]


async def test_the_engine_gives_the_same_tokens_through_paged_passes(folder):
    """The engine's GPU wiring (paged passes) on the CPU: the same greedy tokens as its
    packed passes, with requests batched together and a shared prefix cached."""
    prompts = [A, A[:6] + B, C + A]

    async def run(paged: bool) -> list[list[int]]:
        eng = HfEngine(HfOptions(str(folder), num_blocks=64, block_size=4, seed=0, device="cpu"))
        await eng.start()
        try:
            if paged:
                eng._loaded = dataclasses.replace(eng._loaded, paged=True)
            first = await _tokens(eng, _request(prompts[0], "solo"))
            rest = await __import__("asyncio").gather(*(_tokens(eng, _request(p, f"r{i}")) for i, p in enumerate(prompts)))
            return [first, *rest]
        finally:
            await eng.cleanup()

    packed, paged = await run(False), await run(True)
    assert packed == paged
    assert packed[0] == packed[1]


async def test_synthetic_weights_sample_only_the_tokenizers_ids(tmp_path, monkeypatch, tiny_path):
    """--random-weights: a shape's vocabulary larger than the tokenizer's never yields an id
    the tokenizer cannot decode."""
    import kvmesh.engines.hf.shapes as shapes

    small = shapes.SHAPES["llama-1b"] | {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                          "vocab_size": 50000, "max_position_embeddings": 256}  # fmt: skip
    monkeypatch.setitem(shapes.SHAPES, "llama-1b", small)
    eng = HfEngine(HfOptions(str(tiny_path), num_blocks=32, seed=1, device="cpu", random_weights="llama-1b"))
    await eng.start()
    try:
        assert eng._require().model.spec.vocab_size == 50000
        assert eng.config.context_length == 256
        out = await _tokens(eng, _request([1, 2, 3, 4], "x", max_tokens=40))
        assert len(out) == 40 and max(out) < 2048
    finally:
        await eng.cleanup()


def test_the_kv_budget_takes_the_fraction_less_what_is_held_and_never_more_than_is_free():
    gib = 1 << 30
    mib256 = 256 << 20
    # 80 GiB card, 0.9 of it, 17 GiB held (weights + context), 3 GiB of activations reserved
    assert kv_budget(80 * gib, 62 * gib, 17 * gib, 0.9, 3 * gib) == int(72 * gib) - 20 * gib - mib256
    # a second worker at 0.45 while the first holds 40 GiB: the free memory binds
    assert kv_budget(80 * gib, 20 * gib, 3 * gib, 0.45, gib) == 19 * gib - mib256
    assert kv_budget(80 * gib, 1 * gib, 3 * gib, 0.45, gib) == 0
