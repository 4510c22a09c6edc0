"""``StepLoopEngine``: what every continuous-batching engine does around its passes.

Shape (one event loop; an engine may run its pass elsewhere, e.g. a thread)::

    generate() ──queue──▶ Scheduler ◀── step loop (one owned task: ``_loop``)
        ▲                                   │ runs a pass, then delivers
        └──── one-slot mailbox per request ◀┘ tokens / finishes

The base owns the mailboxes, ``generate`` (chunks, the terminal, cancellation,
shutdown errors), stop handling (``ctx.on_stop`` aborts the request in the scheduler
at once, freeing its blocks, and wakes the stream, which ends ``cancelled``; the
stream's ``finally`` aborts again, idempotent), ``_fail_all``, the loop task's start,
stop and failure handling, and load reports (published when they change, and when
the loop idles). KV introspection reads the scheduler's block manager.

A subclass provides the scheduler (:meth:`_core`), how a request is queued
(:meth:`_admit`), its mailbox type (:meth:`_new_box`) and the loop (:meth:`_loop`),
which pays one :meth:`_idle` call per pass when there is nothing to do.

LoRA adapters (:class:`~kvmesh.engines.base.LoraAdapters`): an engine that sets
``self.adapters`` (an :class:`~kvmesh.engines.batching.adapters.AdapterHost`) serves
them; ``generate`` makes a request's adapter resident before admitting it (only
requests that name one pay anything), and load reports list the resident ones.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any, Generic, TypeVar

from kvmesh.engines.base import BatchTuning, Engine, KvEventSource, LoadReporting
from kvmesh.engines.batching.adapters import AdapterHost
from kvmesh.engines.batching.mailbox import Mailbox
from kvmesh.engines.batching.scheduler import Finished
from kvmesh.engines.batching.scheduler import Scheduler as BatchScheduler
from kvmesh.errors import EngineShutdown, InvalidArgument, ResourceExhausted
from kvmesh.protocol import KvDump, KvEvent, LoadReport, LoraState, OutputChunk, PreprocessedRequest
from kvmesh.runtime.context import Context
from kvmesh.runtime.events import EventPublisher, KvEventRing, NullPublisher

__all__ = ["StepLoopEngine"]

_log = logging.getLogger(__name__)

B = TypeVar("B", bound=Mailbox)
C = TypeVar("C", bound="BatchScheduler[Any]")


class StepLoopEngine(Engine, LoadReporting, BatchTuning, KvEventSource, Generic[B, C]):
    """The shared half of a step-loop engine; see the module docstring. Its capabilities:
    load reports, batch tuning and KV events (KV block access is each engine's own)."""

    engine_name = "step-loop"  # in task names and error messages

    def __init__(self, publisher: EventPublisher | None = None) -> None:
        self._publisher: EventPublisher = publisher if publisher is not None else NullPublisher()
        self._boxes: dict[int, B] = {}
        self._sids: dict[str, int] = {}  # request id -> sequence id, for kv_detach
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_load: tuple[int, int, int] | None = None
        self.adapters: AdapterHost | None = None  # LoRA: set by an engine that serves adapters
        self._pinned: dict[str, int] = {}  # adapters of work outside the streams (remote prefills)

    # ------------------------------------------------------------------ what a subclass provides

    @abc.abstractmethod
    def _core(self) -> C | None:
        """The scheduler; None while the engine is not started."""

    @abc.abstractmethod
    def _admit(self, request: PreprocessedRequest) -> int:
        """Queue ``request`` (raising on bad input) and return its sequence id."""

    async def _prepare_guided(self, request: PreprocessedRequest) -> None:
        """Compile the request's grammar off the event loop before it is admitted
        (engines that support structured outputs override this)."""

    @abc.abstractmethod
    def _new_box(self, seq_id: int) -> B:
        """A fresh mailbox for sequence ``seq_id``."""

    @abc.abstractmethod
    async def _loop(self, wake: asyncio.Event) -> None:
        """Run passes for as long as the engine runs."""

    def _chunk(self, box: B, first: bool) -> OutputChunk:
        """The next stream chunk from ``box`` (``first``: the stream's first)."""
        return box.chunk()

    # ------------------------------------------------------------------ lifecycle

    def _start_loop(self) -> None:
        self._last_load = None
        self._wake = wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(wake), name=f"{self.engine_name}-step-loop")

    async def _stop_loop(self) -> bool:
        """Cancel the loop and end every open stream; False if it was not running."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        self._fail_all(f"{self.engine_name} engine was cleaned up")
        return task is not None

    async def drain(self) -> None:
        self._publish_load()

    def _started_core(self) -> C:
        """The scheduler; ``EngineShutdown`` while the engine is not started."""
        core = self._core()
        if core is None:
            raise EngineShutdown(f"{self.engine_name} engine is not started")
        return core

    def _wake_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ introspection

    @property
    def kv_event_ring(self) -> KvEventRing:
        """The last KV events, for subscribers repairing a gap."""
        return self._started_core().blocks.ring

    def kv_dump(self) -> set[int]:
        """Sequence hashes of every block now in the prefix cache."""
        return self._started_core().kv_dump()

    def kv_snapshot(self) -> KvDump:
        core = self._started_core()
        return KvDump(core.limits.worker_id, core.blocks.next_event_id - 1, sorted(core.kv_dump()))

    def kv_events_since(self, event_id: int) -> list[KvEvent] | None:
        return self._started_core().blocks.ring.since(event_id)

    def load_report(self) -> LoadReport:
        report = self._started_core().load_report(time.time() * 1000.0)
        if self.adapters is not None:
            report.adapters = self.adapters.table.resident
        return report

    # ------------------------------------------------------------------ LoRA adapters

    def _lora(self) -> AdapterHost:
        if self.adapters is None:
            raise InvalidArgument(f"the {self.engine_name} engine serves no LoRA adapters (--max-loras 0)")
        return self.adapters

    def lora_state(self) -> LoraState:
        return self._lora().state()

    async def lora_load(self, name: str, path: str | None) -> LoraState:
        return await self._lora().load(name, path)

    async def lora_unload(self, name: str) -> LoraState:
        return self._lora().unload(name)

    def _adapters_in_use(self) -> set[str]:
        """The adapters of every live sequence (streams and KV reservations)."""
        core = self._core()
        if core is None:
            return set(self._pinned)
        live = [core.get(sid) for sid in self._boxes] + core.reservations()
        return {s.adapter for s in live if s is not None and s.adapter is not None} | set(self._pinned)

    @contextlib.contextmanager
    def _pin_adapter(self, name: str | None) -> Iterator[None]:
        """``name`` counts as in use (not evicted, not reloaded) for the block's duration."""
        if name is not None:
            self._pinned[name] = self._pinned.get(name, 0) + 1
        try:
            yield
        finally:
            if name is not None:
                left = self._pinned.pop(name) - 1
                if left:
                    self._pinned[name] = left

    def _adapters_changed(self) -> None:
        self._last_load = None  # publish: the report lists the resident adapters
        self._publish_load()

    def set_batch_multiplier(self, multiplier: float) -> None:
        self._started_core().set_batch_multiplier(multiplier)

    @property
    def preemptions(self) -> int:
        """Sequences preempted since start (0 while not started): the worker's metrics."""
        core = self._core()
        return core.preemptions if core is not None else 0

    # ------------------------------------------------------------------ requests

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        wake = self._wake
        if self._task is None or self._task.done() or wake is None:
            raise EngineShutdown(f"{self.engine_name} engine is not running")
        if request.guided is not None:
            await self._prepare_guided(request)
        if request.adapter is not None:  # resident before admission, in this same run of the loop
            await self._lora().prepare(request)
        sid = self._admit(request)
        box = self._boxes[sid] = self._new_box(sid)
        self._sids[request.request_id] = sid
        wake.set()
        ctx.on_stop(partial(self._on_stop, sid))
        first = True
        # the hot path: a plain chunk (no engine or mailbox override) is built here, one
        # call fewer per token than through _chunk/box.chunk
        plain = type(self)._chunk is StepLoopEngine._chunk and type(box).chunk is Mailbox.chunk
        is_stopped = ctx.is_stopped
        try:
            while True:
                if box.cancelled or is_stopped():
                    if box.tokens and not is_stopped():  # detached: deliver what was made
                        yield OutputChunk(token_ids=box.take())
                    yield OutputChunk.cancelled()
                    return
                if box.error is not None:
                    raise box.error
                if box.finished is not None:
                    yield box.terminal()
                    return
                tokens = box.tokens
                if tokens:
                    if plain:
                        box.tokens = []
                        yield OutputChunk(token_ids=tokens)
                    else:
                        yield self._chunk(box, first)
                    first = False
                    continue
                await box.wait()
        finally:
            self._boxes.pop(sid, None)
            if self._sids.get(request.request_id) == sid:
                del self._sids[request.request_id]
            core = self._core()
            if core is not None:
                core.abort(sid)

    # ------------------------------------------------------------------ remote prefill

    async def _prefill_in_loop(self, sid: int, fill: Callable[[], None] | None = None) -> None:
        """Run the remote prefill ``sid`` (queued with ``Scheduler.hold_prefill``) through
        the step loop like any prefill: ``fill`` first writes its imported prefix, then
        this waits until its tokens are computed and held. Raises what ended it
        otherwise. The caller exports the KV, then calls :meth:`_release_prefill`
        (also when this raises)."""
        if self._task is None or self._task.done():
            raise EngineShutdown(f"{self.engine_name} engine is not running")
        box = self._boxes[sid] = self._new_box(sid)
        if fill is not None:
            fill()
        self._wake_loop()
        while box.finished is None and box.error is None:
            await box.wait()
        if box.error is not None:
            raise box.error
        finished: Finished = box.finished
        if finished.reason != "stop":
            raise ResourceExhausted(finished.error or f"remote prefill ended with {finished.reason}")

    def _release_prefill(self, sid: int) -> None:
        """Give back a remote prefill's blocks, whatever became of it."""
        self._boxes.pop(sid, None)
        core = self._core()
        if core is not None:
            core.release_held(sid)
            self._wake_loop()

    def _on_stop(self, sid: int, _ctx: Context) -> None:
        core = self._core()
        if core is not None:
            core.abort(sid)
        box = self._boxes.get(sid)
        if box is not None:
            box.cancel()

    def _fail_all(self, message: str) -> None:
        """End every open stream with its own :class:`EngineShutdown`."""
        for box in self._boxes.values():
            box.fail(EngineShutdown(message))

    # ------------------------------------------------------------------ step loop

    async def _run(self, wake: asyncio.Event) -> None:
        try:
            await self._loop(wake)
        except asyncio.CancelledError:
            raise
        except EngineShutdown as exc:  # an injected crash whose exit_fn returned
            self._fail_all(exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug here must end streams, not hang them
            _log.exception("%s step loop failed", self.engine_name)
            self._fail_all(f"{self.engine_name} step loop failed: {exc!r}")

    async def _idle(self, core: BatchScheduler[Any], wake: asyncio.Event) -> bool:
        """With no work: publish the load, sleep until woken, and return True."""
        if core.has_work:
            return False
        self._publish_load()
        wake.clear()
        await wake.wait()
        return True

    def _deliver_finished(self, finished: list[Finished]) -> None:
        boxes = self._boxes
        for fin in finished:
            box = boxes.get(fin.seq_id)
            if box is not None:
                box.finish(fin)

    def _publish_load(self) -> None:
        core = self._core()
        if core is None:
            return
        key = (core.blocks.active_blocks, core.num_waiting, core.num_running)
        if key != self._last_load:
            self._last_load = key
            self._publisher.publish_load(self.load_report())
