"""The hf engine on the bundled trained model: contract, exactness against
transformers, batching, sampling, logprobs, stop rules, prefix cache and KV events,
KV block access."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvmesh.engines.hf import HfEngine, HfOptions
from kvmesh.errors import InvalidArgument
from kvmesh.preprocess.tokenizer import load_tokenizers_file
from kvmesh.protocol import (
    AllBlocksCleared,
    BlockStored,
    OutputChunk,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from kvmesh.kv.hashing import block_hashes
from kvmesh.runtime.events import RecordingPublisher
from kvmesh.testing import mock_context, run_conformance
from tests.unit.hf.conftest import torch

PROMPTS = [
    "def read_config(path):\n",
    "<|im_start|>user\nReturn the sum of a list of numbers.<|im_end|>\n<|im_start|>assistant\n",
    "import os\nimport sys\n\n\nclass Cache:\n    \"\"\"A small LRU cache.\"\"\"\n\n    def __init__(self",
]


@pytest.fixture(scope="module")
def prompt_ids(tiny_path) -> list[list[int]]:
    tok = load_tokenizers_file(tiny_path / "tokenizer.json")
    return [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]


def _request(ids: list[int], rid: str = "r", *, max_tokens: int = 24, ignore_eos: bool = True, **kw) -> PreprocessedRequest:
    stop = StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos, **kw.pop("stop", {}))
    sampling = kw.pop("sampling", SamplingOptions(temperature=0.0))
    return PreprocessedRequest(request_id=rid, model="kvmesh-tiny", token_ids=list(ids), sampling=sampling, stop=stop, **kw)


async def _no_blocks_held(engine: HfEngine) -> bool:
    """Whether every block is free once the pass in flight (if any) has ended."""
    for _ in range(200):
        if engine.scheduler.blocks.active_blocks == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def _run(engine: HfEngine, request: PreprocessedRequest) -> tuple[list[int], list[OutputChunk]]:
    chunks = [c async for c in engine.generate(request, mock_context(request.request_id))]
    return [t for c in chunks for t in c.token_ids], chunks


# ---------------------------------------------------------------------------- contract


async def test_conformance_kit_passes(tiny_path):
    names = await run_conformance(lambda: HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0)), timeout_s=30)
    assert len(names) == 8


# ---------------------------------------------------------------------------- exactness


async def test_greedy_tokens_equal_transformers_generate(engine, reference, prompt_ids):
    for i, ids in enumerate(prompt_ids):
        ours, chunks = await _run(engine, _request(ids, f"g{i}", max_tokens=32, ignore_eos=False))
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        theirs = out[0, len(ids) :].tolist()
        if chunks[-1].finish_reason == "stop":  # ended on EOS: transformers keeps it, we do not emit it
            assert theirs[-1] in (0, 2) and ours == theirs[:-1]
        else:
            assert chunks[-1].finish_reason == "length" and ours == theirs
        assert len(set(ours)) > 3, f"degenerate greedy output {ours}"


async def test_decode_steps_are_batched_and_batching_changes_no_token(engine, prompt_ids):
    requests = [_request(prompt_ids[i % 3][: 10 + i], f"b{i}", max_tokens=16) for i in range(6)]
    solo = [(await _run(engine, r))[0] for r in requests]
    steps_before = engine.stats.steps
    together = await asyncio.gather(*(_run(engine, r) for r in requests))
    steps = engine.stats.steps - steps_before
    assert [t for t, _ in together] == solo
    total = sum(len(t) for t in solo)
    assert total == 96
    assert steps <= 20, f"{steps} forward passes for 6 concurrent requests of 16 tokens: not batched"
    assert engine.stats.max_batch == 6


# ---------------------------------------------------------------------------- sampling


async def test_seeded_sampling_is_reproducible_alone_or_batched(engine, prompt_ids):
    def sampled(seed: int, rid: str) -> PreprocessedRequest:
        opts = SamplingOptions(temperature=0.9, top_p=0.95, top_k=100, seed=seed)
        return _request(prompt_ids[0], rid, max_tokens=24, sampling=opts)

    a, _ = await _run(engine, sampled(7, "s1"))
    b, _ = await _run(engine, sampled(7, "s2"))
    c, _ = await _run(engine, sampled(8, "s3"))
    assert a == b
    assert a != c
    batched = await asyncio.gather(_run(engine, sampled(7, "s4")), _run(engine, _request(prompt_ids[1], "other")))
    assert batched[0][0] == a
    greedy, _ = await _run(engine, _request(prompt_ids[0], "greedy"))
    assert a != greedy


async def test_logprobs_are_the_models_and_list_top_alternatives(engine, reference, prompt_ids):
    ids = prompt_ids[1]
    tokens, chunks = await _run(engine, _request(ids, "lp", max_tokens=6, output=OutputOptions(logprobs=3)))
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    assert [lp.token_id for lp in logprobs] == tokens
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids + tokens])).logits[0], dim=-1)
    for i, lp in enumerate(logprobs):
        assert len(lp.top) == 3
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))  # greedy: the best one
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob == pytest.approx(ref[len(ids) - 1 + i, lp.token_id].item(), abs=1e-4)
        assert math.isfinite(lp.logprob) and lp.logprob <= 0
    _, chunks = await _run(engine, _request(ids, "lp0", max_tokens=3, output=OutputOptions(logprobs=0)))
    assert all(lp.top == [] for c in chunks for lp in (c.logprobs or []))
    _, chunks = await _run(engine, _request(ids, "nolp", max_tokens=3))
    assert all(c.logprobs is None for c in chunks)


# ---------------------------------------------------------------------------- stop rules


async def test_stop_rules(engine, prompt_ids):
    ids = prompt_ids[0]
    base, _ = await _run(engine, _request(ids, "base", max_tokens=20))
    # a token whose first occurrence is at index >= 2
    i = next(k for k in range(2, len(base)) if base[k] not in base[:k])
    t = base[i]

    out, chunks = await _run(engine, _request(ids, "len", max_tokens=5))
    assert out == base[:5] and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == len(ids)

    out, chunks = await _run(engine, _request(ids, "stopid", max_tokens=20, stop={"stop_token_ids": [t]}))
    assert out == base[: i + 1] and chunks[-1].finish_reason == "stop"  # a stop id is emitted

    out, chunks = await _run(engine, _request(ids, "eos", max_tokens=20, ignore_eos=False, eos_token_ids=[t]))
    assert out == base[:i] and chunks[-1].finish_reason == "stop"  # an EOS is not

    out, chunks = await _run(engine, _request(ids, "ign", max_tokens=20, eos_token_ids=[t]))
    assert out == base and chunks[-1].finish_reason == "length"  # ignore_eos: an ordinary token

    req = _request(ids, "min", max_tokens=20, ignore_eos=False, eos_token_ids=[t], stop={"min_tokens": i + 3})
    out, chunks = await _run(engine, req)
    assert len(out) >= i + 3 and t not in out[: i + 3]  # banned until min_tokens are out
    assert out[:i] == base[:i]


async def test_bad_requests_raise_invalid_argument(engine, prompt_ids):
    bad = [
        _request([], "empty"),
        _request([5, 99999], "vocab"),
        _request(prompt_ids[0], "temp", sampling=SamplingOptions(temperature=-1.0)),
        _request(prompt_ids[0], "topp", sampling=SamplingOptions(temperature=1.0, top_p=0.0)),
        _request(prompt_ids[0], "lp", output=OutputOptions(logprobs=99)),
        _request(prompt_ids[0], "max", max_tokens=0),
        _request([5] * 2048, "ctx"),
    ]
    for request in bad:
        with pytest.raises(InvalidArgument):
            await _run(engine, request)
    assert engine.scheduler.blocks.active_blocks == 0


async def test_cancel_frees_blocks_within_a_step(engine, prompt_ids):
    req = _request(prompt_ids[2], "c", max_tokens=500)
    ctx = mock_context("c")
    stream = engine.generate(req, ctx)
    first = await anext(stream)
    assert first.token_ids and engine.scheduler.blocks.active_blocks > 0
    steps = engine.stats.steps
    ctx.stop_generating()
    rest = [c async for c in stream]
    assert rest[-1].finish_reason == "cancelled"
    assert await _no_blocks_held(engine)
    assert engine.stats.steps - steps <= 2


# ---------------------------------------------------------------------------- prefix cache, events


async def test_prefix_cache_hit_is_reported_and_events_match_the_hashes(tiny_path, prompt_ids):
    pub = RecordingPublisher()
    engine = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0), pub)
    await engine.start()
    try:
        ids = (prompt_ids[2] * 2)[:40]  # two full blocks of 16 and 8 more
        first, chunks1 = await _run(engine, _request(ids, "p1", max_tokens=8))
        second, chunks2 = await _run(engine, _request(ids, "p2", max_tokens=8))
        assert first == second
        assert chunks1[-1].usage.cached_tokens == 0
        assert chunks2[-1].usage.cached_tokens == 32 and chunks2[0].cached_tokens == 32
        assert isinstance(pub.kv_events[0].data, AllBlocksCleared)
        stored = [h for e in pub.kv_events if isinstance(e.data, BlockStored) for h in e.data.block_hashes]
        assert stored[:2] == block_hashes(ids, 16)[:2]
        assert [e.event_id for e in pub.kv_events] == list(range(len(pub.kv_events)))
        assert set(block_hashes(ids, 16)) <= set(engine.kv_snapshot().block_hashes)
        assert pub.load_reports and pub.load_reports[-1].total_blocks == 64
    finally:
        await engine.cleanup()


# ---------------------------------------------------------------------------- KV block access


async def test_remote_prefill_kv_round_trip_gives_the_same_tokens(tiny_path, prompt_ids):
    a = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0))
    b = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0))
    await a.start()
    await b.start()
    try:
        ids = prompt_ids[1]
        solo, _ = await _run(a, _request(ids, "solo", max_tokens=16))
        layout = a.kv_layout()
        assert layout is not None and layout.wire_bytes_per_block == layout.bytes_per_block
        assert layout.block_shape == (4, 2, 2, 16, 64) and layout.dtype == "float32"
        request = _request(ids, "disagg", max_tokens=16)
        upto = len(ids) - 1
        data = await a.prefill_remote(request, b"", 0, upto)
        n_blocks = -(-upto // 16)
        assert len(data) == n_blocks * layout.bytes_per_block
        res = b.kv_reserve(request)
        assert res is not None and res.cached_tokens == 0 and res.num_tokens == len(ids)
        b.kv_import(res.block_ids[:n_blocks], data)
        assert b.kv_export(res.block_ids[:n_blocks]) == data
        b.kv_commit("disagg", upto)
        forwarded = b.stats.forward_tokens
        tokens, chunks = await _run(b, request)
        assert tokens == solo
        # only the last prompt token was computed on b, then one per decode step
        assert b.stats.forward_tokens - forwarded == 1 + 15
        assert a.scheduler.blocks.active_blocks == 0 and b.scheduler.blocks.active_blocks == 0
    finally:
        await a.cleanup()
        await b.cleanup()


async def test_detached_request_continues_on_another_engine(tiny_path, prompt_ids):
    a = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0))
    b = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0))
    await a.start()
    await b.start()
    try:
        ids = prompt_ids[2]
        solo, _ = await _run(a, _request(ids, "solo", max_tokens=30))
        stream = a.generate(_request(ids, "mig", max_tokens=30), mock_context("mig"))
        delivered: list[int] = []
        async for chunk in stream:
            delivered += chunk.token_ids
            if len(delivered) >= 10 and chunk.finish_reason is None:
                res = a.kv_detach("mig")
                assert res is not None
        assert chunk.finish_reason == "cancelled"
        assert res.num_tokens == len(ids) + len(delivered) and res.cached_tokens == res.num_tokens - 1
        valid = -(-res.cached_tokens // 16)
        data = a.kv_export(res.block_ids[:valid])
        resumed = _request(ids + delivered, "mig", max_tokens=30 - len(delivered))
        target = b.kv_reserve(resumed)
        assert target is not None
        b.kv_import(target.block_ids[:valid], data)
        b.kv_commit("mig", res.cached_tokens)
        a.kv_release("mig")
        assert await _no_blocks_held(a)  # freed once the pass that was running ends
        rest, _ = await _run(b, resumed)
        assert delivered + rest == solo
    finally:
        await a.cleanup()
        await b.cleanup()


async def test_kv_access_refuses_bad_calls(engine, prompt_ids):
    with pytest.raises(InvalidArgument, match="no reservation"):
        engine.kv_import([0], b"")
    with pytest.raises(InvalidArgument, match="no KV reservation"):
        engine.kv_commit("nobody", 3)
    res = engine.kv_reserve(_request(prompt_ids[0], "res"))
    assert res is not None
    with pytest.raises(InvalidArgument, match="needs"):
        engine.kv_import(res.block_ids[:1], b"\0" * 10)
    with pytest.raises(InvalidArgument, match="computed tokens must be"):
        engine.kv_commit("res", len(prompt_ids[0]))
    with pytest.raises(InvalidArgument, match="not valid"):
        await engine.prefill_remote(_request(prompt_ids[0], "pr"), b"", 3, 5)
    engine.kv_release("res")
    assert engine.scheduler.blocks.active_blocks == 0


# ---------------------------------------------------------------------------- wiring


def test_worker_builds_the_hf_engine_over_the_bundled_model(tiny_path, monkeypatch):
    from kvmesh.config import WorkerConfig
    from kvmesh.worker.main import build_engine

    monkeypatch.setenv("KVMESH_HF_THREADS", "1")
    monkeypatch.setenv("KVMESH_HF_NUM_BLOCKS", "100")
    # the CLI resolves KVMESH_HF_* once (kvmesh.settings); the worker gets the object
    from kvmesh.engines.settings import HfSettings
    from kvmesh.settings import resolve

    cfg = WorkerConfig(engine="hf", worker_id=7, block_size=32, engine_options=resolve(HfSettings))
    engine, path = build_engine(cfg)
    assert isinstance(engine, HfEngine) and path == str(tiny_path)
    opts = engine.options
    assert (opts.threads, opts.num_blocks, opts.block_size, opts.worker_id) == (1, 100, 32, 7)
    assert opts.served_model_name == "kvmesh-tiny"


def test_options_are_checked():
    from kvmesh.engines.settings import HfSettings, options_from
    from kvmesh.settings import resolve

    with pytest.raises(ValueError, match="KVMESH_HF_THREADS='two' is not an integer"):
        options_from(HfOptions, resolve(HfSettings, env={"KVMESH_HF_THREADS": "two"}), model_path="m")
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        HfOptions("m", block_size=0)
    assert options_from(HfOptions, resolve(HfSettings, env={"KVMESH_HF_KV_CACHE_MB": "64"}), model_path="m").kv_cache_mb == 64


async def test_a_folder_without_weights_fails_start_with_a_clear_error(tmp_path):
    from kvmesh.preprocess.model import bundled_model_path

    for f in bundled_model_path().glob("*.json"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    engine = HfEngine(HfOptions(str(tmp_path)))
    with pytest.raises(InvalidArgument, match="no \\*.safetensors weights"):
        await engine.start()
    await engine.cleanup()


# ---------------------------------------------------------------------------- priority tiers


async def test_premium_request_preempts_best_effort_and_waits_ahead_of_standard(tiny_path, prompt_ids):
    """One sequence slot: a premium arrival preempts the running best-effort request
    and runs before a standard one queued earlier; the preempted request resumes
    (recomputed) and still produces the tokens it produces alone."""
    from kvmesh.protocol import RoutingHints

    engine = HfEngine(HfOptions(str(tiny_path), num_blocks=64, max_num_seqs=1, seed=0))
    await engine.start()
    try:
        solo, _ = await _run(engine, _request(prompt_ids[0], "solo", max_tokens=30))
        order: list[str] = []
        tokens: dict[str, list[int]] = {}

        async def consume(stream, rid: str) -> None:
            async for chunk in stream:
                tokens.setdefault(rid, []).extend(chunk.token_ids)
                if chunk.is_terminal:
                    order.append(rid)

        def start(rid: str, priority: str, ids: list[int], max_tokens: int):
            req = _request(ids, rid, max_tokens=max_tokens, routing=RoutingHints(priority=priority))
            return engine.generate(req, mock_context(rid))

        slow = start("best", "best_effort", prompt_ids[0], 30)
        first = await anext(slow)  # running now, in the only slot
        tokens["best"] = list(first.token_ids)
        std = asyncio.create_task(consume(start("std", "standard", prompt_ids[1], 4), "std"))
        prem = asyncio.create_task(consume(start("prem", "premium", prompt_ids[2], 4), "prem"))
        await asyncio.wait_for(asyncio.gather(consume(slow, "best"), std, prem), 60)
        assert order == ["prem", "std", "best"]
        assert tokens["best"] == solo
    finally:
        await engine.cleanup()


async def test_small_passes_run_on_the_loop_and_change_no_token(tiny_path, prompt_ids, monkeypatch):
    """A decode pass cheap enough runs on the event loop (no thread hand-off); a prompt
    pass still runs in the forward thread; concurrent streams get the same tokens either way."""
    import threading

    from kvmesh.engines.hf import engine as hf_engine

    threads: list[str] = []
    real = hf_engine._forward_and_sample

    def spy(loaded, inputs, params):
        threads.append(threading.current_thread().name)
        return real(loaded, inputs, params)

    monkeypatch.setattr(hf_engine, "_forward_and_sample", spy)
    requests = [_request(prompt_ids[i], f"i{i}", max_tokens=12) for i in range(3)]

    async def tokens(limit_s: float) -> list[list[int]]:
        monkeypatch.setattr(hf_engine, "_INLINE_CPU_S", limit_s)
        eng = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0))
        await eng.start()
        try:
            return [t for t, _ in await asyncio.gather(*(_run(eng, r) for r in requests))]
        finally:
            await eng.cleanup()

    threaded = await tokens(0.0)
    assert threads and all(t.startswith("hf-forward") for t in threads)
    threads.clear()
    inline = await tokens(60.0)
    loop_thread = threading.current_thread().name
    assert threads[0].startswith("hf-forward")  # the prompts' pass: too big, and nothing measured yet
    assert threads.count(loop_thread) >= 10  # the decode passes after the first
    assert inline == threaded and all(len(t) == 12 for t in inline)
