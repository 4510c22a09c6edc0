"""Fixtures for the hf engine tests: the bundled trained model, its transformers twin,
and small random Llama folders written on the fly."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvmesh.engines.hf import HfEngine, HfOptions  # noqa: E402
from kvmesh.preprocess.model import bundled_model_path  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """The hf tests share a 2-core machine with the rest of the suite."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    path = bundled_model_path()
    assert (path / "model.safetensors").is_file(), "run scripts/train_tiny_model.py to create the weights"
    return path


@pytest.fixture(scope="session")
def reference(tiny_path):
    """transformers' LlamaForCausalLM over the bundled weights (the reference)."""
    model = transformers.LlamaForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture
async def engine(tiny_path) -> AsyncIterator[HfEngine]:
    eng = HfEngine(HfOptions(str(tiny_path), num_blocks=256, max_num_batched_tokens=256, seed=0))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.cleanup()


def write_random_llama(folder: Path, **overrides: object) -> Path:
    """A small randomly initialised Llama folder (config.json, model.safetensors and
    the bundled tokenizer files), for shapes the bundled model does not have."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 2048,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 0,
    }
    cfg.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    model.save_pretrained(str(folder))
    # the folder keeps the config as written here (save_pretrained may rename keys)
    (folder / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((bundled_model_path() / name).read_bytes())
    return folder
