"""``HfEngine``: a Llama-family Hugging Face model on the CPU or a CUDA GPU, behind the Engine contract.

Shape (one event loop, one forward thread)::

    generate() ──add──▶ Scheduler ◀── step loop (one owned task, on the loop)
        ▲                               │ schedule → inputs (loop)
        │                               │ forward + sample (the one "hf-forward" thread)
        └── one-slot mailbox ◀──────────┘ complete: stop rules, KV events (loop)

* **Device** (:mod:`.device`): ``--device``/``--dtype``; on a GPU the weights load
  straight onto it, the KV pool takes what ``--gpu-memory-fraction`` of the card leaves,
  a pass is *paged* (decode rows through the paged decode kernel, prefill chunks on
  their own: :func:`~.batch.make_paged_inputs`) and decode batches replay CUDA graphs
  captured at start (:attr:`HfEngine.graph_capture_s`). ``--random-weights SHAPE``:
  synthetic weights in a Llama shape (:mod:`.shapes`), logged as such.
* **Continuous batching**: every pass runs the decode token of every running request
  and prefill chunks of new ones as one packed forward (:mod:`.model`); requests
  join and leave between passes. :attr:`HfEngine.stats` counts passes and tokens.
* **Threads**: scheduler state, mailboxes and events live on the event loop only. The
  forward thread receives immutable tensors and per-row sampling parameters and
  returns tokens (a pass of a few tokens that last cost under 2 ms of CPU, a small
  model's decode step, runs on the loop itself and then yields once: the hand-off
  would cost more than the pass); it writes the KV pool only at the slots of the pass's own new
  tokens. NOTE: blocks of a sequence aborted, released or detached during a pass stay
  allocated until the pass ends (the scheduler defers their freeing), so no other
  request can be given, or import into, a block the thread is writing.
* **Cancellation**: ``ctx.on_stop`` drops the request from the scheduler at once and
  wakes its stream, which ends ``cancelled`` without waiting for the pass in flight.
* **KV block access** (:meth:`kv_export` & co.): real fp32 tensors, ``bytes_per_block``
  on the wire (:mod:`.kv`). Export/import run on the loop, while a pass may be running:
  they touch only blocks the pass does not write (reserved ones; an exported prefix is
  cached content, which is never rewritten).
* **Mailboxes, generate, cancellation, load reports**: the shared
  :class:`~kvmesh.engines.batching.engine.StepLoopEngine`'s.
* **Structured outputs** (``request.guided``): the grammar is compiled in a worker
  thread before the request is admitted (cached per distinct constraint,
  :mod:`kvmesh.preprocess.guided`); the sampler masks each guided row's logits in the
  forward thread, and a row near its ``max_tokens`` prefers tokens that close the output.
* **Prefix caching, KV events, load reports**: the shared batching block manager, so the
  KV router treats an ``hf`` worker like any other. ``start`` resets the pool, so the
  first event of every start is ``AllBlocksCleared``.
* **LoRA adapters** (``--lora``, ``--max-loras``, the ``lora`` endpoint): PEFT folders
  checked against the model, their weights in the slots of a :class:`~.lora.LoraBank`
  (written by the forward thread); a pass mixes any adapters, each row with its own
  (:mod:`.lora`), and a request's block hashes are salted with its adapter.
* **KV tiers** (``--hf-host-kv-blocks``, ``--hf-disk-kv-blocks``/``--hf-disk-kv-path``):
  the block manager's write-downs and onboardings move the real K/V (:mod:`.tiers`),
  copied on the loop while it schedules (a GPU: on a side stream the next pass waits for).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvmesh.engines.base import KvBlockAccess
from kvmesh.engines.batching.adapters import AdapterHost
from kvmesh.engines.batching.engine import StepLoopEngine
from kvmesh.engines.batching.mailbox import Mailbox
from kvmesh.engines.hf.batch import Chunk, make_inputs, make_paged_inputs
from kvmesh.engines.hf.cpus import auto_threads
from kvmesh.engines.hf.device import DecodeGraphs, gpu_kv_bytes, profile_peak, resolve_device, resolve_dtype
from kvmesh.engines.hf.kv import KvPool
from kvmesh.engines.hf.tiers import HfTiers
from kvmesh.engines.hf.lora import LoraBank, load_tensors, projection_shapes
from kvmesh.engines.lora import AdapterFiles, check_against, parse_lora_flags
from kvmesh.kv.hashing import hash_salt
from kvmesh.engines.hf.model import LlamaModel, LlamaSpec, StepInputs, load_weights
from kvmesh.engines.hf.options import HfOptions
from kvmesh.engines.hf.sampling import Sampled, SampleParams, params_for, sample
from kvmesh.engines.batching.scheduler import priority_rank
from kvmesh.engines.hf.scheduler import Plan, Scheduler, SchedulerLimits, Seq
from kvmesh.errors import EngineShutdown, InvalidArgument, ResourceExhausted
from kvmesh.preprocess.guided import GuidedTokenizer
from kvmesh.protocol import EngineConfig, KvLayout, KvReservation, OutputChunk, PreprocessedRequest
from kvmesh.runtime.events import EventPublisher

__all__ = ["HfEngine", "EngineStats"]

_log = logging.getLogger(__name__)

# With work queued but nothing schedulable (the pool is held by reservations), how
# long the loop waits for a release before looking again.
_IDLE_POLL_S = 0.05

# A pass of at most this many tokens, when the last such pass cost the forward less than
# this much CPU, runs on the event loop itself: for a small model's decode step the two
# thread switches of a hand-off cost more than the pass (and far more on a loaded host).
_INLINE_TOKENS = 16
_INLINE_CPU_S = 0.002


@dataclass
class EngineStats:
    """Counters since start: forward passes, tokens through them, the largest batch."""

    steps: int = 0
    forward_tokens: int = 0
    max_batch: int = 0
    forward_s: float = 0.0


class _Mailbox(Mailbox):
    """The hf engine's slot: tokens, their logprobs, and the sequence (its cached tokens
    go with the first chunk)."""

    __slots__ = ("seq",)

    def __init__(self, seq: Seq | None = None) -> None:
        super().__init__()
        self.seq = seq

    def push(self, s: Sampled) -> None:
        self.tokens.append(s.token)
        if s.logprob is not None:
            self.logprobs.append(s.logprob)
        self._wake()


@dataclass(frozen=True, slots=True)
class _Loaded:
    """What ``start`` builds; None before it and after ``cleanup``."""

    model: LlamaModel
    pool: KvPool
    context_length: int
    eos_ids: frozenset[int]
    name: str
    graphs: DecodeGraphs | None = None
    sample_vocab: int = 0  # logits columns the sampler sees (the tokenizer's, under synthetic weights); 0: all
    paged: bool = False  # paged passes (a GPU's; the CPU's are packed)
    tiers: HfTiers | None = None  # KV tiers below the pool (--hf-host-kv-blocks, --hf-disk-kv-blocks)

    def prepare(self, chunks: list[Chunk], block_size: int) -> StepInputs | tuple[int, list[Chunk]]:
        """A pass's inputs: a graph's bucket and its chunks when a decode graph replays
        them, else the tensors of a packed (CPU) or paged (GPU) pass."""
        if not self.paged:
            return make_inputs(chunks, block_size)
        graphed = self.graphs is not None and not any(c.lora_slot for c in chunks)  # graphs hold no adapters
        bucket = self.graphs.bucket(chunks) if graphed and self.graphs is not None else None
        if bucket is not None:
            return bucket, chunks
        return make_paged_inputs(chunks, block_size, self.model.device)

    def forward(self, work: StepInputs | tuple[int, list[Chunk]]) -> torch.Tensor:
        if self.tiers is not None:
            self.tiers.before_forward()  # a GPU's onboarding copies land first
        if isinstance(work, StepInputs):
            logits = self.model.forward(work, self.pool)
        else:
            assert self.graphs is not None
            logits = self.graphs.run(work[1], work[0])
        return logits[:, : self.sample_vocab] if self.sample_vocab else logits


class HfEngine(StepLoopEngine[_Mailbox, Scheduler], KvBlockAccess):
    """A real model on the CPU with continuous batching; see the module docstring."""

    engine_name = "hf"
    supports_guided = True

    def __init__(self, options: HfOptions, publisher: EventPublisher | None = None) -> None:
        super().__init__(publisher)
        self.options = options
        self._loaded: _Loaded | None = None
        self._scheduler: Scheduler | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._default_gen = torch.Generator()
        self._guided: GuidedTokenizer | None = None
        self._small_cpu_s = math.inf  # CPU seconds of the last pass of <= _INLINE_TOKENS tokens
        self.stats = EngineStats()
        if options.max_loras > 0:
            known = parse_lora_flags(options.loras)
            self.adapters = AdapterHost(options.max_loras, known, _HfLoads(self), self._adapters_in_use, self._adapters_changed)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> EngineConfig:
        if self._task is not None:
            return self.config
        device = resolve_device(self.options.device)
        if device.type == "cpu":
            torch.set_num_threads(self.options.threads or auto_threads())
        self._loaded = await asyncio.to_thread(self._load, device)
        loaded = self._loaded
        self._scheduler = Scheduler(self._limits(loaded), self._publisher)
        self._scheduler.blocks.slots = loaded.tiers  # the tiers' tensors follow the block manager's moves
        self._scheduler.reset()  # AllBlocksCleared: drop what an earlier incarnation published
        seed = self.options.seed
        self._default_gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf-forward")
        self.stats = EngineStats()
        self._start_loop()
        if self.adapters is not None:
            await self.adapters.open()
        return self.config

    def _load(self, device: torch.device) -> _Loaded:
        """Read the folder and the weights, size and allocate the KV pool, capture the
        decode graphs on a GPU (a thread)."""
        from kvmesh.preprocess.model import load_model_folder

        opts = self.options
        info = load_model_folder(opts.model_path, name=opts.served_model_name)
        dtype = resolve_dtype(opts.dtype, device, opts.model_path)
        model = self._model(device, dtype)
        spec = model.spec
        context = spec.max_position_embeddings
        if not opts.random_weights:  # synthetic weights: the shape's context, not the tokenizer folder's
            context = min(info.context_length, context)
        num_blocks = opts.num_blocks or self._auto_blocks(model, context)
        pool = KvPool(
            num_blocks, opts.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device
        )
        context = min(context, num_blocks * opts.block_size)
        graphs = None
        if device.type == "cuda" and not opts.enforce_eager:
            graphs = DecodeGraphs(model, pool, opts.max_num_seqs, context)
            graphs.capture()
            _log.info("hf engine: %d decode CUDA graphs captured in %.2f s", len(graphs.buckets), graphs.capture_s)
        _log.info(
            "hf engine: %s on %s (%s), %d KV blocks of %d tokens, context %d",
            info.name, device, str(dtype).removeprefix("torch."), num_blocks, opts.block_size, context,
        )  # fmt: skip
        vocab = info.vocab_size if opts.random_weights and info.vocab_size < spec.vocab_size else 0
        paged = device.type == "cuda"
        tiers = None
        if opts.host_kv_blocks or opts.disk_kv_blocks:
            tiers = HfTiers(pool, opts.host_kv_blocks, opts.disk_kv_blocks, opts.disk_kv_path)
        return _Loaded(model, pool, context, frozenset(info.eos_token_ids), info.name, graphs, vocab, paged, tiers)

    def _model(self, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        """The folder's model on ``device`` as ``dtype``, or synthetic weights in a named shape."""
        opts = self.options
        if not opts.random_weights:
            spec = LlamaSpec.from_folder(opts.model_path)
            return LlamaModel(spec, load_weights(opts.model_path, spec, device=device, dtype=dtype))
        from kvmesh.engines.hf.shapes import random_weights, shape_config

        spec = LlamaSpec.from_config(shape_config(opts.random_weights), f"--random-weights {opts.random_weights}")
        _log.warning(
            "hf engine: SYNTHETIC weights in the %s shape (random values, seed %d): the text is noise; the model "
            "folder gives only the tokenizer", opts.random_weights, opts.seed or 0,
        )  # fmt: skip
        return LlamaModel(spec, random_weights(spec, seed=opts.seed or 0, device=device, dtype=dtype))

    def _auto_blocks(self, model: LlamaModel, context: int) -> int:
        """KV blocks when ``--hf-num-blocks`` is not given: ``--hf-kv-cache-mb`` on the CPU,
        what ``--gpu-memory-fraction`` leaves on a GPU; never more than ``max_num_seqs``
        full contexts."""
        opts, spec = self.options, model.spec
        item = model.dtype.itemsize
        per_block = KvPool.bytes_per_block_for(opts.block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, item)
        if model.device.type == "cuda":
            peak = profile_peak(model, min(opts.max_num_batched_tokens, context), opts.block_size)
            budget = gpu_kv_bytes(model.device, opts.gpu_memory_fraction, peak, opts.max_num_seqs, spec.vocab_size)
            if budget < per_block:
                raise ResourceExhausted(
                    f"--gpu-memory-fraction {opts.gpu_memory_fraction} leaves no room for the KV cache on "
                    f"{model.device} after the weights and a pass's activations ({peak >> 20} MiB)"
                )
            budget //= per_block
        else:
            budget = (opts.kv_cache_mb << 20) // per_block
        enough = opts.max_num_seqs * -(-context // opts.block_size)
        return max(1, min(budget, enough))

    def _guided_tokenizer(self) -> GuidedTokenizer:
        """The model's tokenizer for the grammar engine, built on first use."""
        if self._guided is None:
            loaded = self._require()
            self._guided = GuidedTokenizer.from_folder(
                self.options.model_path, loaded.model.spec.vocab_size, sorted(loaded.eos_ids)
            )
        return self._guided

    async def _prepare_guided(self, request: PreprocessedRequest) -> None:
        if request.guided is not None:
            guided = request.guided
            await asyncio.to_thread(lambda: self._guided_tokenizer().compile(guided))

    def _limits(self, loaded: _Loaded) -> SchedulerLimits:
        return SchedulerLimits.of(self.options, num_blocks=loaded.pool.num_blocks, context_length=loaded.context_length)

    @property
    def config(self) -> EngineConfig:
        config = self._started_core().limits.engine_config(self.options.model_path, self._require().name)
        config.max_adapters = self.options.max_loras
        return config

    async def cleanup(self) -> None:
        await self._stop_loop()
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        if self._scheduler is not None:
            self._scheduler.reset()  # AllBlocksCleared: this worker's cache is gone
        self._scheduler = None
        self._loaded = None

    def _require(self) -> _Loaded:
        if self._loaded is None:
            raise EngineShutdown("hf engine is not started")
        return self._loaded

    def _core(self) -> Scheduler | None:
        return self._scheduler

    # ------------------------------------------------------------------ introspection

    @property
    def scheduler(self) -> Scheduler:
        return self._started_core()

    @property
    def graph_capture_s(self) -> float | None:
        """Seconds the decode CUDA graphs took to capture at start (None: none captured)."""
        graphs = self._loaded.graphs if self._loaded is not None else None
        return graphs.capture_s if graphs is not None else None

    # ------------------------------------------------------------------ requests

    def _new_seq(self, request: PreprocessedRequest, *, prefill_upto: int | None = None) -> Seq:
        """Check ``request`` and make its sequence; raises InvalidArgument."""
        loaded = self._require()
        tokens = list(request.token_ids)
        vocab = loaded.model.spec.vocab_size
        if not tokens:
            raise InvalidArgument("empty prompt")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"token ids {bad[:4]} are outside the vocabulary (0..{vocab - 1})")
        room = loaded.context_length - len(tokens)
        if room <= 0:
            raise InvalidArgument(f"prompt of {len(tokens)} tokens leaves no room in context length {loaded.context_length}")
        stop = request.stop
        if stop.max_tokens is not None and stop.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {stop.max_tokens}")
        if stop.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, got {stop.min_tokens}")
        max_tokens = room if stop.max_tokens is None else min(stop.max_tokens, room)
        params = params_for(request, vocab, self._default_gen)
        if request.guided is not None and prefill_upto is None:  # a remote prefill samples nothing
            origin = request.original_prompt_len
            generated = tokens[origin:] if origin is not None else []
            params.guide = self._guided_tokenizer().guide(request.guided, generated)
        seq = Seq(
            request.request_id,
            tokens,
            params,
            max_tokens=max_tokens,
            min_tokens=stop.min_tokens,
            ignore_eos=stop.ignore_eos,
            eos_ids=loaded.eos_ids | frozenset(request.eos_token_ids),
            stop_ids=frozenset(request.stop.stop_token_ids),
            rank=priority_rank(request.routing.priority if request.routing else None),
            prefill_upto=prefill_upto,
            salt=hash_salt(request.adapter, request.cache_salt),  # no KV block shared across adapters
            adapter=request.adapter,
        )
        if request.adapter is not None:  # resident: StepLoopEngine.generate made it so
            seq.lora_slot = self._lora().slot(request.adapter)
        return seq

    def _enqueue(self, request: PreprocessedRequest) -> Seq:
        """The request's sequence queued: its reservation if it holds one, else new."""
        sched = self._started_core()
        held = sched.reservation(request.request_id)
        if held is not None and held.tokens != list(request.token_ids):
            sched.release(request.request_id)
            raise InvalidArgument(f"request {request.request_id!r} does not match the tokens of its KV reservation")
        fresh = self._new_seq(request)  # checks the request even when a reservation exists
        seq = sched.adopt(request.request_id)
        if seq is None:
            sched.add(fresh)
            return fresh
        # the reservation brings blocks and computed tokens; this request brings the rest
        seq.prompt_len, seq.params = fresh.prompt_len, fresh.params
        seq.max_tokens, seq.min_tokens, seq.ignore_eos = fresh.max_tokens, fresh.min_tokens, fresh.ignore_eos
        seq.eos_ids, seq.stop_ids, seq.rank = fresh.eos_ids, fresh.stop_ids, fresh.rank
        seq.lora_slot = fresh.lora_slot
        return seq

    def _admit(self, request: PreprocessedRequest) -> int:
        return self._enqueue(request).id

    def _new_box(self, seq_id: int) -> _Mailbox:
        return _Mailbox(self._started_core().get(seq_id))

    def _chunk(self, box: _Mailbox, first: bool) -> OutputChunk:
        return box.chunk(cached_tokens=box.seq.cached_tokens if first and box.seq is not None else None)

    # ------------------------------------------------------------------ step loop

    async def _loop(self, wake: asyncio.Event) -> None:
        sched = self._started_core()
        while True:
            if await self._idle(sched, wake):
                continue
            plan = sched.schedule()
            self._deliver_finished(plan.failed)
            if not plan.entries:
                wake.clear()  # nothing fits now: wait for a release (or poll)
                try:
                    await asyncio.wait_for(wake.wait(), _IDLE_POLL_S)
                except TimeoutError:
                    pass
                continue
            await self._step(sched, plan)
            self._publish_load()

    async def _step(self, sched: Scheduler, plan: Plan[Seq]) -> None:
        """Run one planned pass in the forward thread and apply its results."""
        samplers = plan.samples
        loaded = self._require()
        inputs = loaded.prepare(self._chunks(sched, plan), self.options.block_size)
        params = [self._row_params(s) for s in samplers]
        t0 = time.perf_counter()
        small = plan.num_tokens <= _INLINE_TOKENS and loaded.model.device.type == "cpu"  # a GPU waits off the loop
        inline = small and self._small_cpu_s < _INLINE_CPU_S
        if inline:
            sampled, cpu = _forward_and_sample(loaded, inputs, params)
        else:
            loop = asyncio.get_running_loop()
            sampled, cpu = await loop.run_in_executor(self._executor, _forward_and_sample, loaded, inputs, params)
        if small:
            self._small_cpu_s = cpu
        self._count(plan, time.perf_counter() - t0)
        by_seq = {s.id: r for s, r in zip(samplers, sampled, strict=True)}
        finished, emitted = sched.complete(plan, {sid: r.token for sid, r in by_seq.items()})
        for sid in emitted:
            box = self._boxes.get(sid)
            if box is not None:
                box.push(by_seq[sid])
        self._deliver_finished(finished)
        if inline:
            await asyncio.sleep(0)  # let the streams (and the rest of the loop) run between passes

    def _chunks(self, sched: Scheduler, plan: Plan[Seq]) -> list[Chunk]:
        bs = self.options.block_size
        chunks = []
        for seq, n in plan.entries:
            start = seq.num_computed
            table = sched.block_table(seq)[: -(-(start + n) // bs)]
            wants = seq.prefill_upto is None and start + n == len(seq.tokens)
            chunks.append(Chunk(seq.tokens[start : start + n], start, table, wants, seq.lora_slot))
        return chunks

    @staticmethod
    def _row_params(seq: Seq) -> SampleParams:
        """The sequence's sampling parameters with this step's bans and token history
        (a copy: the forward thread must not see later changes)."""
        p = seq.params
        left = seq.max_tokens - seq.num_output if p.guide is not None else None
        if not p.penalised:
            return dataclasses.replace(p, banned=seq.banned(), remaining=left)
        history = tuple(seq.tokens)
        return dataclasses.replace(
            p, banned=seq.banned(), history=history, output=history[seq.prompt_len :], remaining=left
        )

    def _count(self, plan: Plan[Seq], seconds: float) -> None:
        st = self.stats
        st.steps += 1
        st.forward_tokens += plan.num_tokens
        st.max_batch = max(st.max_batch, len(plan.entries))
        st.forward_s += seconds

    # ------------------------------------------------------------------ KV blocks

    def kv_layout(self) -> KvLayout | None:
        if self._loaded is None:
            return None
        pool = self._loaded.pool
        return KvLayout(
            engine="hf",
            block_size=pool.block_size,
            num_blocks=pool.num_blocks,
            block_shape=pool.block_shape,
            dtype=pool.dtype_name,
            bytes_per_block=pool.bytes_per_block,
            wire_bytes_per_block=pool.bytes_per_block,
        )

    def kv_reserve(self, request: PreprocessedRequest) -> KvReservation | None:
        sched = self._started_core()
        if sched.reservation(request.request_id) is not None:
            raise InvalidArgument(f"request {request.request_id!r} already holds a KV reservation")
        seq = self._new_seq(request)
        if not sched.reserve(seq):
            return None
        return _reservation(sched, seq)

    def kv_release(self, request_id: str) -> None:
        if self._scheduler is not None and self._scheduler.release(request_id):
            self._wake_loop()

    def kv_export(self, block_ids: Sequence[int]) -> bytes:
        return self._require().pool.export(block_ids)

    def kv_import(self, block_ids: Sequence[int], data: bytes) -> None:
        writable = self._writable_blocks()
        refused = [b for b in block_ids if b not in writable]
        if refused:
            raise InvalidArgument(f"KV blocks {refused[:4]} belong to no reservation's uncomputed part on this worker")
        self._require().pool.import_(block_ids, data)

    def _writable_blocks(self) -> set[int]:
        """Blocks a KV import may overwrite: reservations' blocks past their valid prefix."""
        sched = self._started_core()
        bs = self.options.block_size
        out: set[int] = set()
        for seq in sched.reservations():
            out.update(sched.block_table(seq)[seq.num_computed // bs :])
        return out

    def kv_commit(self, request_id: str, computed_tokens: int) -> None:
        sched = self._started_core()
        if sched.reservation(request_id) is None:
            raise InvalidArgument(f"no KV reservation for request {request_id!r}")
        try:
            sched.commit_reserved(request_id, computed_tokens)
        except ValueError as exc:
            raise InvalidArgument(f"KV commit of request {request_id!r}: {exc}") from None

    def kv_detach(self, request_id: str) -> KvReservation | None:
        sid = self._sids.get(request_id)
        sched = self._scheduler
        if sid is None or sched is None:
            return None
        seq = sched.detach(sid)
        box = self._boxes.pop(sid, None)
        if seq is None:
            return None
        if box is not None:
            box.cancel()
        return _reservation(sched, seq)

    async def prefill_remote(
        self, request: PreprocessedRequest, prefix_kv: bytes, cached_tokens: int, upto: int
    ) -> bytes:
        loaded, sched = self._require(), self._started_core()
        bs = self.options.block_size
        if cached_tokens % bs or not 0 <= cached_tokens < upto <= len(request.token_ids):
            raise InvalidArgument(
                f"remote prefill range [{cached_tokens}, {upto}) of {len(request.token_ids)} tokens is not valid"
            )
        first = cached_tokens // bs
        if len(prefix_kv) != first * loaded.pool.bytes_per_block:
            raise InvalidArgument(f"prefix KV of {len(prefix_kv)} bytes does not hold {first} blocks")
        if request.adapter is not None:  # its adapter resident, then held so until the prefill is out
            await self._lora().prepare(request)
        with self._pin_adapter(request.adapter):
            seq = self._new_seq(request, prefill_upto=upto)
            if not sched.hold_prefill(seq, cached_tokens):
                raise ResourceExhausted(f"no KV room for a remote prefill of {upto} tokens")
            table = sched.block_table(seq)
            try:
                await self._prefill_in_loop(seq.id, lambda: loaded.pool.import_(table[:first], prefix_kv))
                return loaded.pool.export(table[first : -(-upto // bs)])
            finally:
                self._release_prefill(seq.id)

class _HfLoads:
    """The hf engine's adapter loads: checked against the model's shapes, tensors read
    in a thread, written into the bank's slot by the forward thread."""

    def __init__(self, engine: HfEngine) -> None:
        self._engine = engine

    def _shapes(self) -> dict[str, tuple[int, int]]:
        spec = self._engine._require().model.spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return projection_shapes(spec.hidden_size, q, kv, spec.intermediate_size)

    def check(self, files: AdapterFiles) -> None:
        spec = self._engine._require().model.spec
        check_against(files, spec.num_layers, self._shapes(), self._engine.options.max_lora_rank)

    async def read(self, files: AdapterFiles) -> object:
        return await asyncio.to_thread(load_tensors, files)

    async def install(self, slot: int, files: AdapterFiles, weights: object) -> None:
        assert isinstance(weights, dict)
        tensors: dict[str, torch.Tensor] = weights
        engine = self._engine
        model, opts = engine._require().model, engine.options
        if model.lora is None:  # the first adapter: the slots' weights, all zero
            model.lora = LoraBank(
                model.spec.num_layers, self._shapes(), opts.max_loras, opts.max_lora_rank, model.device, model.dtype
            )
        await asyncio.get_running_loop().run_in_executor(engine._executor, model.lora.write, slot, files, tensors)

    def clear(self, slot: int) -> None:
        """Nothing to do: no row runs with a slot that holds no resident adapter."""


def _reservation(sched: Scheduler, seq: Seq) -> KvReservation:
    return KvReservation(seq.request_id, sched.block_table(seq), len(seq.tokens), seq.num_computed)


@torch.inference_mode()
def _forward_and_sample(
    loaded: _Loaded, inputs: StepInputs | tuple[int, list[Chunk]], params: list[SampleParams]
) -> tuple[list[Sampled], float]:
    """The forward thread's whole job for one pass: the tokens, and the CPU seconds it took."""
    c0 = time.thread_time()
    logits = loaded.forward(inputs)
    return (sample(logits, params) if params else []), time.thread_time() - c0
