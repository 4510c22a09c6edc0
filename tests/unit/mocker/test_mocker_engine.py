"""MockerEngine behind the Engine contract: conformance, determinism across instances,
migration continuation, cancellation and early close freeing blocks, KV events and
load reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.engines.adapter import validated
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.errors import EngineShutdown
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, OutputChunk, PreprocessedRequest
from kvmesh.protocol import SamplingOptions, StopConditions
from kvmesh.runtime.context import Context
from kvmesh.runtime.events import RecordingPublisher
from kvmesh.testing import run_conformance

FAST = MockerOptions(speedup=1e9)


def req(
    rid: str, tokens: list[int] | range, max_tokens: int = 16, *, seed: int | None = None, ignore_eos: bool = True
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="mock",
        token_ids=list(tokens),
        sampling=SamplingOptions(seed=seed),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )


async def collect(engine: MockerEngine, request: PreprocessedRequest) -> tuple[list[int], OutputChunk]:
    """All tokens of a stream and its terminal, through the contract validator."""
    tokens: list[int] = []
    last: OutputChunk | None = None
    async for chunk in validated(engine.generate(request, Context(request.request_id))):
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None and last.is_terminal
    return tokens, last


async def started(options: MockerOptions = FAST, publisher: RecordingPublisher | None = None) -> MockerEngine:
    engine = MockerEngine(options, publisher)
    await engine.start()
    return engine


def replay(events: list[KvEvent]) -> set[int]:
    cached: set[int] = set()
    for event in events:
        data = event.data
        if isinstance(data, BlockStored):
            cached.update(data.block_hashes)
        elif isinstance(data, BlockRemoved):
            cached.difference_update(data.block_hashes)
        elif isinstance(data, AllBlocksCleared):
            cached.clear()
    return cached


async def test_conformance() -> None:
    assert len(await run_conformance(lambda: MockerEngine(MockerOptions(speedup=100)))) == 8


async def test_start_reports_the_engine_config() -> None:
    opts = MockerOptions(model="m", served_model_name="served", block_size=32, num_blocks=100, max_num_seqs=7)
    engine = MockerEngine(opts)
    try:
        config = await engine.start()
    finally:
        await engine.cleanup()
    assert (config.model, config.served_model_name, config.kv_block_size) == ("m", "served", 32)
    assert (config.total_kv_blocks, config.max_num_seqs) == (100, 7)
    assert (config.context_length, config.max_num_batched_tokens) == (2048, 8192)


async def test_ignore_eos_streams_exactly_max_tokens_with_usage() -> None:
    engine = await started(MockerOptions(speedup=1e9, eos_rate=1.0))
    try:
        tokens, terminal = await collect(engine, req("a", range(40), max_tokens=50))
    finally:
        await engine.cleanup()
    assert len(tokens) == 50 and terminal.finish_reason == "length"
    assert terminal.usage is not None
    assert (terminal.usage.prompt_tokens, terminal.usage.completion_tokens) == (40, 50)


async def test_two_engines_give_the_same_tokens() -> None:
    first = await started(MockerOptions(speedup=1e9))
    second = await started(MockerOptions(speedup=1e9, block_size=4, max_num_batched_tokens=16, worker_id=1))
    requests = [req(f"r{i}", [i] * (10 + i), max_tokens=40, ignore_eos=False) for i in range(6)]
    try:
        a = await asyncio.gather(*(collect(first, r) for r in requests))
        b = await asyncio.gather(*(collect(second, r) for r in reversed(requests)))
    finally:
        await first.cleanup()
        await second.cleanup()
    for (tokens_a, end_a), (tokens_b, end_b) in zip(a, reversed(b)):
        assert tokens_a == tokens_b
        assert end_a.finish_reason == end_b.finish_reason


async def test_migration_continues_the_stream_on_another_engine() -> None:
    original, target = await started(), await started(MockerOptions(speedup=1e9, worker_id=2))
    try:
        full, _ = await collect(original, req("a", range(30), max_tokens=40, seed=1234))
        resumed, terminal = await collect(target, req("a", list(range(30)) + full[:17], max_tokens=23, seed=1234))
    finally:
        await original.cleanup()
        await target.cleanup()
    assert resumed == full[17:]
    assert terminal.finish_reason == "length"


async def test_shared_prompt_reports_cached_tokens() -> None:
    engine = await started()
    try:
        _, first = await collect(engine, req("a", range(64)))
        _, second = await collect(engine, req("b", list(range(48)) + [7] * 20))
    finally:
        await engine.cleanup()
    assert first.usage is not None and first.usage.cached_tokens == 0
    assert second.usage is not None and second.usage.cached_tokens == 48


async def test_cancel_mid_stream_ends_cancelled_and_frees_blocks() -> None:
    engine = await started(MockerOptions(speedup=50))
    assert engine.active_blocks == 0
    ctx = Context("a")
    stream = validated(engine.generate(req("a", range(100), max_tokens=1000), ctx))
    try:
        first = await anext(stream)
        assert not first.is_terminal and engine.active_blocks > 0
        ctx.stop_generating()
        assert engine.active_blocks == 0  # freed at the stop, before the stream resumes
        rest = [chunk async for chunk in stream]
        assert [c.finish_reason for c in rest] == ["cancelled"]
        assert engine.active_blocks == 0
        assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    finally:
        await engine.cleanup()


async def test_already_stopped_context_is_cancelled_at_once() -> None:
    engine = await started()
    ctx = Context("a")
    ctx.stop_generating()
    try:
        chunks = [c async for c in engine.generate(req("a", range(10)), ctx)]
    finally:
        await engine.cleanup()
    assert [c.finish_reason for c in chunks] == ["cancelled"]
    assert engine.active_blocks == 0


async def test_closing_the_stream_early_frees_blocks() -> None:
    engine = await started(MockerOptions(speedup=50))
    try:
        stream = engine.generate(req("a", range(100), max_tokens=1000), Context("a"))
        assert isinstance(stream, AsyncIterator)
        await anext(stream)
        assert engine.active_blocks > 0
        await stream.aclose()  # type: ignore[attr-defined]
        assert engine.active_blocks == 0
        assert not engine.scheduler.has_work
    finally:
        await engine.cleanup()


async def test_lagging_consumer_gets_merged_chunks() -> None:
    engine = await started()
    try:
        stream = engine.generate(req("a", range(10), max_tokens=300), Context("a"))
        chunks = [await anext(stream)]
        await asyncio.sleep(0.05)  # let the step loop run ahead
        chunks.extend([c async for c in stream])
    finally:
        await engine.cleanup()
    assert sum(len(c.token_ids) for c in chunks) == 300
    assert max(len(c.token_ids) for c in chunks) > 1
    assert len(chunks) < 300


async def test_kv_events_and_load_reports_are_published() -> None:
    pub = RecordingPublisher()
    engine = await started(MockerOptions(speedup=1e9, num_blocks=24, worker_id=5), pub)
    try:
        prompts = [[1] * 32 + [i] * (5 + 9 * i) for i in range(8)]
        await asyncio.gather(*(collect(engine, req(f"r{i}", p, max_tokens=30)) for i, p in enumerate(prompts)))
        await asyncio.sleep(0)
    finally:
        await engine.cleanup()
    events = pub.kv_events
    assert isinstance(events[0].data, AllBlocksCleared)  # every start begins with a clean slate
    assert [e.event_id for e in events] == list(range(len(events)))
    assert all(e.worker_id == 5 for e in events)
    assert any(isinstance(e.data, BlockRemoved) for e in events)  # a small pool: evictions happened
    assert replay(events) == set()  # cleanup reset the pool
    assert engine.kv_event_ring.since(-1) == events
    reports = pub.load_reports
    assert any(r.num_running > 0 for r in reports)
    assert all(r.worker_id == 5 and r.total_blocks == 24 for r in reports)


async def test_events_replay_into_the_dump_while_running() -> None:
    pub = RecordingPublisher()
    engine = await started(MockerOptions(speedup=1e9, num_blocks=40), pub)
    try:
        await asyncio.gather(*(collect(engine, req(f"r{i}", [i % 3] * 50, max_tokens=20)) for i in range(10)))
        assert replay(pub.kv_events) == engine.kv_dump() != set()
        assert engine.active_blocks == 0
        assert engine.load_report().active_blocks == 0
    finally:
        await engine.cleanup()


async def test_request_that_never_fits_ends_with_an_error_terminal() -> None:
    engine = await started(MockerOptions(speedup=1e9, block_size=4, num_blocks=4))
    try:
        tokens, terminal = await collect(engine, req("a", range(17)))
    finally:
        await engine.cleanup()
    assert tokens == [] and terminal.finish_reason == "error" and terminal.error


async def test_generate_needs_a_running_engine() -> None:
    engine = MockerEngine(FAST)
    with pytest.raises(EngineShutdown):
        await anext(engine.generate(req("a", range(4)), Context("a")))
    await engine.cleanup()
    await engine.cleanup()


async def test_cleanup_ends_open_streams_with_engine_shutdown() -> None:
    engine = await started(MockerOptions(speedup=10))
    stream = engine.generate(req("a", range(10), max_tokens=10_000), Context("a"))
    await anext(stream)
    await engine.cleanup()
    with pytest.raises(EngineShutdown):
        while True:
            await anext(stream)
    assert engine.active_blocks == 0
    await engine.cleanup()


async def test_engine_restarts_after_cleanup() -> None:
    engine = await started()
    await engine.cleanup()
    await engine.start()
    try:
        tokens, terminal = await collect(engine, req("a", range(10), max_tokens=5))
    finally:
        await engine.cleanup()
    assert len(tokens) == 5 and terminal.finish_reason == "length"
