"""A prefix from a peer with the hf engine's real fp32 KV (issue 33): worker B reads the
blocks worker A computed over the KV-transfer plane and its greedy tokens equal a plain
prefill's; the same DisaggEngine path as the mocker's, nothing hf-specific."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("torch")

from kvmesh.disagg.engine import DisaggEngine  # noqa: E402
from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector  # noqa: E402
from kvmesh.engines.hf import HfEngine, HfOptions  # noqa: E402
from kvmesh.preprocess.model import bundled_model_path  # noqa: E402
from kvmesh.protocol import PeerPrefix, PreprocessedRequest, RoutingHints, SamplingOptions, StopConditions  # noqa: E402
from kvmesh.runtime.context import Context  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _engine(worker_id: int) -> HfEngine:
    return HfEngine(HfOptions(str(bundled_model_path()), num_blocks=128, worker_id=worker_id, threads=1, seed=0))


def _front(worker_id: int) -> DisaggEngine:
    inner = _engine(worker_id)
    server = KvTransferServer(inner, serve_prefixes=True, secret=None, tls=None)
    return DisaggEngine(inner, worker_id=worker_id, transfer=server, connector=TcpKvConnector(secret=None, tls=None))


def _request(rid: str, ids: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="kvmesh-tiny", token_ids=ids,
        sampling=SamplingOptions(temperature=0.0), stop=StopConditions(max_tokens=12, ignore_eos=True),
    )  # fmt: skip


async def _run(engine, request: PreprocessedRequest) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    out: list[int] = []
    cached = 0
    async for c in engine.generate(request, Context(request.request_id)):
        out += c.token_ids
        if c.usage is not None:
            cached = c.usage.cached_tokens
    return out, cached


async def test_b_reads_real_kv_from_a_and_keeps_greedy_tokens() -> None:
    prefix = [(i * 37) % 1900 + 10 for i in range(96)]  # 6 blocks of 16
    prompt = prefix + [(i * 11) % 1900 + 10 for i in range(20)]
    plain = _engine(99)
    await plain.start()
    try:
        expected, _ = await _run(plain, _request("plain", prompt))
    finally:
        await plain.cleanup()
    a, b = _front(1), _front(2)
    await a.start()
    await b.start()
    try:
        await _run(a, _request("warm", prefix + [7, 8, 9]))
        kv = a.kv_endpoint
        assert kv is not None
        hinted = msgspec.structs.replace(_request("r", prompt), routing=RoutingHints(peer=PeerPrefix(1, kv, 6)))
        got, cached = await _run(b, hinted)
        assert got == expected
        assert cached == 96
        stats = b.disagg_stats()
        assert (stats.peer_fetches, stats.peer_fetch_blocks) == (1, 6)
        assert stats.kv_bytes_received == 6 * kv.layout.bytes_per_block
    finally:
        await b.cleanup()
        await a.cleanup()
