"""Fault injection on a real MockerEngine: crash (injected exit), hang, slow, corrupt;
when faults fire; switching at start and at run time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.engines.mocker.faults import FaultInjector, FaultSpec, corrupt_token
from kvmesh.engines.mocker.scheduler import StepOutput
from kvmesh.errors import EngineShutdown
from kvmesh.protocol import OutputChunk, PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.runtime.context import Context

FAST = MockerOptions(speedup=1e9)


def req(rid: str = "r", max_tokens: int = 16, seed: int = 5) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="mock",
        token_ids=list(range(40)),
        sampling=SamplingOptions(seed=seed),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


async def run(engine: MockerEngine, request: PreprocessedRequest) -> tuple[list[int], OutputChunk]:
    tokens: list[int] = []
    last: OutputChunk | None = None
    async for chunk in engine.generate(request, Context(request.request_id)):
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None and last.is_terminal
    return tokens, last


async def tokens_with(options: MockerOptions, request: PreprocessedRequest | None = None) -> list[int]:
    engine = MockerEngine(options)
    await engine.start()
    try:
        tokens, last = await run(engine, request or req())
    finally:
        await engine.cleanup()
    assert last.finish_reason == "length"
    return tokens


class ExitRecorder:
    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


# ---------------------------------------------------------------------------- spec


def test_spec_defaults_and_validation() -> None:
    spec = FaultSpec()
    assert (spec.kind, spec.factor, spec.after_tokens, spec.probability, spec.seed) == ("none", 1.0, 0, 1.0, 0)
    assert not spec.active and FaultSpec("hang").active
    assert MockerOptions().fault == FaultSpec()
    for bad in ({"kind": "explode"}, {"factor": 0.0}, {"after_tokens": -1}, {"probability": 1.5}):
        with pytest.raises(ValueError):
            FaultSpec(**bad)  # type: ignore[arg-type]


def test_spec_parse() -> None:
    assert FaultSpec.parse("crash") == FaultSpec("crash")
    assert FaultSpec.parse("slow:factor=4") == FaultSpec("slow", factor=4.0)
    spec = FaultSpec.parse(" corrupt:after_tokens=10, probability=0.5,seed=7 ")
    assert spec == FaultSpec("corrupt", after_tokens=10, probability=0.5, seed=7)
    for bad in ("melt", "slow:speed=2", "slow:factor", "slow:factor=x"):
        with pytest.raises(ValueError):
            FaultSpec.parse(bad)


def test_corrupt_token_differs_and_is_deterministic() -> None:
    for token in (0, 1, 2046, 2047):
        for seed in (0, 1, 99):
            bad = corrupt_token(token, seed, 2048)
            assert bad != token and 0 <= bad < 2048 and bad == corrupt_token(token, seed, 2048)


async def test_injector_scales_step_duration() -> None:
    injector = FaultInjector(FaultSpec("slow", factor=3.0), vocab_size=2048)
    out = await injector.apply(StepOutput(tokens={1: 5}, duration_ms=2.0))
    assert out.duration_ms == 6.0 and out.tokens == {1: 5}


# ---------------------------------------------------------------------------- engine


async def test_no_fault_holds_no_injector() -> None:
    engine = MockerEngine(FAST)
    assert engine.fault == FaultSpec() and engine._fault is None
    engine.set_fault(FaultSpec("slow", factor=2.0))
    assert engine.fault.kind == "slow"
    engine.set_fault(FaultSpec())
    assert engine._fault is None


async def test_corrupt_replaces_every_token_deterministically() -> None:
    clean = await tokens_with(FAST)
    bad = await tokens_with(MockerOptions(speedup=1e9, fault=FaultSpec("corrupt", seed=3)))
    assert len(bad) == len(clean) == 16
    assert all(b != c for b, c in zip(bad, clean, strict=True))
    assert bad == await tokens_with(MockerOptions(speedup=1e9, fault=FaultSpec("corrupt", seed=3)))


async def test_corrupt_after_tokens() -> None:
    clean = await tokens_with(FAST)
    bad = await tokens_with(MockerOptions(speedup=1e9, fault=FaultSpec("corrupt", after_tokens=4)))
    assert bad[:4] == clean[:4]
    assert all(b != c for b, c in zip(bad[4:], clean[4:], strict=True))


async def test_corrupt_with_probability_is_intermittent_and_repeatable() -> None:
    clean = await tokens_with(FAST, req(max_tokens=64))
    opts = MockerOptions(speedup=1e9, fault=FaultSpec("corrupt", probability=0.5, seed=11))
    bad = await tokens_with(opts, req(max_tokens=64))
    changed = sum(b != c for b, c in zip(bad, clean, strict=True))
    assert 0 < changed < 64
    assert bad == await tokens_with(opts, req(max_tokens=64))


async def test_slow_multiplies_step_latency() -> None:
    # about 5.7 ms of modelled decode per step at low KV usage; speedup 10 → ~0.6 ms
    opts = MockerOptions(speedup=10.0)
    t0 = time.perf_counter()
    clean = await tokens_with(opts, req(max_tokens=20))
    clean_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    slow = await tokens_with(MockerOptions(speedup=10.0, fault=FaultSpec("slow", factor=20.0)), req(max_tokens=20))
    slow_s = time.perf_counter() - t0
    assert slow == clean  # slower, not different
    assert slow_s >= 20 * 0.57 * 20 / 1000 * 0.9  # the paced sleeps alone take this long
    assert slow_s > clean_s


async def test_hang_stalls_streams_without_closing_until_cleared() -> None:
    clean = await tokens_with(FAST, req(max_tokens=12))
    engine = MockerEngine(MockerOptions(speedup=1e9, fault=FaultSpec("hang", after_tokens=3)))
    await engine.start()
    try:
        stream: AsyncIterator[OutputChunk] = engine.generate(req(max_tokens=12), Context("r"))
        got: list[int] = []
        while len(got) < 3:
            got.extend((await anext(stream)).token_ids)
        pending = asyncio.ensure_future(anext(stream))
        done, _ = await asyncio.wait({pending}, timeout=0.1)
        assert not done  # no chunk, no terminal: the stream is open and silent
        engine.set_fault(FaultSpec())
        chunk = await asyncio.wait_for(pending, 5.0)
        got.extend(chunk.token_ids)
        async for chunk in stream:
            got.extend(chunk.token_ids)
        assert got == clean and chunk.finish_reason == "length"
    finally:
        await engine.cleanup()


async def test_a_hung_stream_can_still_be_cancelled() -> None:
    engine = MockerEngine(MockerOptions(speedup=1e9, fault=FaultSpec("hang")))
    await engine.start()
    try:
        ctx = Context("r")
        stream = engine.generate(req(), ctx)
        pending = asyncio.ensure_future(anext(stream))
        done, _ = await asyncio.wait({pending}, timeout=0.05)
        assert not done
        ctx.stop_generating()
        chunk = await asyncio.wait_for(pending, 5.0)
        assert chunk.finish_reason == "cancelled"
        await stream.aclose()
    finally:
        await engine.cleanup()


async def test_crash_calls_exit_and_the_engine_dies() -> None:
    recorder = ExitRecorder()
    engine = MockerEngine(MockerOptions(speedup=1e9, fault=FaultSpec("crash", after_tokens=2)), exit_fn=recorder)
    await engine.start()
    try:
        got: list[int] = []
        with pytest.raises(EngineShutdown, match="crash"):
            async for chunk in engine.generate(req(), Context("r")):
                got.extend(chunk.token_ids)
        assert recorder.codes == [1]
        assert len(got) <= 2  # tokens not yet taken when the engine died are lost
        with pytest.raises(EngineShutdown):
            await run(engine, req("r2"))
    finally:
        await engine.cleanup()


async def test_faults_switch_at_run_time() -> None:
    recorder = ExitRecorder()
    engine = MockerEngine(FAST, exit_fn=recorder)
    await engine.start()
    try:
        clean, _ = await run(engine, req("a"))
        engine.set_fault(FaultSpec("corrupt"))
        bad, _ = await run(engine, req("b"))
        assert all(b != c for b, c in zip(bad, clean, strict=True))
        engine.set_fault(FaultSpec())
        assert (await run(engine, req("c")))[0] == clean
        engine.set_fault(FaultSpec("crash"))
        with pytest.raises(EngineShutdown):
            await run(engine, req("d"))
        assert recorder.codes == [1]
    finally:
        await engine.cleanup()
