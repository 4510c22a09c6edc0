"""Runs one engine behind the request plane.

Lifecycle, in order:

1. ``start()``: ``engine.start()``, then serve the ``generate`` endpoint on TCP;
2. serve until ``shutdown()`` (SIGTERM/SIGINT in the worker process);
3. ``shutdown()``: stop accepting → wait for in-flight requests (grace period) →
   ``engine.drain()`` → ``engine.cleanup()`` → close the server.

Each ``generate`` request runs through :func:`kvmesh.engines.adapter.run_generate`:
the cancellation monitor calls ``engine.abort(ctx)`` when the caller stops, and with
``validate`` (tests, ``KVMESH_DEBUG=1``) a stream-contract breach fails loudly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import msgspec

from kvmesh.engines.adapter import AbortMonitor, run_generate
from kvmesh.engines.base import BatchTuning, Engine, GenerateFront, KvEventSource, LoadReporting, LoraAdapters
from kvmesh.engines.batching.engine import StepLoopEngine
from kvmesh.errors import EngineShutdown, InvalidArgument
from kvmesh.protocol import (
    DisaggStats,
    EngineConfig,
    InstanceInfo,
    KvDump,
    KvEventsSince,
    LoadReport,
    LoraCommand,
    LoraState,
    MODEL_FILE_NAMES,
    ModelFiles,
    OutputChunk,
    PreprocessedRequest,
    WorkerMetrics,
)
from kvmesh.observability import worker_metrics
from kvmesh.observability.worker_metrics import WorkerCounters
from kvmesh.runtime.context import Context
from kvmesh.runtime.distributed import RequestServer
from kvmesh.runtime.names import DISAGG_STATS, FAULT, GENERATE, HANDOFF, INFO, KV_DUMP, KV_EVENTS, LOAD, LORA, METRICS, MODEL_FILES, TUNE
from kvmesh.runtime.stream import StreamServer
from kvmesh.runtime.tcp_server import TcpServer

if TYPE_CHECKING:
    from kvmesh.health.migration import HandOffReport

__all__ = ["WorkerService", "GENERATE", "MODEL_FILES", "INFO", "KV_DUMP", "KV_EVENTS", "read_model_files"]

log = logging.getLogger(__name__)
_R = TypeVar("_R")




async def _failed(error: InvalidArgument) -> AsyncIterator[OutputChunk]:
    """A stream that fails with ``error`` when read (a handler reports through its stream)."""
    raise error
    yield  # pragma: no cover - makes this an async generator


def read_model_files(folder: str, name: str) -> ModelFiles:
    path = Path(folder)
    if not path.is_dir():
        raise InvalidArgument(f"this worker's model folder {folder} is not a local folder")
    files = {n: (path / n).read_bytes() for n in MODEL_FILE_NAMES if (path / n).is_file()}
    return ModelFiles(name=name, files=files)


@runtime_checkable
class _Addressed(Protocol):
    """A request server with a TCP address (the TCP plane's)."""

    @property
    def address(self) -> str: ...


class WorkerService:
    def __init__(
        self,
        engine: Engine,
        server: RequestServer | None = None,
        validate: bool = False,
        disagg_stats: Callable[[], DisaggStats | None] | None = None,
        inject_fault: Callable[[str], None] | None = None,
        front: GenerateFront | None = None,
    ) -> None:
        self.engine = engine
        self._inject_fault = inject_fault  # the engine's registry entry's (kvmesh.engines.registry)
        self.front = front  # in front of the engine's generate (a disaggregation role), if any
        self._disagg_stats = disagg_stats
        self.server: RequestServer = server if server is not None else TcpServer()
        self.config: EngineConfig | None = None
        self.info: InstanceInfo | None = None  # set by the owner once it knows its address
        self._validate = validate
        self._monitor = AbortMonitor(engine)
        self._decode_request = msgspec.msgpack.Decoder(PreprocessedRequest).decode
        self._closed = False
        self.counters = WorkerCounters()  # observability: this worker's request counts
        self._handoff_waits: set[asyncio.Task[None]] = set()  # hand-offs whose KV is not pulled yet

    async def start(self) -> EngineConfig:
        """Start the engine and serve ``generate`` (and the model's files) on the server."""
        self.config = await self.engine.start()
        if self.front is not None:
            await self.front.open()
        self.server.register(GENERATE, self._generate)
        if isinstance(self.engine, StepLoopEngine) and isinstance(self.server, StreamServer):
            # its mailbox merges the tokens of the steps a stream was not read: read once per write
            self.server.merging.add(GENERATE)
        self.server.register(MODEL_FILES, self._model_files)
        self.server.register(INFO, self._info)
        self.server.register(KV_DUMP, self._kv_dump)
        self.server.register(KV_EVENTS, self._kv_events)
        self.server.register(FAULT, self._fault)
        self.server.register(LOAD, self._load)
        self.server.register(TUNE, self._tune)
        self.server.register(HANDOFF, self._handoff)
        self.server.register(LORA, self._lora)
        self.server.register(DISAGG_STATS, self._stats)
        self.server.register(METRICS, self._metrics)
        if not getattr(self.server, "started", False):
            await self.server.start()
        return self.config

    @property
    def address(self) -> str:
        server = self.server
        if not isinstance(server, _Addressed):
            raise AttributeError(f"a {type(server).__name__} has no address")
        return server.address

    async def _info(self, payload: bytes, ctx: Context) -> AsyncIterator[InstanceInfo]:
        """This instance's card (static mode has no discovery to read it from)."""
        if self.info is None:
            raise EngineShutdown("this worker is still starting")
        yield self.info

    def _reported(self, value: _R | None, what: str) -> _R:
        """What the engine reported; an engine that reports nothing of the kind is a bad request."""
        if value is None:
            raise InvalidArgument(f"{type(self.engine).__name__} does not report {what}")
        return value

    def _kv_events_source(self) -> KvEventSource:
        engine = self.engine
        if not isinstance(engine, KvEventSource):
            raise InvalidArgument(f"{type(engine).__name__} publishes no KV events")
        return engine

    def _load_report(self) -> LoadReport | None:
        engine = self.engine
        return engine.load_report() if isinstance(engine, LoadReporting) else None

    async def _kv_dump(self, payload: bytes, ctx: Context) -> AsyncIterator[KvDump]:
        yield self._reported(self._kv_events_source().kv_snapshot(), "its KV cache")

    async def _kv_events(self, payload: bytes, ctx: Context) -> AsyncIterator[KvEventsSince]:
        try:
            after = msgspec.msgpack.decode(payload, type=int)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidArgument(f"kv_events wants one integer event id: {exc}") from None
        events = self._kv_events_source().kv_events_since(after)
        yield KvEventsSince(events or [], events is not None)

    async def _load(self, payload: bytes, ctx: Context) -> AsyncIterator[LoadReport]:
        yield self._reported(self._load_report(), "its load")

    async def _stats(self, payload: bytes, ctx: Context) -> AsyncIterator[DisaggStats]:
        stats = self._disagg_stats() if self._disagg_stats is not None else None
        yield stats if stats is not None else DisaggStats()

    def metrics_sample(self) -> WorkerMetrics:
        """This worker's metrics now (the ``metrics`` endpoint, its own ``/metrics``)."""
        worker_id = self.info.worker_id if self.info is not None else 0
        engine = self.engine
        preemptions = engine.preemptions if isinstance(engine, StepLoopEngine) else 0
        return worker_metrics.sample(worker_id, self._load_report(), self.counters, self._disagg_stats, preemptions)

    async def _metrics(self, payload: bytes, ctx: Context) -> AsyncIterator[WorkerMetrics]:
        yield self.metrics_sample()

    async def _tune(self, payload: bytes, ctx: Context) -> AsyncIterator[float]:
        """payload: the batch multiplier (a float in (0, 1]); an engine that cannot change
        its batch at run time (no :class:`~kvmesh.engines.base.BatchTuning`) ignores it."""
        try:
            multiplier = msgspec.msgpack.decode(payload, type=float)
            if isinstance(self.engine, BatchTuning):
                self.engine.set_batch_multiplier(multiplier)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise InvalidArgument(f"tune wants a batch multiplier in (0, 1]: {exc}") from None
        yield multiplier

    async def _lora(self, payload: bytes, ctx: Context) -> AsyncIterator[LoraState]:
        """payload: a :class:`LoraCommand`; answers the adapters held after it. Admin-only
        at the frontend: a load reads a folder on this worker's host."""
        try:
            command = msgspec.msgpack.decode(payload, type=LoraCommand)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidArgument(f"lora wants a LoraCommand (op load|unload|list, name, path): {exc}") from None
        engine = self.engine
        if not isinstance(engine, LoraAdapters):
            raise InvalidArgument(f"{type(engine).__name__} serves no LoRA adapters")
        if command.op == "list":
            yield engine.lora_state()
            return
        if not command.name:
            raise InvalidArgument(f"lora {command.op} needs the adapter's name")
        if command.op == "load":
            yield await engine.lora_load(command.name, command.path)
        else:
            yield await engine.lora_unload(command.name)

    async def _handoff(self, payload: bytes, ctx: Context) -> AsyncIterator[HandOffReport]:
        """The frontend's health checks took this worker out while it still answers: hand
        every in-flight request off with its KV (a front with a KV-transfer server,
        ``--drain-migrate``); without one nothing moves (``kept``: the frontend cuts them,
        so they re-prefill). The KV stays readable until the new workers pulled it."""
        from kvmesh.disagg.engine import DisaggEngine  # here: an aggregated worker starts without the stack
        from kvmesh.health.migration import HandOffReport

        front = self.front
        if not isinstance(front, DisaggEngine):
            yield HandOffReport(kept=max(0, self.server.in_flight - 1))  # all but this call
            return
        report = front.hand_off()
        if report.moved:
            task = asyncio.get_running_loop().create_task(front.wait_handoffs(30.0))
            self._handoff_waits.add(task)
            task.add_done_callback(self._handoff_waits.discard)
        yield report

    async def _fault(self, payload: bytes, ctx: Context) -> AsyncIterator[str]:
        """Switch fault injection at run time: payload = a fault spec string ("" clears)."""
        if self._inject_fault is None:
            raise InvalidArgument(f"{type(self.engine).__name__} has no fault injection")
        try:
            spec = msgspec.msgpack.decode(payload, type=str)
            self._inject_fault(spec)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"bad fault spec: {exc}") from None
        yield spec or "none"

    async def _model_files(self, payload: bytes, ctx: Context) -> AsyncIterator[ModelFiles]:
        """The model folder's small files, for frontends on other hosts."""
        assert self.config is not None
        yield read_model_files(self.config.model, self.config.served_model_name)

    def _generate(self, payload: bytes, ctx: Context) -> AsyncIterator[OutputChunk]:
        """The engine's stream itself (no generator of this method's own: one resume less
        per item)."""
        try:
            request = self._decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            return _failed(InvalidArgument(f"malformed generate request: {exc}"))
        ctx.id = request.request_id
        return run_generate(self.engine, request, ctx, self._monitor, self._validate, self.counters, self.front)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Graceful: stop accepting, let in-flight requests finish, drain, clean up."""
        if self._closed:
            return
        self._closed = True
        await self.server.stop_accepting()
        if not await self.server.wait_idle(grace_s):
            log.warning("grace period of %.1f s over with %d requests in flight", grace_s, self.server.in_flight)
        try:
            if self.front is not None:
                await self.front.drain()
            await self.engine.drain()
        finally:
            try:
                await self.engine.cleanup()
            finally:
                if self.front is not None:
                    await self.front.close()
            await self._monitor.close()
            await self.server.close()
