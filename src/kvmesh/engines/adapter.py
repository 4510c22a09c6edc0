"""What the worker puts around ``engine.generate``: the cancellation monitor and the
debug stream validator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from kvmesh.engines.base import Engine, GenerateFront
from kvmesh.errors import InvalidArgument, KvmeshError, StreamIncomplete
from kvmesh.observability import tracing
from kvmesh.observability.worker_metrics import WorkerCounters
from kvmesh.protocol import OutputChunk, PreprocessedRequest
from kvmesh.runtime.context import Context

__all__ = ["StreamContractError", "validated", "AbortMonitor", "run_generate"]

log = logging.getLogger(__name__)


class StreamContractError(AssertionError):
    """An engine broke the stream contract (a chunk after the terminal, no terminal)."""


async def validated(stream: AsyncIterator[OutputChunk], name: str = "engine") -> AsyncIterator[OutputChunk]:
    """Pass chunks through; raise :class:`StreamContractError` on a contract breach.

    Used in tests and debug runs (``KVMESH_DEBUG=1``). A raised KvmeshError counts as the
    terminal, so it passes through unchanged.
    """
    terminal: OutputChunk | None = None
    try:
        async for chunk in stream:
            if terminal is not None:
                raise StreamContractError(f"{name} yielded a chunk after the terminal {terminal!r}: {chunk!r}")
            if chunk.finish_reason is not None:
                terminal = chunk
            yield chunk
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    if terminal is None:
        raise StreamContractError(f"{name} ended its stream without a terminal chunk")


class AbortMonitor:
    """Calls ``engine.abort(ctx)`` once when a request's context is stopped or killed.

    Owns the abort tasks it starts (strong references, cancelled on :meth:`close`).
    It hooks the context's stop callback instead of running one watcher task per
    request, so a request that is never cancelled costs no task.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._tasks: set[asyncio.Task[None]] = set()

    def watch(self, ctx: Context) -> None:
        ctx.on_stop(self._fire)

    def _fire(self, ctx: Context) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(ctx))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self, ctx: Context) -> None:
        try:
            await self._engine.abort(ctx)
        except Exception:  # noqa: BLE001 - an abort failure must not kill the worker
            log.exception("engine.abort failed for %s", ctx.id)

    async def close(self, grace_s: float = 1.0) -> None:
        """Let pending aborts run (up to ``grace_s``), then cancel what is left."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


@runtime_checkable
class _Roled(Protocol):
    """What generates with a worker role: a disaggregation front (GenerateFront.mode)."""

    mode: str


def _role(source: object) -> str:
    """The worker role in traces: the generating front's, else ``aggregated``."""
    return source.mode if isinstance(source, _Roled) else "aggregated"


async def run_generate(
    engine: Engine,
    request: PreprocessedRequest,
    ctx: Context,
    monitor: AbortMonitor,
    validate: bool = False,
    counters: WorkerCounters | None = None,
    front: GenerateFront | None = None,
) -> AsyncIterator[OutputChunk]:
    """The engine's stream (through ``front`` when the worker has one) with the monitor
    attached (and the validator when asked).

    If the engine's stream ends without a terminal outside validation, a
    :class:`StreamIncomplete` error is raised so the caller always sees one terminal.
    """
    if request.guided is not None and not engine.supports_guided:
        raise InvalidArgument(
            f"the {type(engine).__name__} engine does not support structured outputs (response_format, guided_*, "
            f"forced tool calls); serve the model with --engine hf, mocker or vllm"
        )
    monitor.watch(ctx)
    # tracing: the request's trace id on this task's log lines; the engine.generate span
    # only while spans are recorded (no per-chunk work otherwise)
    tracing.set_log_trace_id(tracing.trace_id_of(request.trace_context))
    span = tracing.GenerateSpan.start(request, _role(front or engine)) if tracing.enabled() else None
    if span is not None:
        tracing.set_current_generate(span)
    if counters is not None:  # the worker's metrics: requests, in flight, tokens at the terminal
        counters.requests += 1
        counters.in_flight += 1
    stream = (front or engine).generate(request, ctx)
    if validate:
        stream = validated(stream, type(engine).__name__)
    finished = False
    try:
        async for chunk in stream:
            if chunk.finish_reason is not None:
                finished = True
                if counters is not None:
                    counters.terminal(chunk)
            if span is not None:
                span.chunk(chunk)
            yield chunk
    except KvmeshError as exc:
        finished = True
        if span is not None:
            span.failed(exc.kind, exc.message)
        raise
    except BaseException as exc:
        if span is not None and not isinstance(exc, GeneratorExit):
            span.failed(type(exc).__name__, str(exc))
        raise
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
        if span is not None:
            span.end(ctx.is_stopped())
        if counters is not None:
            counters.in_flight -= 1
    if not finished:
        raise StreamIncomplete(f"{type(engine).__name__} stream ended without a terminal")
