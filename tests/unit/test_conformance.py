"""The conformance kit passes the sample engine and fails each broken engine with the
failure named after the check it breaks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvmesh.engines.sample import EchoEngine
from kvmesh.protocol import EngineConfig, OutputChunk, PreprocessedRequest
from kvmesh.runtime.context import Context
from kvmesh.testing import (
    CHECKS,
    CancellationIgnored,
    CancellationNotObserved,
    ChunkAfterTerminal,
    CleanupWithoutStartFailed,
    ConcurrentGenerateFailed,
    ConformanceFailure,
    EmptyModelInConfig,
    NoTerminalChunk,
    SecondCleanupFailed,
    cancelling_context,
    default_request,
    mock_context,
    run_conformance,
)

# ---------------------------------------------------------------------------- broken engines
# Each breaks exactly one check and passes every check before it.


class EmptyModelEngine(EchoEngine):
    async def start(self) -> EngineConfig:
        config = await super().start()
        return msgspec.structs.replace(config, model="")


class NoTerminalEngine(EchoEngine):
    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        for i in range(3):
            yield OutputChunk(token_ids=[i])


class ChunkAfterTerminalEngine(EchoEngine):
    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        yield OutputChunk(token_ids=[1])
        yield OutputChunk.length([2])
        yield OutputChunk(token_ids=[3])


class SingleSlotEngine(EchoEngine):
    """Serves one request at a time; a second concurrent one gets an error terminal."""

    def __init__(self) -> None:
        super().__init__()
        self._busy = False

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        if self._busy:
            yield OutputChunk.failed("engine busy")
            return
        self._busy = True
        try:
            async for chunk in super().generate(request, ctx):
                yield chunk
        finally:
            self._busy = False


class HangsOnCancelEngine(EchoEngine):
    """Drops a stopped request from its 'scheduler', and its stream waits forever."""

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        async for chunk in super().generate(request, ctx):
            if chunk.finish_reason == "cancelled":
                await asyncio.Event().wait()
            yield chunk


class IgnoresCancelEngine(EchoEngine):
    """Never looks at the context: a stopped request runs to max_tokens."""

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        async for chunk in super().generate(request, mock_context()):
            yield chunk


class _Pool:
    def close(self) -> None:
        pass


class CloseOnceEngine(EchoEngine):
    """cleanup() closes a handle and forgets it; a second cleanup() trips over None."""

    def __init__(self) -> None:
        super().__init__()
        self._pool: _Pool | None = _Pool()

    async def cleanup(self) -> None:
        self._pool.close()  # type: ignore[union-attr]
        self._pool = None


class NeedsStartEngine(EchoEngine):
    """cleanup() assumes start() allocated its blocks."""

    async def start(self) -> EngineConfig:
        self._blocks: dict[int, bytes] = {}
        return await super().start()

    async def cleanup(self) -> None:
        self._blocks.clear()


class AbortRecordingEngine(EchoEngine):
    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []
        self.request_ids: list[str] = []

    async def abort(self, ctx: Context) -> None:
        self.aborted.append(ctx.id)

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        self.request_ids.append(request.request_id)
        async for chunk in super().generate(request, ctx):
            yield chunk


# ---------------------------------------------------------------------------- the kit


async def test_echo_engine_passes_every_check() -> None:
    assert await run_conformance(EchoEngine) == [check.name for check in CHECKS]


@pytest.mark.parametrize(
    ("engine", "failure", "says"),
    [
        (EmptyModelEngine, EmptyModelInConfig, "model=''"),
        (NoTerminalEngine, NoTerminalChunk, "ended after 3 chunk(s) without a terminal chunk"),
        (ChunkAfterTerminalEngine, ChunkAfterTerminal, "1 chunk(s) after its terminal"),
        (SingleSlotEngine, ConcurrentGenerateFailed, "3 of 4 concurrent SingleSlotEngine.generate() calls failed"),
        (HangsOnCancelEngine, CancellationNotObserved, "still streaming 2 s after ctx.stop_generating()"),
        (IgnoresCancelEngine, CancellationIgnored, "finish_reason='length'"),
        (CloseOnceEngine, SecondCleanupFailed, "cleanup() called a second time raised AttributeError"),
        (NeedsStartEngine, CleanupWithoutStartFailed, "never-started engine raised AttributeError"),
    ],
)
async def test_each_broken_engine_fails_its_check(
    engine: type[EchoEngine], failure: type[ConformanceFailure], says: str
) -> None:
    with pytest.raises(failure) as info:
        await run_conformance(engine)
    assert type(info.value) is failure
    assert says in str(info.value)
    assert engine.__name__ in str(info.value)


def test_every_check_has_its_own_failure() -> None:
    assert len(CHECKS) == 8
    assert len({check.failure for check in CHECKS}) == 8
    for check in CHECKS:
        assert check.failure.check == check.name
        assert issubclass(check.failure, AssertionError)


async def test_error_terminal_is_not_a_normal_end() -> None:
    class Failing(EchoEngine):
        async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
            yield OutputChunk.failed("out of blocks")

    with pytest.raises(NoTerminalChunk, match="finish_reason='error', error='out of blocks'"):
        await run_conformance(Failing)


async def test_raised_error_is_reported_with_its_type() -> None:
    class Raising(EchoEngine):
        async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
            yield OutputChunk(token_ids=[1])
            raise RuntimeError("kernel crashed")

    with pytest.raises(NoTerminalChunk, match="raised RuntimeError\\('kernel crashed'\\) after 1 chunk"):
        await run_conformance(Raising)


async def test_hung_start_fails_instead_of_hanging() -> None:
    class HungStart(EchoEngine):
        async def start(self) -> EngineConfig:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    with pytest.raises(EmptyModelInConfig, match="start\\(\\) did not return within 0.1 s"):
        await run_conformance(HungStart, timeout_s=0.1)


async def test_hung_stream_fails_instead_of_hanging() -> None:
    class HungStream(EchoEngine):
        async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
            yield OutputChunk(token_ids=[1])
            await asyncio.Event().wait()

    with pytest.raises(NoTerminalChunk, match="no terminal before the deadline \\(1 chunk"):
        await run_conformance(HungStream, timeout_s=0.1)


async def test_factory_error_fails_the_first_check() -> None:
    def factory() -> EchoEngine:
        raise OSError("no such model")

    with pytest.raises(EmptyModelInConfig, match="engine_factory\\(\\) raised OSError"):
        await run_conformance(factory)


async def test_streams_run_under_an_abort_monitor_with_distinct_ids() -> None:
    engines: list[AbortRecordingEngine] = []

    def factory() -> AbortRecordingEngine:
        engines.append(AbortRecordingEngine())
        return engines[-1]

    await run_conformance(factory, checks=["concurrent_generate", "cancellation_terminal"])
    concurrent, cancelled = engines
    assert len(set(concurrent.request_ids)) == 4
    assert concurrent.aborted == []
    assert cancelled.aborted == cancelled.request_ids


async def test_one_named_check_runs_alone() -> None:
    # A broken start() does not matter to the check that never starts the engine.
    assert await run_conformance(EmptyModelEngine, checks=["cleanup_without_start"]) == ["cleanup_without_start"]
    with pytest.raises(CancellationIgnored):
        await run_conformance(IgnoresCancelEngine, checks=["cancellation_terminal"])


async def test_custom_request_is_used() -> None:
    engines: list[AbortRecordingEngine] = []

    def factory() -> AbortRecordingEngine:
        engines.append(AbortRecordingEngine())
        return engines[-1]

    request = default_request(16, model="echo", request_id="mine")
    await run_conformance(factory, request=request, checks=["single_generate"])
    assert engines[0].request_ids[0].startswith("mine-0-")


async def test_a_request_too_short_to_cancel_is_reported() -> None:
    class OneShot(EchoEngine):
        async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
            yield OutputChunk.length([1, 2, 3])

    with pytest.raises(CancellationNotObserved, match="first chunk was already its terminal"):
        await run_conformance(OneShot, checks=["cancellation_observed"])


async def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown conformance checks \\['nope'\\]"):
        await run_conformance(EchoEngine, checks=["nope"])
    with pytest.raises(ValueError, match="timeout_s"):
        await run_conformance(EchoEngine, timeout_s=0)
    with pytest.raises(ValueError, match="max_tokens"):
        default_request(1)


# ---------------------------------------------------------------------------- helpers


def test_default_request_streams_long_enough_to_cancel() -> None:
    request = default_request()
    assert request.stop.max_tokens == 64
    assert request.stop.ignore_eos
    assert 0 < len(request.token_ids) <= 16
    assert default_request().request_id != request.request_id


def test_mock_context_is_live() -> None:
    ctx = mock_context("req-1")
    assert ctx.id == "req-1"
    assert not ctx.is_stopped() and not ctx.is_killed()
    assert mock_context().id != mock_context().id


async def test_cancelling_context_stops_itself() -> None:
    ctx = cancelling_context(0.01)
    assert not ctx.is_stopped()
    await asyncio.wait_for(ctx.stopped(), 1.0)
    assert ctx.is_stopped() and not ctx.is_killed()


async def test_cancelling_context_timer_can_be_dropped() -> None:
    with cancelling_context(0.01) as ctx:
        pass
    await asyncio.sleep(0.03)
    assert not ctx.is_stopped()


async def test_cancelling_context_drops_its_timer_when_stopped_early() -> None:
    ctx = cancelling_context(60)
    ctx.stop_generating()
    assert ctx._timer.cancelled()


async def test_cancelling_context_cancels_an_engine_mid_stream() -> None:
    engine = EchoEngine(step_delay_s=0.005)
    await engine.start()
    with cancelling_context(0.03) as ctx:
        chunks = [chunk async for chunk in engine.generate(default_request(), ctx)]
    await engine.cleanup()
    assert chunks[-1].finish_reason == "cancelled"
    assert 1 <= len(chunks) - 1 < 64


async def test_cancelling_context_rejects_negative_delay() -> None:
    with pytest.raises(ValueError):
        cancelling_context(-1)
