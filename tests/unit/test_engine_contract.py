"""The stream validator, run_generate, the abort monitor, and Context semantics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from kvmesh.engines.adapter import AbortMonitor, StreamContractError, run_generate, validated
from kvmesh.engines.sample import EchoEngine
from kvmesh.errors import InvalidArgument, StreamIncomplete
from kvmesh.protocol import OutputChunk, PreprocessedRequest
from kvmesh.runtime.context import Context
from kvmesh.testing import default_request


async def _stream(*items: OutputChunk | Exception) -> AsyncIterator[OutputChunk]:
    for item in items:
        await asyncio.sleep(0)
        if isinstance(item, Exception):
            raise item
        yield item


async def _collect(stream: AsyncIterator[OutputChunk]) -> list[OutputChunk]:
    return [chunk async for chunk in stream]


class ScriptedEngine(EchoEngine):
    """Yields (or raises) a fixed script and records abort calls."""

    def __init__(self, *script: OutputChunk | Exception) -> None:
        super().__init__()
        self.script = script
        self.aborted: list[str] = []

    def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        return _stream(*self.script)

    async def abort(self, ctx: Context) -> None:
        self.aborted.append(ctx.id)


# ---------------------------------------------------------------------------- validated()


async def test_validated_passes_a_good_stream() -> None:
    items = [OutputChunk(token_ids=[1]), OutputChunk.stop([2])]
    assert await _collect(validated(_stream(*items))) == items


async def test_validated_rejects_a_chunk_after_the_terminal() -> None:
    stream = validated(_stream(OutputChunk.length([1]), OutputChunk(token_ids=[2])), "Bad")
    with pytest.raises(StreamContractError, match="Bad yielded a chunk after the terminal"):
        await _collect(stream)


async def test_validated_rejects_a_stream_without_a_terminal() -> None:
    with pytest.raises(StreamContractError, match="without a terminal chunk"):
        await _collect(validated(_stream(OutputChunk(token_ids=[1]))))


async def test_validated_lets_a_typed_error_through_as_the_terminal() -> None:
    with pytest.raises(InvalidArgument):
        await _collect(validated(_stream(OutputChunk(token_ids=[1]), InvalidArgument("bad"))))


# ---------------------------------------------------------------------------- run_generate()


async def test_run_generate_raises_stream_incomplete_without_a_terminal() -> None:
    engine = ScriptedEngine(OutputChunk(token_ids=[1]), OutputChunk(token_ids=[2]))
    monitor = AbortMonitor(engine)
    stream = run_generate(engine, default_request(), Context("r"), monitor)
    seen: list[OutputChunk] = []
    with pytest.raises(StreamIncomplete, match="ScriptedEngine stream ended without a terminal"):
        async for chunk in stream:
            seen.append(chunk)
    assert len(seen) == 2
    await monitor.close()


async def test_run_generate_passes_terminal_and_typed_errors() -> None:
    ok = ScriptedEngine(OutputChunk(token_ids=[1]), OutputChunk.stop())
    monitor = AbortMonitor(ok)
    chunks = await _collect(run_generate(ok, default_request(), Context("r"), monitor))
    assert chunks[-1].finish_reason == "stop"

    failing = ScriptedEngine(OutputChunk(token_ids=[1]), InvalidArgument("too long"))
    with pytest.raises(InvalidArgument):
        await _collect(run_generate(failing, default_request(), Context("r"), AbortMonitor(failing)))
    await monitor.close()


async def test_run_generate_with_validation_rejects_a_chunk_after_terminal() -> None:
    engine = ScriptedEngine(OutputChunk.stop(), OutputChunk(token_ids=[1]))
    monitor = AbortMonitor(engine)
    with pytest.raises(StreamContractError, match="ScriptedEngine yielded a chunk after the terminal"):
        await _collect(run_generate(engine, default_request(), Context("r"), monitor, validate=True))
    await monitor.close()


# ---------------------------------------------------------------------------- AbortMonitor


async def test_abort_monitor_aborts_once_when_the_context_stops() -> None:
    engine = ScriptedEngine()
    monitor = AbortMonitor(engine)
    ctx = Context("r1")
    monitor.watch(ctx)
    await asyncio.sleep(0)
    assert engine.aborted == []
    ctx.stop_generating()
    ctx.stop_generating()
    ctx.kill()
    await asyncio.sleep(0)
    await monitor.close()
    assert engine.aborted == ["r1"]


async def test_abort_monitor_aborts_on_kill_and_on_an_already_stopped_context() -> None:
    engine = ScriptedEngine()
    monitor = AbortMonitor(engine)
    killed, stopped = Context("killed"), Context("stopped")
    monitor.watch(killed)
    killed.kill()
    stopped.stop_generating()
    monitor.watch(stopped)
    await asyncio.sleep(0)
    await monitor.close()
    assert engine.aborted == ["killed", "stopped"]


async def test_run_generate_aborts_a_stream_whose_context_stops() -> None:
    class RecordingEcho(EchoEngine):
        def __init__(self) -> None:
            super().__init__()
            self.aborted: list[str] = []

        async def abort(self, ctx: Context) -> None:
            self.aborted.append(ctx.id)

    engine = RecordingEcho()
    monitor = AbortMonitor(engine)
    ctx = Context("live")
    seen: list[OutputChunk] = []
    async for chunk in run_generate(engine, default_request(), ctx, monitor):
        seen.append(chunk)
        if len(seen) == 2:
            ctx.stop_generating()
    # NOTE: close() cancels abort tasks that have not started; let the pending one run.
    await asyncio.sleep(0)
    await monitor.close()
    assert seen[-1].finish_reason == "cancelled"
    assert len(seen) == 3
    assert engine.aborted == ["live"]


async def test_abort_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    class BadAbort(EchoEngine):
        async def abort(self, ctx: Context) -> None:
            raise RuntimeError("abort exploded")

    monitor = AbortMonitor(BadAbort())
    ctx = Context("r")
    monitor.watch(ctx)
    with caplog.at_level(logging.ERROR, logger="kvmesh.engines.adapter"):
        ctx.stop_generating()
        await asyncio.sleep(0)
        await monitor.close()
    assert "engine.abort failed for r" in caplog.text


async def test_abort_monitor_close_cancels_a_hung_abort() -> None:
    class HungAbort(EchoEngine):
        async def abort(self, ctx: Context) -> None:
            await asyncio.Event().wait()

    monitor = AbortMonitor(HungAbort())
    ctx = Context("r")
    monitor.watch(ctx)
    ctx.stop_generating()
    await asyncio.sleep(0)
    await asyncio.wait_for(monitor.close(grace_s=0.1), 1.0)


# ---------------------------------------------------------------------------- Context


def test_stop_is_idempotent_and_runs_callbacks_once() -> None:
    ctx = Context("r")
    calls: list[Context] = []
    ctx.on_stop(calls.append)
    ctx.stop_generating()
    ctx.stop_generating()
    assert ctx.is_stopped() and not ctx.is_killed()
    assert calls == [ctx]


def test_kill_implies_stop() -> None:
    ctx = Context("r")
    calls: list[Context] = []
    ctx.on_stop(calls.append)
    ctx.kill()
    ctx.kill()
    assert ctx.is_killed() and ctx.is_stopped()
    assert calls == [ctx]


def test_kill_after_stop_marks_killed() -> None:
    ctx = Context("r")
    ctx.stop_generating()
    ctx.kill()
    assert ctx.is_killed()


def test_on_stop_after_stop_fires_immediately() -> None:
    ctx = Context("r")
    ctx.stop_generating()
    calls: list[Context] = []
    ctx.on_stop(calls.append)
    assert calls == [ctx]


async def test_stopped_wakes_every_waiter() -> None:
    ctx = Context("r")
    waiters = [asyncio.create_task(ctx.stopped()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    ctx.stop_generating()
    await asyncio.wait_for(asyncio.gather(*waiters), 1.0)


async def test_stopped_returns_at_once_when_already_stopped_or_killed() -> None:
    ctx = Context("r")
    ctx.kill()
    await asyncio.wait_for(ctx.stopped(), 0.1)


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    ctx = Context("r")
    waiter = asyncio.create_task(ctx.stopped())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not ctx._waiters
    ctx.stop_generating()
    assert ctx.is_stopped()


def test_repr_shows_state() -> None:
    ctx = Context("r")
    assert repr(ctx) == "Context('r', live)"
    ctx.stop_generating()
    assert repr(ctx) == "Context('r', stopped)"
    ctx.kill()
    assert repr(ctx) == "Context('r', killed)"
