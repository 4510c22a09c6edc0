"""The hf engine behind DisaggEngine: real fp32 KV goes over the TCP KV connector
from a prefill worker into the decode worker's blocks (a prefix hit read back from the
decode worker first), and the greedy tokens equal an aggregated run."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvmesh.disagg.engine import DisaggEngine  # noqa: E402
from kvmesh.disagg.prefill import KvMetadataCache, PrefillWorker  # noqa: E402
from kvmesh.disagg.queue import LocalPrefillQueue  # noqa: E402
from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector  # noqa: E402
from kvmesh.engines.hf import HfEngine, HfOptions  # noqa: E402
from kvmesh.preprocess.model import bundled_model_path  # noqa: E402
from kvmesh.protocol import DisaggThresholds, PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402
from kvmesh.runtime.context import Context  # noqa: E402


def _engine(worker_id: int) -> HfEngine:
    return HfEngine(HfOptions(str(bundled_model_path()), num_blocks=128, worker_id=worker_id, threads=1, seed=0))


def _request(rid: str, ids: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="kvmesh-tiny", token_ids=ids,
        sampling=SamplingOptions(temperature=0.0), stop=StopConditions(max_tokens=12, ignore_eos=True),
    )  # fmt: skip


async def _tokens(engine, request: PreprocessedRequest) -> list[int]:
    return [t async for c in engine.generate(request, Context(request.request_id)) for t in c.token_ids]


async def test_remote_prefill_moves_real_kv_and_keeps_greedy_tokens():
    first = [(i * 37) % 1900 + 10 for i in range(150)]
    second = first[:64] + [(i * 11) % 1900 + 10 for i in range(90)]  # 4 blocks in common
    aggregated = _engine(99)
    await aggregated.start()
    try:
        expected = [await _tokens(aggregated, _request(f"agg{i}", ids)) for i, ids in enumerate((first, second))]
    finally:
        await aggregated.cleanup()

    queue = LocalPrefillQueue(DisaggThresholds(max_local_prefill_length=0, max_prefill_queue_size=4))
    inner = _engine(1)
    decode = DisaggEngine(inner, worker_id=1, transfer=KvTransferServer(inner), connector=TcpKvConnector(),
                          mode="decode", queue=queue, remote_timeout_s=30.0, thresholds_refresh_s=0.0)  # fmt: skip
    prefill_engine = _engine(10)
    await decode.start()
    await prefill_engine.start()
    endpoint = decode.kv_endpoint

    async def lookup(worker_id: int):  # type: ignore[no-untyped-def]
        return endpoint if worker_id == 1 else None

    worker = PrefillWorker(prefill_engine, queue, TcpKvConnector(), KvMetadataCache(lookup), poll_s=0.02)
    worker.start()
    try:
        got = [await _tokens(decode, _request(f"d{i}", ids)) for i, ids in enumerate((first, second))]
        stats = decode.disagg_stats()
        assert stats.remote_prefills == 2 and stats.remote_fallbacks == 0
        assert worker.stats.prefill_jobs_done == 2
        layout = inner.kv_layout()
        # the second prompt reused 4 cached blocks: only its other blocks travelled
        assert stats.kv_bytes_received == (10 + 6) * layout.bytes_per_block
    finally:
        await worker.stop()
        await prefill_engine.cleanup()
        await decode.cleanup()
    assert got == expected
