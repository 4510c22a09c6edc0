"""The ``vllm`` engine against a real vLLM (opt-in; see conftest.py and docs/engines.md):
the conformance kit, greedy tokens equal to transformers', KV events into the router's
indexer, and ``kvmesh run --engine vllm`` end to end with the KV router."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from kvmesh.engines.adapter import AbortMonitor, validated
from kvmesh.engines.vllm import VllmEngine, VllmOptions
from kvmesh.preprocess.preprocessor import Preprocessor
from kvmesh.protocol import AllBlocksCleared, BlockStored, OutputOptions, PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.kv.hashing import block_hashes
from kvmesh.router.indexer import KvIndexer
from kvmesh.runtime.context import Context
from kvmesh.runtime.events import RecordingPublisher
from kvmesh.testing.conformance import run_conformance
from tests.helpers import free_port
from tests.vllm.conftest import model_folder

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 900.0
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
# long enough for several full 32-token KV blocks with any tokenizer
LONG = [{"role": "user", "content": " ".join(
    ["The harbour was quiet before dawn; fishing boats rocked at their moorings while gulls waited on the pier."] * 4
    + ["Describe what happens when the sun comes up."]
)}]  # fmt: skip


def _options(publisher_id: int = 1, **kw) -> VllmOptions:
    base = dict(
        model=str(model_folder()), worker_id=publisher_id, block_size=32, max_model_len=1024, max_num_seqs=8,
        dtype="float32", enforce_eager=True, kv_cache_gb=1.0,
    )  # fmt: skip
    base.update(kw)
    return VllmOptions(**base)


def _prompt_ids(messages) -> list[int]:
    return Preprocessor.from_folder(model_folder()).chat_prompt(messages)


def _greedy(ids: list[int], n: int, rid: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=ids, sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=n), eos_token_ids=list(Preprocessor.from_folder(model_folder()).eos_token_ids),
        output=OutputOptions(logprobs=1),
    )  # fmt: skip


async def _collect(engine: VllmEngine, request: PreprocessedRequest):
    ctx = Context(request.request_id)
    monitor = AbortMonitor(engine)
    monitor.watch(ctx)
    chunks = [c async for c in validated(engine.generate(request, ctx))]
    await monitor.close()
    return chunks


def _transformers_greedy(ids: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_folder()), dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    tokens = out[0][len(ids) :].tolist()
    eos = set(Preprocessor.from_folder(model_folder()).eos_token_ids)
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


async def test_conformance_kit_passes():
    conformance_request = PreprocessedRequest(
        request_id="conformance", model="m", token_ids=_prompt_ids(PROMPTS[1]),
        stop=StopConditions(max_tokens=24, ignore_eos=True),
    )  # fmt: skip
    ran = await run_conformance(
        lambda: VllmEngine(_options()), request=conformance_request, timeout_s=START_TIMEOUT_S, cancel_within_s=5.0
    )
    assert len(ran) == 8


async def test_greedy_tokens_match_transformers_and_kv_events_reach_the_indexer():
    rec = RecordingPublisher()
    engine = VllmEngine(_options(publisher_id=42), rec)
    config = await asyncio.wait_for(engine.start(), START_TIMEOUT_S)
    try:
        assert config.kv_block_size == 32 and config.total_kv_blocks > 0 and config.context_length == 1024
        ids = _prompt_ids(PROMPTS[0])
        chunks = await _collect(engine, _greedy(ids, 24, "greedy-1"))
        tokens = [t for c in chunks for t in c.token_ids]
        terminal = chunks[-1]
        assert terminal.finish_reason in ("stop", "length")
        assert terminal.usage.prompt_tokens == len(ids) and terminal.usage.completion_tokens == len(tokens)
        assert all(len(c.logprobs or []) == len(c.token_ids) for c in chunks)
        assert tokens == _transformers_greedy(ids, 24)
        text = Preprocessor.from_folder(model_folder()).tokenizer.decode(tokens)
        print(f"\nvLLM greedy answer: {text!r}")

        # a long prompt twice: the second is a prefix-cache hit, reported as cached tokens
        ids = _prompt_ids(LONG)
        once = await _collect(engine, _greedy(ids, 8, "long-1"))
        again = await _collect(engine, _greedy(ids, 8, "long-2"))
        assert [t for c in again for t in c.token_ids] == [t for c in once for t in c.token_ids]
        assert again[-1].usage.cached_tokens >= 32 * (len(ids) // 32 - 1) > 0

        # vLLM's own KV events, re-hashed, make the indexer see this worker's blocks
        await asyncio.sleep(0.5)
        kinds = [type(e.data) for e in rec.kv_events]
        assert kinds[0] is AllBlocksCleared and BlockStored in kinds
        index = KvIndexer()
        for event in rec.kv_events:
            index.apply(event.worker_id, event.data)
        full_blocks = len(ids) // 32
        assert index.find_matches(block_hashes(ids, 32)).get(42, 0) >= full_blocks >= 1
        snap = engine.kv_snapshot()
        assert snap.last_event_id == rec.kv_events[-1].event_id and set(block_hashes(ids, 32)) <= set(snap.block_hashes)
        assert rec.load_reports and rec.load_reports[-1].total_blocks == config.total_kv_blocks
    finally:
        await engine.cleanup()


def _post(port: int, body: dict, headers: dict | None = None) -> tuple[dict, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def test_kvmesh_run_engine_vllm_with_the_kv_router(tmp_path):
    port = free_port()
    env = dict(os.environ, KVMESH_VLLM_ENFORCE_EAGER="1", KVMESH_VLLM_MAX_MODEL_LEN="1024",
               KVMESH_VLLM_KV_CACHE_GB="1", KVMESH_VLLM_DTYPE="float32")  # fmt: skip
    cmd = [sys.executable, "-m", "kvmesh.cli.main", "run", "--engine", "vllm", "--model-path", str(model_folder()),
           "--workers", "1", "--router-mode", "kv", "--http-port", str(port), "--canary-interval", "0"]  # fmt: skip
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "kvmesh run --engine vllm did not become healthy"
            time.sleep(1)
        name = model_folder().name
        body = {"model": name, "messages": PROMPTS[0], "max_tokens": 24, "temperature": 0}
        first, _ = _post(port, body)
        answer = first["choices"][0]["message"]["content"]
        print(f"\nkvmesh run --engine vllm answered: {answer!r}")
        assert answer and (model_folder().name != "smollm2" or "Paris" in answer)
        # a long prompt twice: the KV router sees the worker's blocks (vLLM's KV events)
        long_body = {"model": name, "messages": LONG, "max_tokens": 8, "temperature": 0}
        one, _ = _post(port, long_body)
        time.sleep(1.0)  # the KV events of the first reach the router
        two, headers = _post(port, {**long_body, "router_explain": True})
        assert one["choices"][0]["message"]["content"] == two["choices"][0]["message"]["content"]
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        route = json.loads(headers["x-kvmesh-route"])
        print(f"route of the repeat: {route}")
        assert route["mode"] == "kv" and route["overlap_blocks"] >= 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_disaggregation_through_a_vllm_kv_connector(tmp_path):
    """Prefill on a producer engine, decode on a consumer engine, the KV moved by
    vLLM's ExampleConnector (shared storage, the one connector a CPU can run): the
    consumer loads the prompt's KV instead of computing it, and its greedy tokens equal
    a plain engine's."""
    ids = _prompt_ids(LONG)
    plain = VllmEngine(_options(publisher_id=1))
    await asyncio.wait_for(plain.start(), START_TIMEOUT_S)
    try:
        want = [t for c in await _collect(plain, _greedy(ids, 16, "plain")) for t in c.token_ids]
    finally:
        await plain.cleanup()

    def connector(role: str) -> dict:
        return {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip

    producer = VllmEngine(_options(publisher_id=2, kv_transfer_config=connector("kv_producer")))
    await asyncio.wait_for(producer.start(), START_TIMEOUT_S)
    try:
        prefill = await _collect(producer, _greedy(ids, 1, "prefill"))
        assert prefill[-1].finish_reason == "length"
    finally:
        await producer.cleanup()
    assert any(tmp_path.rglob("*.safetensors")), "the producer stored no KV"

    consumer = VllmEngine(_options(publisher_id=3, kv_transfer_config=connector("kv_consumer")))
    await asyncio.wait_for(consumer.start(), START_TIMEOUT_S)
    try:
        decoded = await _collect(consumer, _greedy(ids, 16, "decode"))
    finally:
        await consumer.cleanup()
    assert [t for c in decoded for t in c.token_ids] == want
    # the prompt's KV came through the connector: all full blocks but the last token's
    assert decoded[-1].usage.cached_tokens >= 32 * ((len(ids) - 1) // 32)


def _peft_adapter(folder) -> str:
    """A random (non-zero) PEFT LoRA adapter on the test model, saved by peft."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(str(model_folder()), dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(str(folder))
    return str(folder)


def _peft_greedy(ids: list[int], n: int, folder: str) -> list[int]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_folder()), dtype=torch.float32), folder)
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    tokens = out[0][len(ids) :].tolist()
    eos = set(Preprocessor.from_folder(model_folder()).eos_token_ids)
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


async def test_a_lora_adapter_passes_through_as_a_lora_request(tmp_path):
    """issue 30: ``PreprocessedRequest.adapter`` → vLLM's ``LoRARequest``; greedy tokens equal
    transformers + peft on the same adapter; run-time load and unload through the engine."""
    pytest.importorskip("peft")
    folder = _peft_adapter(tmp_path / "a")
    engine = VllmEngine(_options(loras=(f"a={folder}",), max_loras=2))
    config = await asyncio.wait_for(engine.start(), START_TIMEOUT_S)
    try:
        assert config.max_adapters == 2 and engine.lora_state().adapters == ["a"]
        ids = _prompt_ids(PROMPTS[1])
        request = _greedy(ids, 16, "lora-1")
        request.adapter = "a"
        tokens = [t for c in await _collect(engine, request) for t in c.token_ids]
        assert tokens == _peft_greedy(ids, 16, folder)
        assert (await engine.lora_load("b", folder)).adapters == ["a", "b"]
        assert (await engine.lora_unload("b")).adapters == ["a"]
    finally:
        await engine.cleanup()
