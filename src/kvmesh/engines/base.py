"""The engine contract every backend implements.

Lifecycle (the worker drives it; numbers are the order of calls)::

    1. engine = SomeEngine(options)        construct: cheap, no I/O, no model load
    2. config = await engine.start()       load the model, allocate KV; returns EngineConfig
    3. engine.generate(request, ctx)       called many times, concurrently (one task per
                                           request); each call returns an async iterator
       await engine.abort(ctx)             called by the cancellation monitor when ctx is
                                           stopped or killed, concurrently with generate()
    4. await engine.drain()                after the worker stopped accepting requests and
                                           in-flight requests finished; flush anything
    5. await engine.cleanup()              release everything; idempotent, and safe to
                                           call without start() (a failed startup)

Stream contract of ``generate``:

* it yields non-terminal :class:`~kvmesh.protocol.OutputChunk` s (``finish_reason`` None)
  and ends with exactly one terminal item: a chunk with ``finish_reason`` set
  (``stop``, ``length``, ``cancelled``, ``error``), or a raised
  :class:`~kvmesh.errors.KvmeshError` (the typed form of a mid-stream failure);
* nothing follows a terminal (the worker wraps streams in
  :func:`kvmesh.engines.adapter.validated` in tests and debug runs, which raises on a
  violation);
* cancellation: engines poll ``ctx.is_stopped()`` (or await ``ctx.stopped()``) between
  yields and, when stopped, end with a ``cancelled`` terminal. ``abort`` is only an
  extra notification; clean-up that must run on every exit path (consumer gone,
  connection reset) belongs in a ``try/finally`` inside ``generate``.

Concurrency: every method runs on the worker's one event loop; an engine that uses
threads must hand results back to the loop itself. ``generate`` does not mutate shared
state outside the engine. :mod:`kvmesh.engines.sample` is a small runnable example.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from kvmesh.errors import InvalidArgument
from kvmesh.protocol import (
    EngineConfig,
    KvDump,
    KvEvent,
    KvLayout,
    KvReservation,
    LoadReport,
    OutputChunk,
    PreprocessedRequest,
)
from kvmesh.runtime.context import Context

__all__ = ["Engine", "GenerateFront"]


class GenerateFront(Protocol):
    """What a worker may put in front of its engine's ``generate`` (the disaggregation
    role, :class:`kvmesh.disagg.engine.DisaggEngine`): every other call goes to the
    engine itself. The worker calls ``open`` after the engine started, ``drain`` before
    the engine drains and ``close`` after its cleanup."""

    def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]: ...
    async def open(self) -> None: ...
    async def drain(self) -> None: ...
    async def close(self) -> None: ...


class Engine(abc.ABC):
    """Abstract engine. Subclasses implement ``start``, ``generate`` and ``cleanup``."""

    # Whether ``generate`` honours ``PreprocessedRequest.guided`` (structured outputs);
    # the worker refuses a guided request with InvalidArgument (a 400) when it does not.
    supports_guided: bool = False
    # Whether ``kv_layout`` gives a layout once started (disaggregation, KV migration) for
    # an engine whose layout, sized at start, is None before it (the hf engine's).
    moves_kv: bool = False

    @abc.abstractmethod
    async def start(self) -> EngineConfig:
        """Load and allocate; return the config the worker registers."""

    @abc.abstractmethod
    def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        """Stream output chunks for one request (usually an ``async def`` generator)."""

    async def abort(self, ctx: Context) -> None:
        """Notification that ``ctx`` was stopped; default: rely on in-stream polling."""

    async def drain(self) -> None:
        """Called once before cleanup, after in-flight requests finished."""

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Release resources. Idempotent; safe without a prior ``start``."""

    # Optional, for engines that publish KV events (the KV-aware router repairs a gap
    # in a worker's event stream with these). Synchronous and read-only.
    def kv_snapshot(self) -> KvDump | None:
        """The whole cached block set, consistent with the event ids; None if unsupported."""
        return None

    def set_batch_multiplier(self, multiplier: float) -> None:
        """Graceful degradation: run at most ``multiplier`` (0, 1] of the usual batch.
        Engines that cannot change their batch at run time ignore it (the default)."""

    def load_report(self) -> LoadReport | None:
        """Current load (blocks in use, waiting, running); None if unsupported."""
        return None

    def kv_events_since(self, event_id: int) -> list[KvEvent] | None:
        """Buffered KV events after ``event_id``; None if some were dropped or unsupported."""
        return None

    # Optional KV block access: disaggregated prefill and KV-transfer migration move
    # blocks between engines through these (a KV connector carries the bytes). An
    # engine supports them all or none; ``kv_layout() is None`` means none.
    #
    # Decode side of a remote prefill:  kv_reserve → (connector writes: kv_import) →
    # kv_commit → generate (starts after the committed tokens); kv_release on cancel.
    # Prefill side: prefill_remote.  Migration source: kv_detach → kv_export → kv_release.
    def kv_layout(self) -> KvLayout | None:
        """The block layout, or None when this engine cannot export or import KV."""
        return None

    def kv_reserve(self, request: PreprocessedRequest) -> KvReservation | None:
        """Allocate and hold blocks for all of ``request.token_ids`` (prefix-cache hits
        reused, their KV valid: ``cached_tokens``). None when the cache has no room."""
        raise _no_kv(self)

    def kv_release(self, request_id: str) -> None:
        """Give back a reservation (or detached request) that will not be generated."""
        raise _no_kv(self)

    def kv_export(self, block_ids: Sequence[int]) -> bytes:
        """The KV of these blocks in order, ``wire_bytes_per_block`` each."""
        raise _no_kv(self)

    def kv_import(self, block_ids: Sequence[int], data: bytes) -> None:
        """Overwrite these blocks with ``data`` from ``kv_export`` of a same-layout engine."""
        raise _no_kv(self)

    def kv_commit(self, request_id: str, computed_tokens: int) -> None:
        """The reservation's first ``computed_tokens`` tokens now hold valid KV; the next
        ``generate`` of this request id computes only the tokens after them (at least one)."""
        raise _no_kv(self)

    async def prefill_remote(
        self, request: PreprocessedRequest, prefix_kv: bytes, cached_tokens: int, upto: int
    ) -> bytes:
        """Prefill worker: compute the KV of ``request.token_ids[:upto]`` given the KV of
        the first ``cached_tokens`` (``prefix_kv``: ``cached_tokens // block_size`` blocks);
        return the KV of blocks ``cached_tokens // block_size`` .. ``ceil(upto / block_size) - 1``."""
        raise _no_kv(self)

    def kv_detach(self, request_id: str) -> KvReservation | None:
        """Stop generating an in-flight request and keep its blocks as a reservation
        (``num_tokens``: prompt + output so far; ``cached_tokens``: those with valid KV).
        Its stream delivers every token generated so far, then ends ``cancelled``.
        None when the request is unknown or holds no blocks."""
        raise _no_kv(self)


def _no_kv(engine: Engine) -> InvalidArgument:
    return InvalidArgument(f"engine {type(engine).__name__} does not export or import KV blocks")
