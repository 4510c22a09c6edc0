"""`kvmesh run --prefill-workers 1 --decode-workers 1`: embedded disaggregation (the
prefill queue lives in the run process; no etcd, no NATS), through the openai client."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import openai
import pytest

from kvmesh.protocol import DisaggStats
from kvmesh.runtime.distributed import call
from kvmesh.runtime.names import DISAGG_STATS
from kvmesh.runtime.tcp_client import TcpClient
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]


async def stats(address: str) -> DisaggStats:
    client = TcpClient(address)
    try:
        return await call(client, DISAGG_STATS, decode=msgspec.msgpack.Decoder(DisaggStats).decode)
    finally:
        await client.close()


def test_embedded_prefill_and_decode_workers(tmp_path) -> None:
    args = ("--prefill-workers", "1", "--decode-workers", "1", "--max-local-prefill-length", "300", "--canary-interval", "0")
    with kvmesh_run(tmp_path, *args, workers=1, speedup="50") as server:
        assert "1 decode + 1 prefill" in server.log()
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
        s = asyncio.run(stats(workers[0]["address"]))
        assert (s.mode, s.remote_prefills, s.local_prefills) == ("decode", 2, 1), s
        assert s.kv_bytes_received == (44 + 57) * 16 * 4096  # blocks written (699 and 899 tokens), modelled bytes
    assert len(set(texts)) == 3
