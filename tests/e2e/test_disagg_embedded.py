"""`kvmesh run --prefill-workers 1 --decode-workers 1`: embedded disaggregation (the
prefill queue lives in the run process; no etcd, no NATS), through the openai client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers import RUN_SECRET, kvmesh_run, worker_disagg_stats

pytestmark = [pytest.mark.processes, pytest.mark.slow]


stats = worker_disagg_stats  # the worker counters the tests read


def test_embedded_prefill_and_decode_workers(tmp_path) -> None:
    args = ("--admin", "--prefill-workers", "1", "--decode-workers", "1", "--max-local-prefill-length", "300", "--canary-interval", "0")
    with kvmesh_run(tmp_path, *args, workers=1, speedup="50") as server:
        deadline = time.monotonic() + 10  # the banner follows the first healthy answer
        while "1 decode + 1 prefill" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        texts = []
        for n in (700, 40, 900):
            tokens = [(i * 11 + n) % 1800 + 20 for i in range(n)]
            out = client.completions.create(model="kvmesh-tiny", prompt=tokens, max_tokens=8, extra_body={"ignore_eos": True})
            assert out.choices[0].finish_reason == "length"
            texts.append(out.choices[0].text)
        client.close()
        workers = httpx.get(server.url + "/admin/workers").json()["workers"]
        assert len(workers) == 1  # the prefill worker is not routed to
        s = asyncio.run(stats(workers[0]["address"], RUN_SECRET))
        assert (s.mode, s.remote_prefills, s.local_prefills) == ("decode", 2, 1), s
        assert s.kv_bytes_received == (44 + 57) * 16 * 4096  # blocks written (699 and 899 tokens), modelled bytes
    assert len(set(texts)) == 3


def test_hf_engine_disaggregated_gives_the_aggregated_text(tmp_path) -> None:
    """The real model (the hf engine, its KV sized at start) in a prefill and a decode
    worker: every prompt prefilled remotely, its real KV moved over the transfer plane,
    and the greedy text the same as one aggregated worker's."""
    prompts = [
        "def read_config(path):\n    \"\"\"Read a TOML file and return a dict.\"\"\"\n",
        "import os\nimport sys\n\n\nclass Cache:\n    \"\"\"A small LRU cache.\"\"\"\n\n    def",
    ]

    def texts(server) -> list[str]:  # type: ignore[no-untyped-def]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        try:
            return [
                client.completions.create(model="kvmesh-tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in prompts
            ]
        finally:
            client.close()

    hf = ("--engine", "hf", "--device", "cpu", "--hf-threads", "1", "--canary-interval", "0")
    with kvmesh_run(tmp_path, *hf, workers=1) as server:
        aggregated = texts(server)
    disagg = ("--admin", "--prefill-workers", "1", "--decode-workers", "1", "--max-local-prefill-length", "4")
    with kvmesh_run(tmp_path, *hf, *disagg, workers=1) as server:
        remote = texts(server)
        workers = httpx.get(server.url + "/admin/workers").json()["workers"]
        s = asyncio.run(stats(workers[0]["address"], RUN_SECRET))
    assert (s.mode, s.remote_prefills, s.local_prefills) == ("decode", 2, 0), s
    assert s.kv_bytes_received > 0
    assert remote == aggregated and all(aggregated)
