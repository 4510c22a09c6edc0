"""The mocker's remote prefill (a prefill worker's job) runs through its batching
scheduler, like the hf engine's: it takes the step budget (a local request waits
behind it), its passes are counted in the load report's batch tokens, its blocks are
held while it computes and given back after, and it answers the tokens' digests."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.engines.mocker.engine import block_digests
from kvmesh.errors import EngineShutdown, InvalidArgument
from kvmesh.protocol import PreprocessedRequest, StopConditions
from kvmesh.runtime.context import Context

pytestmark = pytest.mark.timeout(60)

BS = 16


def _engine(**kw: object) -> MockerEngine:
    opts = dict(speedup=1.0, block_size=BS, num_blocks=512, max_num_batched_tokens=256, vocab_size=2048, context_length=4096)
    opts.update(kw)
    return MockerEngine(MockerOptions(**opts))  # type: ignore[arg-type]


def _request(rid: str, n: int, max_tokens: int = 4) -> PreprocessedRequest:
    tokens = [(i * 7 + len(rid)) % 2000 + 1 for i in range(n)]
    return PreprocessedRequest(rid, "mock", tokens, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))


async def test_a_remote_prefill_takes_the_step_budget_before_a_local_request() -> None:
    engine = _engine()
    await engine.start()
    order: list[str] = []
    try:
        job = _request("remote", 1025)  # 1,024 tokens to prefill: four passes of the 256-token budget

        async def remote() -> bytes:
            data = await engine.prefill_remote(job, b"", 0, 1024)
            order.append("remote prefill done")
            return data

        task = asyncio.create_task(remote())
        await asyncio.sleep(0)  # the job is queued first
        assert engine.scheduler.num_waiting + engine.scheduler.num_running == 1, "the remote prefill is not in the scheduler"
        async for chunk in engine.generate(_request("local", 16), Context("local")):
            if chunk.token_ids:
                order.append("local first token")
                break
        data = await task
        assert order == ["remote prefill done", "local first token"], "the local request did not wait for the remote prefill's passes"
        assert data == b"".join(d.to_bytes(8, "little") for d in block_digests(job.token_ids, 1024, BS))
        assert engine.load_report().batch_tokens > 0  # its passes are the scheduler's
    finally:
        await engine.cleanup()


async def test_a_remote_prefill_holds_its_blocks_while_it_computes_and_gives_them_back() -> None:
    engine = _engine(speedup=1e9)
    await engine.start()
    try:
        job = _request("remote", 161)
        prefix = b"".join(d.to_bytes(8, "little") for d in block_digests(job.token_ids, 32, BS))  # two blocks imported
        task = asyncio.create_task(engine.prefill_remote(job, prefix, 32, 160))
        await asyncio.sleep(0)
        assert engine.active_blocks == 10  # 160 tokens of 16: the prefix's and the computed blocks
        data = await task
        assert len(data) == 8 * 8  # blocks 2..9
        await asyncio.sleep(0)
        assert engine.active_blocks == 0 and engine.scheduler.num_running == 0
    finally:
        await engine.cleanup()


async def test_a_remote_prefill_checks_its_prefix_and_needs_a_running_engine() -> None:
    engine = _engine(speedup=1e9)
    job = _request("remote", 65)
    with pytest.raises(EngineShutdown):
        await engine.prefill_remote(job, b"", 0, 64)
    await engine.start()
    try:
        with pytest.raises(InvalidArgument, match="holds other tokens"):
            await engine.prefill_remote(job, b"\0" * 8, 16, 64)
        assert engine.active_blocks == 0
    finally:
        await engine.cleanup()
