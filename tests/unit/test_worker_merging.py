"""The worker's generate endpoint: a batching engine's streams are read once per write
(``StreamServer.merging``): the same tokens, in the same order, with the same end, in
fewer chunks; a malformed request is a clear error."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvmesh.engines.mocker.engine import MockerEngine
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.sample import EchoEngine
from kvmesh.errors import InvalidArgument
from kvmesh.protocol import OutputChunk, PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.runtime import frames
from kvmesh.runtime.context import Context
from kvmesh.runtime.names import GENERATE
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer
from kvmesh.worker.service import WorkerService

pytestmark = pytest.mark.timeout(60)

STREAMS, TOKENS = 8, 64


def _request(i: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=f"r{i}",
        model="mock",
        token_ids=list(range(100 + i, 228 + i)),
        stop=StopConditions(max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True),
        sampling=SamplingOptions(seed=i),
    )


async def _chunks(client: TcpClient, i: int) -> list[OutputChunk]:
    payload = msgspec.msgpack.encode(_request(i))
    return [msgspec.msgpack.decode(raw, type=OutputChunk) async for raw in client.stream(GENERATE, payload, Context(f"t{i}"))]


async def _serve_all(merging: bool) -> list[list[OutputChunk]]:
    engine = MockerEngine(MockerOptions(worker_id=1, speedup=1e9, num_blocks=512, vocab_size=2048, eos_token_ids=(2,)))
    service = WorkerService(engine)
    await service.start()
    assert isinstance(service.server, TcpServer) and GENERATE in service.server.merging
    if not merging:
        service.server.merging.discard(GENERATE)
    client = TcpClient(service.address)
    try:
        return list(await asyncio.gather(*(_chunks(client, i) for i in range(STREAMS))))
    finally:
        await client.close()
        await service.shutdown(grace_s=1)


async def test_a_batching_engines_streams_are_merged_per_write_and_lose_nothing(monkeypatch):
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)  # windows of COALESCE_ROUNDS iterations, however slow the box
    merged, plain = await _serve_all(True), await _serve_all(False)
    for m, p in zip(merged, plain):
        tokens = [t for c in m for t in c.token_ids]
        assert len(tokens) == TOKENS and tokens == [t for c in p for t in c.token_ids]
        assert (m[-1].finish_reason, m[-1].usage) == (p[-1].finish_reason, p[-1].usage)
        assert len(m[0].token_ids) == 1  # the first token is not held
    assert sum(map(len, merged)) <= STREAMS * TOKENS / 3 < sum(map(len, plain))


async def test_an_engine_that_may_not_merge_is_read_per_item():
    service = WorkerService(EchoEngine(step_delay_s=0))
    await service.start()
    try:
        assert isinstance(service.server, TcpServer) and GENERATE not in service.server.merging
    finally:
        await service.shutdown(grace_s=1)


async def test_a_malformed_generate_request_is_invalid_argument():
    service = WorkerService(EchoEngine(step_delay_s=0))
    await service.start()
    client = TcpClient(service.address)
    try:
        with pytest.raises(InvalidArgument, match="malformed generate request"):
            [raw async for raw in client.stream(GENERATE, msgspec.msgpack.encode({"not": "a request"}), Context("t"))]
    finally:
        await client.close()
        await service.shutdown(grace_s=1)
