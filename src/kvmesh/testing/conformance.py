"""The engine conformance kit: eight checks every :class:`~kvmesh.engines.base.Engine`
must pass, run against fresh engines from a factory.

Use it from any engine's tests::

    async def test_mocker_conforms():
        await run_conformance(lambda: MockerEngine(MockerOptions(speedup=100)))

==========================  ===============================================  ==========================
check                       asserts                                          failure
==========================  ===============================================  ==========================
``start_config``            ``start()`` returns a non-empty ``model``        :class:`EmptyModelInConfig`
``single_generate``         one ``generate()`` yields a stop/length terminal :class:`NoTerminalChunk`
``no_chunk_after_terminal`` nothing follows the terminal                     :class:`ChunkAfterTerminal`
``concurrent_generate``     interleaved ``generate()`` calls all succeed     :class:`ConcurrentGenerateFailed`
``cancellation_observed``   a mid-stream stop ends the stream within 2 s     :class:`CancellationNotObserved`
``cancellation_terminal``   that stream's terminal is ``cancelled``          :class:`CancellationIgnored`
``cleanup_twice``           ``cleanup()`` succeeds twice after ``start()``   :class:`SecondCleanupFailed`
``cleanup_without_start``   ``cleanup()`` succeeds on a never-started engine :class:`CleanupWithoutStartFailed`
==========================  ===============================================  ==========================

Every check builds its own engine (``engine_factory()``), so checks never see each
other's state; anything that goes wrong inside a check, setup included, raises that
check's failure with a message saying what the engine did. Streams run as in the
worker: an :class:`~kvmesh.engines.adapter.AbortMonitor` watches each request's context
and calls ``engine.abort``. Every awaited engine call is bounded by ``timeout_s`` (a
whole ``generate()`` stream included), so a hung engine fails a check instead of hanging
the test. A clean-up error while tearing down a check that is not about clean-up is
ignored there; the two clean-up checks report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from kvmesh.engines.adapter import AbortMonitor
from kvmesh.engines.base import Engine
from kvmesh.protocol import EngineConfig, OutputChunk, PreprocessedRequest, StopConditions
from kvmesh.runtime.context import Context

__all__ = [
    "ConformanceFailure",
    "EmptyModelInConfig",
    "NoTerminalChunk",
    "ChunkAfterTerminal",
    "ConcurrentGenerateFailed",
    "CancellationNotObserved",
    "CancellationIgnored",
    "SecondCleanupFailed",
    "CleanupWithoutStartFailed",
    "Check",
    "CHECKS",
    "run_conformance",
    "default_request",
    "mock_context",
    "cancelling_context",
    "CancellingContext",
]

EngineFactory = Callable[[], Engine]

# Terminals a plain request (not cancelled, nothing wrong with it) may end with.
_NORMAL_FINISH = ("stop", "length")


# ---------------------------------------------------------------------------- failures


class ConformanceFailure(AssertionError):
    """An engine failed a conformance check; ``check`` names it (see :data:`CHECKS`)."""

    check: ClassVar[str] = ""


class EmptyModelInConfig(ConformanceFailure):
    check = "start_config"


class NoTerminalChunk(ConformanceFailure):
    check = "single_generate"


class ChunkAfterTerminal(ConformanceFailure):
    check = "no_chunk_after_terminal"


class ConcurrentGenerateFailed(ConformanceFailure):
    check = "concurrent_generate"


class CancellationNotObserved(ConformanceFailure):
    check = "cancellation_observed"


class CancellationIgnored(ConformanceFailure):
    check = "cancellation_terminal"


class SecondCleanupFailed(ConformanceFailure):
    check = "cleanup_twice"


class CleanupWithoutStartFailed(ConformanceFailure):
    check = "cleanup_without_start"


# ---------------------------------------------------------------------------- helpers


def default_request(
    max_tokens: int = 64, *, model: str = "conformance", request_id: str | None = None
) -> PreprocessedRequest:
    """A short prompt asking for ``max_tokens`` tokens with EOS ignored, so the stream is
    long enough for a cancellation to land mid-stream."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 to cancel mid-stream, got {max_tokens}")
    return PreprocessedRequest(
        request_id=request_id or _new_id(),
        model=model,
        token_ids=[101, 102, 103, 104, 105, 106, 107, 108],
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


def mock_context(request_id: str | None = None) -> Context:
    """A live request context, as the worker would create for one request."""
    return Context(request_id or _new_id())


class CancellingContext(Context):
    """A context that stops itself ``after_s`` seconds after creation.

    It owns its timer: the timer is cancelled when the context stops for any other
    reason, on :meth:`cancel_timer`, and on leaving a ``with`` block.
    """

    __slots__ = ("_timer",)

    def __init__(self, request_id: str, after_s: float) -> None:
        super().__init__(request_id)
        self._timer = asyncio.get_running_loop().call_later(after_s, self.stop_generating)
        self.on_stop(self._on_stopped)

    def _on_stopped(self, _ctx: Context) -> None:
        self._timer.cancel()

    def cancel_timer(self) -> None:
        """Keep the context live: drop the pending self-stop (no-op once stopped)."""
        self._timer.cancel()

    def __enter__(self) -> CancellingContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel_timer()


def cancelling_context(after_s: float, request_id: str | None = None) -> CancellingContext:
    """A context that calls ``stop_generating()`` on itself after ``after_s`` seconds.

    Must be called with the event loop running; see :class:`CancellingContext`.
    """
    if after_s < 0:
        raise ValueError(f"after_s must be >= 0, got {after_s}")
    return CancellingContext(request_id or _new_id(), after_s)


def _new_id() -> str:
    return f"conformance-{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------------- observing


@dataclass
class _Watched:
    """One ``generate()`` stream under observation: what it yielded and how it ended.

    Reading never raises for anything the engine does; the outcome is recorded instead
    (``raised``, ``timed_out``, ``ended``) and the check turns it into a failure.
    """

    name: str
    chunks: list[OutputChunk] = field(default_factory=list)
    terminal: OutputChunk | None = None
    after_terminal: list[OutputChunk] = field(default_factory=list)
    raised: Exception | None = None
    timed_out: bool = False
    ended: bool = False
    _it: AsyncIterator[Any] | None = None

    @classmethod
    def start(cls, engine: Engine, request: PreprocessedRequest, ctx: Context) -> _Watched:
        watched = cls(type(engine).__name__)
        try:
            watched._it = aiter(engine.generate(request, ctx))
        except Exception as exc:  # noqa: BLE001 - a broken engine is what we report
            watched.raised = exc
        return watched

    @property
    def done(self) -> bool:
        return self.ended or self.timed_out or self.raised is not None

    async def step(self, deadline: float) -> OutputChunk | None:
        """The next item, or None once the stream is done (ended, raised, timed out)."""
        if self.done or self._it is None:
            return None
        try:
            async with asyncio.timeout_at(deadline) as scope:
                item = await anext(self._it)
        except StopAsyncIteration:
            self.ended = True
            return None
        except TimeoutError as exc:
            if scope.expired():
                self.timed_out = True
            else:
                self.raised = exc
            return None
        except Exception as exc:  # noqa: BLE001
            self.raised = exc
            return None
        if not isinstance(item, OutputChunk):
            self.raised = TypeError(f"yielded {type(item).__name__} {item!r}, not an OutputChunk")
            return None
        self._record(item)
        return item

    def _record(self, chunk: OutputChunk) -> None:
        if self.terminal is not None:
            self.after_terminal.append(chunk)
        else:
            self.chunks.append(chunk)
            if chunk.finish_reason is not None:
                self.terminal = chunk

    async def until_terminal(self, deadline: float) -> None:
        while self.terminal is None and await self.step(deadline) is not None:
            pass

    async def to_end(self, deadline: float) -> None:
        while await self.step(deadline) is not None:
            pass

    async def close(self, timeout_s: float) -> None:
        """Close the stream as the worker does when it stops reading (engine ``finally``)."""
        aclose = getattr(self._it, "aclose", None)
        if aclose is None:
            return
        # A close failure is not what any stream check is about; the stream's outcome is.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await aclose()

    @property
    def ok(self) -> bool:
        """Ended (or reached) a normal terminal with nothing wrong before it."""
        return self.terminal is not None and self.terminal.finish_reason in _NORMAL_FINISH

    def describe(self) -> str:
        """What the stream did, for failure messages."""
        n = len(self.chunks) - (self.terminal is not None)
        if self.terminal is not None:
            t = self.terminal
            error = f", error={t.error!r}" if t.error else ""
            return f"ended with terminal finish_reason={t.finish_reason!r}{error} after {n} chunk(s)"
        if self.raised is not None:
            return f"raised {self.raised!r} after {n} chunk(s), without a terminal chunk"
        if self.timed_out:
            return f"yielded no terminal before the deadline ({n} chunk(s) so far)"
        return f"ended after {n} chunk(s) without a terminal chunk"


# ---------------------------------------------------------------------------- harness


@dataclass(frozen=True)
class _Options:
    factory: EngineFactory
    request: PreprocessedRequest | None
    timeout_s: float
    cancel_within_s: float
    concurrency: int

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.cancel_within_s <= 0:
            raise ValueError(f"cancel_within_s must be > 0, got {self.cancel_within_s}")
        if self.concurrency < 2:
            raise ValueError(f"concurrency must be >= 2, got {self.concurrency}")

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout_s


@dataclass
class _Live:
    """A started engine inside one check."""

    opts: _Options
    engine: Engine
    config: Any
    monitor: AbortMonitor

    @property
    def name(self) -> str:
        return type(self.engine).__name__

    def request(self, n: int) -> PreprocessedRequest:
        """Request ``n`` of this check; every call gets its own request id."""
        base = self.opts.request
        if base is None:
            model = getattr(self.config, "served_model_name", "") or getattr(self.config, "model", "")
            return default_request(model=model or "conformance")
        return msgspec.structs.replace(base, request_id=f"{base.request_id}-{n}-{_new_id()}")

    def generate(self, request: PreprocessedRequest, ctx: Context | None = None) -> _Watched:
        ctx = ctx or mock_context(request.request_id)
        self.monitor.watch(ctx)
        return _Watched.start(self.engine, request, ctx)


def _make(opts: _Options, failure: type[ConformanceFailure]) -> Engine:
    try:
        return opts.factory()
    except Exception as exc:  # noqa: BLE001
        raise failure(f"engine_factory() raised {exc!r}") from exc


async def _call(
    fn: Callable[[], Awaitable[Any]], what: str, timeout_s: float, failure: type[ConformanceFailure]
) -> Any:
    """Await one engine call under ``timeout_s``; any problem becomes ``failure``."""
    try:
        async with asyncio.timeout(timeout_s) as scope:
            return await fn()
    except TimeoutError as exc:
        if scope.expired():
            raise failure(f"{what} did not return within {timeout_s:g} s") from None
        raise failure(f"{what} raised {exc!r}") from exc
    except Exception as exc:  # noqa: BLE001
        raise failure(f"{what} raised {exc!r}") from exc


@contextlib.asynccontextmanager
async def _started(opts: _Options, failure: type[ConformanceFailure]) -> AsyncIterator[_Live]:
    """A fresh started engine; on exit abort tasks are closed and the engine cleaned up."""
    engine = _make(opts, failure)
    name = type(engine).__name__
    monitor = AbortMonitor(engine)
    try:
        config = await _call(engine.start, f"{name}.start()", opts.timeout_s, failure)
        yield _Live(opts, engine, config, monitor)
    finally:
        # AbortMonitor.close() cancels abort tasks that have not run yet; give the ones
        # scheduled by a stop their first step, so a fast-ending stream still sees abort().
        await asyncio.sleep(0)
        await monitor.close()
        # Clean-up is judged by its own two checks; here it only must not hang the run.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(opts.timeout_s):
                await engine.cleanup()


# ---------------------------------------------------------------------------- checks


async def _check_start_config(opts: _Options) -> None:
    async with _started(opts, EmptyModelInConfig) as live:
        config = live.config
        if not isinstance(config, EngineConfig):
            raise EmptyModelInConfig(f"{live.name}.start() returned {config!r}, not an EngineConfig")
        if not config.model.strip():
            raise EmptyModelInConfig(f"{live.name}.start() returned an EngineConfig with model={config.model!r}")


async def _check_single_generate(opts: _Options) -> None:
    async with _started(opts, NoTerminalChunk) as live:
        watched = live.generate(live.request(0))
        await watched.until_terminal(opts.deadline())
        await watched.close(opts.timeout_s)
        if not watched.ok:
            raise NoTerminalChunk(f"{live.name}.generate() of a plain request {watched.describe()}")


async def _check_no_chunk_after_terminal(opts: _Options) -> None:
    async with _started(opts, ChunkAfterTerminal) as live:
        watched = live.generate(live.request(0))
        await watched.to_end(opts.deadline())
        await watched.close(opts.timeout_s)
        what = f"{live.name}.generate()"
        if watched.terminal is None:
            raise ChunkAfterTerminal(f"{what} {watched.describe()}, so nothing could be checked after it")
        if watched.after_terminal:
            extra = watched.after_terminal
            raise ChunkAfterTerminal(f"{what} yielded {len(extra)} chunk(s) after its terminal, first {extra[0]!r}")
        if watched.raised is not None:
            raise ChunkAfterTerminal(f"{what} raised {watched.raised!r} after its terminal")
        if watched.timed_out:
            raise ChunkAfterTerminal(f"{what} did not end within {opts.timeout_s:g} s after its terminal")


async def _check_concurrent_generate(opts: _Options) -> None:
    async with _started(opts, ConcurrentGenerateFailed) as live:
        streams = [live.generate(live.request(i)) for i in range(opts.concurrency)]
        deadline = opts.deadline()
        # Each stream is read by its own task, so the engine sees them interleaved.
        await asyncio.gather(*(w.until_terminal(deadline) for w in streams))
        for w in streams:
            await w.close(opts.timeout_s)
        failed = [f"#{i} {w.describe()}" for i, w in enumerate(streams) if not w.ok]
        if failed:
            raise ConcurrentGenerateFailed(
                f"{len(failed)} of {len(streams)} concurrent {live.name}.generate() calls failed: " + "; ".join(failed)
            )


async def _cancel_mid_stream(live: _Live, failure: type[ConformanceFailure]) -> _Watched:
    """Start a stream, stop its context after the first chunk, read until its terminal
    or ``cancel_within_s`` after the stop."""
    opts = live.opts
    request = live.request(0)
    ctx = mock_context(request.request_id)
    watched = live.generate(request, ctx)
    first = await watched.step(opts.deadline())
    what = f"{live.name}.generate()"
    if first is None:
        raise failure(f"{what} {watched.describe()} before its first chunk, so it could not be cancelled")
    if first.is_terminal:
        raise failure(
            f"{what}'s first chunk was already its terminal ({first.finish_reason!r}), so it could not be "
            "cancelled mid-stream; pass a request that streams several chunks"
        )
    ctx.stop_generating()
    await watched.until_terminal(asyncio.get_running_loop().time() + opts.cancel_within_s)
    await watched.close(opts.timeout_s)
    return watched


async def _check_cancellation_observed(opts: _Options) -> None:
    async with _started(opts, CancellationNotObserved) as live:
        watched = await _cancel_mid_stream(live, CancellationNotObserved)
        if watched.timed_out:
            late = len(watched.chunks) - 1
            raise CancellationNotObserved(
                f"{live.name}.generate() was still streaming {opts.cancel_within_s:g} s after ctx.stop_generating() "
                f"({late} chunk(s) since the stop, no terminal)"
            )


async def _check_cancellation_terminal(opts: _Options) -> None:
    async with _started(opts, CancellationIgnored) as live:
        watched = await _cancel_mid_stream(live, CancellationIgnored)
        terminal = watched.terminal
        if terminal is None or terminal.finish_reason != "cancelled":
            raise CancellationIgnored(
                f"after ctx.stop_generating(), {live.name}.generate() {watched.describe()}, "
                "instead of a finish_reason='cancelled' terminal"
            )


async def _check_cleanup_twice(opts: _Options) -> None:
    fail = SecondCleanupFailed
    engine = _make(opts, fail)
    name = type(engine).__name__
    await _call(engine.start, f"{name}.start()", opts.timeout_s, fail)
    await _call(engine.cleanup, f"{name}.cleanup() (the first, after start())", opts.timeout_s, fail)
    await _call(engine.cleanup, f"{name}.cleanup() called a second time", opts.timeout_s, fail)


async def _check_cleanup_without_start(opts: _Options) -> None:
    fail = CleanupWithoutStartFailed
    engine = _make(opts, fail)
    await _call(engine.cleanup, f"{type(engine).__name__}.cleanup() on a never-started engine", opts.timeout_s, fail)


@dataclass(frozen=True)
class Check:
    """One conformance check: its name, what it asserts, and the failure it raises."""

    name: str
    failure: type[ConformanceFailure]
    asserts: str
    run: Callable[[_Options], Awaitable[None]] = field(repr=False)


CHECKS: tuple[Check, ...] = (
    Check("start_config", EmptyModelInConfig, "start() returns a non-empty EngineConfig.model", _check_start_config),
    Check("single_generate", NoTerminalChunk, "a single generate() ends in a terminal chunk", _check_single_generate),
    Check(
        "no_chunk_after_terminal", ChunkAfterTerminal, "no chunks after the terminal", _check_no_chunk_after_terminal
    ),
    Check(
        "concurrent_generate",
        ConcurrentGenerateFailed,
        "interleaved generate() calls all succeed",
        _check_concurrent_generate,
    ),
    Check(
        "cancellation_observed",
        CancellationNotObserved,
        "a mid-stream cancel terminates the stream in time",
        _check_cancellation_observed,
    ),
    Check(
        "cancellation_terminal",
        CancellationIgnored,
        "the cancelled stream's terminal is finish_reason 'cancelled'",
        _check_cancellation_terminal,
    ),
    Check("cleanup_twice", SecondCleanupFailed, "cleanup() succeeds twice", _check_cleanup_twice),
    Check(
        "cleanup_without_start",
        CleanupWithoutStartFailed,
        "cleanup() on a never-started engine succeeds",
        _check_cleanup_without_start,
    ),
)

_BY_NAME = {check.name: check for check in CHECKS}


async def run_conformance(
    engine_factory: EngineFactory,
    *,
    request: PreprocessedRequest | None = None,
    timeout_s: float = 10.0,
    checks: Iterable[str] | None = None,
    cancel_within_s: float = 2.0,
    concurrency: int = 4,
) -> list[str]:
    """Run the conformance checks in order; raise the first failing check's failure.

    ``engine_factory`` returns a fresh, not started engine; each check calls it once.
    ``request`` replaces :func:`default_request` (each call gets a fresh request id); it
    must stream several chunks for the cancellation checks. ``timeout_s`` bounds every
    engine call, a whole ``generate()`` stream included. ``checks`` picks checks by name
    (see :data:`CHECKS`), in the order given. Returns the names of the checks that ran.
    """
    opts = _Options(engine_factory, request, timeout_s, cancel_within_s, concurrency)
    names = [c.name for c in CHECKS] if checks is None else list(checks)
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; known: {sorted(_BY_NAME)}")
    for name in names:
        await _BY_NAME[name].run(opts)
    return names
