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

Capabilities beyond the lifecycle are ``typing.Protocol`` s an engine implements or not
(checked with ``isinstance``; nothing on :class:`Engine` raises "unsupported"):

* :class:`LoadReporting` (``load_report``), :class:`BatchTuning`
  (``set_batch_multiplier``): introspection and degradation;
* :class:`KvEventSource` (``kv_snapshot``, ``kv_events_since``): the KV router's gap repair;
* :class:`KvBlockAccess` (``kv_layout``, ``kv_reserve``/``release``/``export``/``import``/
  ``commit``/``detach``, ``prefill_remote``): disaggregation and KV-carrying migration.

* :class:`LoraAdapters` (``lora_state``, ``lora_load``, ``lora_unload``): LoRA adapters
  loaded and unloaded at run time (the worker's ``lora`` endpoint).

The mocker and hf engines implement the first four, vLLM the first and third, the sample
:class:`~kvmesh.engines.sample.EchoEngine` none (it is served aggregated); the mocker,
hf and vLLM engines implement :class:`LoraAdapters` (refusing loads with ``--max-loras 0``).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from kvmesh.errors import InvalidArgument
from kvmesh.protocol import (
    EngineConfig,
    KvDump,
    KvEvent,
    KvLayout,
    KvReservation,
    LoadReport,
    LoraState,
    OutputChunk,
    PreprocessedRequest,
)
from kvmesh.runtime.context import Context

__all__ = [
    "Engine",
    "GenerateFront",
    "LoadReporting",
    "BatchTuning",
    "KvEventSource",
    "KvBlockAccess",
    "LoraAdapters",
    "kv_blocks",
]


class GenerateFront(Protocol):
    """What a worker may put in front of its engine's ``generate`` (the disaggregation
    role, :class:`kvmesh.disagg.engine.DisaggEngine`): every other call goes to the
    engine itself. The worker calls ``open`` after the engine started, ``drain`` before
    the engine drains and ``close`` after its cleanup. ``mode``: the worker's role
    (``aggregated``, ``prefill``, ``decode``), for traces and metrics."""

    mode: str

    def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]: ...
    async def open(self) -> None: ...
    async def drain(self) -> None: ...
    async def close(self) -> None: ...


class Engine(abc.ABC):
    """Abstract engine: the lifecycle. Subclasses implement ``start``, ``generate`` and
    ``cleanup``; what else an engine can do it says by implementing the capability
    Protocols below (callers check them with ``isinstance``)."""

    # Whether ``generate`` honours ``PreprocessedRequest.guided`` (structured outputs);
    # the worker refuses a guided request with InvalidArgument (a 400) when it does not.
    supports_guided: bool = False

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


# --- capabilities ------------------------------------------------------------
# An engine implements a capability by having its methods (no base class needed);
# the worker, the disaggregation front and the prefill worker check with isinstance,
# once, where they are built, and refuse an engine that lacks what the role needs.
# Every method runs on the worker's event loop, like the lifecycle's.


@runtime_checkable
class LoadReporting(Protocol):
    """Reports its load (the worker's ``load`` endpoint and metrics, health, shedding)."""

    def load_report(self) -> LoadReport | None:
        """Current load (blocks in use, waiting, running); None until it knows."""
        ...


@runtime_checkable
class BatchTuning(Protocol):
    """Graceful degradation can shrink its batch at run time (the ``tune`` endpoint)."""

    def set_batch_multiplier(self, multiplier: float) -> None:
        """Run at most ``multiplier`` (0, 1] of the usual batch; ``ValueError`` outside it."""
        ...


@runtime_checkable
class KvEventSource(Protocol):
    """Publishes KV events; the KV-aware router repairs a gap in a worker's event
    stream with these. Synchronous and read-only."""

    def kv_snapshot(self) -> KvDump | None:
        """The whole cached block set, consistent with the event ids; None until started."""
        ...

    def kv_events_since(self, event_id: int) -> list[KvEvent] | None:
        """Buffered KV events after ``event_id``; None if some were dropped."""
        ...


@runtime_checkable
class KvBlockAccess(Protocol):
    """KV block access: disaggregated prefill and KV-transfer migration move blocks
    between engines through these (a KV connector carries the bytes); an engine
    without it is served aggregated only (``--mode prefill``/``decode`` and
    ``--drain-migrate`` hand-offs refuse it).

    Decode side of a remote prefill: kv_reserve → (connector writes: kv_import) →
    kv_commit → generate (starts after the committed tokens); kv_release on cancel.
    Prefill side: prefill_remote (scheduled by the engine like any prefill).
    Migration source: kv_detach → kv_export → kv_release."""

    def kv_layout(self) -> KvLayout | None:
        """The block layout; None while the engine is not started (an engine whose
        pool is sized at start)."""
        ...

    def kv_reserve(self, request: PreprocessedRequest) -> KvReservation | None:
        """Allocate and hold blocks for all of ``request.token_ids`` (prefix-cache hits
        reused, their KV valid: ``cached_tokens``). None when the cache has no room."""
        ...

    def kv_release(self, request_id: str) -> None:
        """Give back a reservation (or detached request) that will not be generated."""
        ...

    def kv_export(self, block_ids: Sequence[int]) -> bytes:
        """The KV of these blocks in order, ``wire_bytes_per_block`` each."""
        ...

    def kv_import(self, block_ids: Sequence[int], data: bytes) -> None:
        """Overwrite these blocks with ``data`` from ``kv_export`` of a same-layout engine."""
        ...

    def kv_commit(self, request_id: str, computed_tokens: int) -> None:
        """The reservation's first ``computed_tokens`` tokens now hold valid KV; the next
        ``generate`` of this request id computes only the tokens after them (at least one)."""
        ...

    async def prefill_remote(
        self, request: PreprocessedRequest, prefix_kv: bytes, cached_tokens: int, upto: int
    ) -> bytes:
        """Prefill worker: compute the KV of ``request.token_ids[:upto]`` given the KV of
        the first ``cached_tokens`` (``prefix_kv``: ``cached_tokens // block_size`` blocks),
        as a prefill in the engine's own scheduler (beside its other work, at its step
        cost); return the KV of blocks ``cached_tokens // block_size`` .. ``ceil(upto / block_size) - 1``."""
        ...

    def kv_detach(self, request_id: str) -> KvReservation | None:
        """Stop generating an in-flight request and keep its blocks as a reservation
        (``num_tokens``: prompt + output so far; ``cached_tokens``: those with valid KV).
        Its stream delivers every token generated so far, then ends ``cancelled``.
        None when the request is unknown or holds no blocks."""
        ...


@runtime_checkable
class LoraAdapters(Protocol):
    """LoRA adapters on one base model. A request names one in
    ``PreprocessedRequest.adapter``; an engine that holds it applies it, one that knows
    its path (``--lora NAME=PATH`` or an earlier load) loads it first, else the request
    fails with :class:`~kvmesh.errors.ModelNotFound`. At most ``max_adapters`` are
    resident; a load past that unloads the least recently used adapter no running
    sequence uses (:class:`~kvmesh.errors.ResourceExhausted` when every one is in use).
    Adapter and cache salt are part of the request's block hashes
    (:func:`kvmesh.kv.hashing.hash_salt`), so no KV block is shared across adapters."""

    def lora_state(self) -> LoraState:
        """The adapters resident now (read-only)."""
        ...

    async def lora_load(self, name: str, path: str | None) -> LoraState:
        """Make ``name`` resident from ``path`` (a PEFT folder, checked against the model;
        None: the path it is known by); :class:`~kvmesh.errors.InvalidArgument` that says
        what is wrong with the folder. Loading a resident name again reloads it."""
        ...

    async def lora_unload(self, name: str) -> LoraState:
        """Drop ``name`` and forget its path; refused while a running sequence uses it."""
        ...


def kv_blocks(engine: Engine, role: str) -> KvBlockAccess:
    """``engine`` as :class:`KvBlockAccess`, for ``role`` (what needs it, in the error);
    :class:`~kvmesh.errors.InvalidArgument` naming the engine when it has no KV block access."""
    if not isinstance(engine, KvBlockAccess):
        raise InvalidArgument(
            f"{role} needs an engine with KV block access (kvmesh.engines.base.KvBlockAccess); "
            f"{type(engine).__name__} has none: serve it aggregated"
        )
    return engine
