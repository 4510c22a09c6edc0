"""LoRA adapters in the hf engine (issue 30): greedy output with an adapter equals
transformers + peft on the same weights; a batch mixing the base model and two adapters
gives every sequence the tokens it gets alone; adapters checked against the model;
the same prompt under two adapters shares no cached block."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvmesh.engines.hf import HfEngine, HfOptions
from kvmesh.errors import InvalidArgument
from kvmesh.preprocess.tokenizer import load_tokenizers_file
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.testing import mock_context
from kvmesh.testing.lora import write_adapter
from tests.unit.hf.conftest import torch, transformers

peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.timeout(120),
    # peft 0.21 calls a transformers property that transformers 5 deprecates (the reference's noise, not ours)
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

PROMPTS = ["def read_config(path):\n", "import os\nimport sys\n\n\nclass Cache:\n", "for i in range(10):\n"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_adapter(tiny_path: Path, folder: Path, seed: int, rank: int, targets: list[str]) -> Path:
    """A random (non-zero B) PEFT adapter on the bundled model, saved by peft itself."""
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # big enough to change the greedy tokens, small enough to keep them readable
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(2.0)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": _make_adapter(tiny_path, root / "a", 1, 4, TARGETS),
        "b": _make_adapter(tiny_path, root / "b", 2, 8, ["q_proj", "v_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def prompt_ids(tiny_path: Path) -> list[list[int]]:
    tok = load_tokenizers_file(tiny_path / "tokenizer.json")
    return [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]


def _request(ids: list[int], rid: str, adapter: str | None, max_tokens: int = 16) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="kvmesh-tiny", token_ids=list(ids), adapter=adapter,
        sampling=SamplingOptions(temperature=0.0), stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )  # fmt: skip


async def _tokens(engine: HfEngine, request: PreprocessedRequest) -> tuple[list[int], int]:
    chunks = [c async for c in engine.generate(request, mock_context(request.request_id))]
    usage = chunks[-1].usage
    return [t for c in chunks for t in c.token_ids], usage.cached_tokens if usage is not None else 0


def _peft_greedy(tiny_path: Path, folder: Path | None, ids: list[int], n: int) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32)
    if folder is not None:
        model = peft.PeftModel.from_pretrained(model, str(folder))
    model.eval()
    seq = list(ids)
    with torch.no_grad():  # greedy without an end: the engine's requests ignore EOS
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.fixture
async def engine(tiny_path: Path, adapters: dict[str, Path]):
    loras = tuple(f"{n}={p}" for n, p in adapters.items())
    eng = HfEngine(HfOptions(str(tiny_path), num_blocks=256, max_num_batched_tokens=256, seed=0, loras=loras, max_loras=2))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.cleanup()


async def test_greedy_output_with_an_adapter_equals_transformers_with_peft(engine, tiny_path, adapters, prompt_ids):
    ids = prompt_ids[0]
    base, _ = await _tokens(engine, _request(ids, "base", None))
    assert base == _peft_greedy(tiny_path, None, ids, 16)
    for name, folder in adapters.items():
        ours, _ = await _tokens(engine, _request(ids, name, name))
        assert ours == _peft_greedy(tiny_path, folder, ids, 16), name
        assert ours != base, f"adapter {name} changed no token: the test would not see a missing adapter"


async def test_a_batch_mixing_base_and_two_adapters_gives_each_sequence_its_tokens_alone(engine, prompt_ids):
    plan = [(ids, adapter) for ids in prompt_ids for adapter in (None, "a", "b")]
    together = await asyncio.gather(  # first, on a cold cache: the prefills of all nine share passes too
        *(_tokens(engine, _request(ids, f"mix{i}", adapter, 12)) for i, (ids, adapter) in enumerate(plan))
    )
    assert engine.stats.max_batch >= 9  # they ran in one batch
    alone = [(await _tokens(engine, _request(ids, f"alone{i}", adapter, 12)))[0] for i, (ids, adapter) in enumerate(plan)]
    assert [t for t, _ in together] == alone
    assert len({tuple(t) for t in alone}) == len(plan)  # every (prompt, adapter) pair has its own tokens


async def test_the_same_prompt_under_two_adapters_shares_no_cached_block(engine, prompt_ids):
    ids = prompt_ids[1] * 3  # several full blocks
    await _tokens(engine, _request(ids, "a1", "a", 2))
    assert (await _tokens(engine, _request(ids, "a2", "a", 2)))[1] >= 16  # a's own blocks are reused
    assert (await _tokens(engine, _request(ids, "b1", "b", 2)))[1] == 0
    assert (await _tokens(engine, _request(ids, "base", None, 2)))[1] == 0


async def test_an_adapter_for_another_model_is_refused_with_what_does_not_fit(engine, tmp_path):
    wrong = write_adapter(tmp_path / "wrong", shapes={"q_proj": (96, 96), "v_proj": (96, 32)})
    with pytest.raises(InvalidArgument, match="made for another model"):
        await engine.lora_load("wrong", str(wrong))
    deep = write_adapter(tmp_path / "deep", layers=6)
    with pytest.raises(InvalidArgument, match="past the model's 4 layers"):
        await engine.lora_load("deep", str(deep))
    big = write_adapter(tmp_path / "big", rank=32)
    with pytest.raises(InvalidArgument, match="--max-lora-rank 16"):
        await engine.lora_load("big", str(big))
    nan = write_adapter(tmp_path / "nan", values=lambda i: float("nan") if i == 3 else 0.0)
    with pytest.raises(InvalidArgument, match="NaN"):
        await engine.lora_load("nan", str(nan))
    cfg = json.loads((nan / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and engine.lora_state().adapters == ["a", "b"]  # nothing was evicted for them


async def test_a_remote_prefill_with_an_adapter_gives_the_tokens_of_a_local_run(tiny_path, adapters, prompt_ids):
    """Disaggregation: the prefill worker loads the adapter on demand (it knows only its
    path) and computes the adapter's KV; the decode worker continues with the same adapter."""
    known = (f"a={adapters['a']}",)
    pre = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0, loras=known, max_loras=1))
    dec = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0, loras=known, max_loras=1))
    await pre.start()
    await dec.start()
    try:
        await pre.lora_unload("a")  # forgets it: the prefill worker must load it by path
        await pre.lora_load("a", str(adapters["a"]))
        await pre.lora_load("b", str(adapters["b"]))  # a is evicted (one slot), its path kept
        ids = prompt_ids[1]
        solo, _ = await _tokens(dec, _request(ids, "solo", "a", 12))
        request = _request(ids, "disagg", "a", 12)
        upto = len(ids) - 1
        data = await pre.prefill_remote(request, b"", 0, upto)
        assert pre.lora_state().adapters == ["a"]
        res = dec.kv_reserve(request)
        assert res is not None and res.cached_tokens == 0  # the prompt is shorter than a block: nothing cached
        n_blocks = -(-upto // 16)
        dec.kv_import(res.block_ids[:n_blocks], data)
        dec.kv_commit("disagg", upto)
        assert (await _tokens(dec, request))[0] == solo
    finally:
        await pre.cleanup()
        await dec.cleanup()


async def test_a_restarted_engine_loads_its_adapters_again(tiny_path, adapters, prompt_ids):
    eng = HfEngine(HfOptions(str(tiny_path), num_blocks=64, seed=0, loras=(f"a={adapters['a']}",), max_loras=1))
    await eng.start()
    try:
        first, _ = await _tokens(eng, _request(prompt_ids[2], "1", "a", 8))
        await eng.cleanup()  # the model and its adapter slots are gone
        await eng.start()
        assert (await _tokens(eng, _request(prompt_ids[2], "2", "a", 8)))[0] == first
    finally:
        await eng.cleanup()
