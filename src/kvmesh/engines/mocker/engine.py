"""``MockerEngine``: the simulated scheduler driven in real time behind the Engine contract.

Shape (one event loop, no threads)::

    generate() ──add──▶ Scheduler ◀──step── step loop (one owned task)
        ▲                                       │ sleeps the step's modelled time,
        └──── one-slot mailbox per request ◀────┘ then delivers tokens / finishes

Mailboxes, ``generate``, cancellation, ``cleanup`` and load reports are the shared
:class:`~kvmesh.engines.batching.engine.StepLoopEngine`'s. What is the mocker's own:

* The step loop is the only caller of ``Scheduler.step``; it idles on an
  :class:`asyncio.Event` when there is no work, and paces steps against a deadline so
  sleep overshoot does not accumulate (a step shorter than ~0.5 ms just yields).
* Its mailbox counts the tokens ever pushed: ``kv_detach`` drops tokens a step made
  but did not deliver.
* ``prefill_remote`` (a prefill worker's job) is a prefill in the scheduler like any
  other (``Seq.prefill_upto``): it takes its share of each pass's token budget and the
  passes take their modelled time, so it delays, and is delayed by, the worker's other
  work. Alone, its passes are ``max_num_batched_tokens`` wide:
  :meth:`MockerOptions.remote_prefill_ms` (what the replay's arms charge for a job).
* Fault injection (:mod:`.faults`): ``options.fault`` at construction, or
  ``set_fault`` at any time. With no fault the step loop pays one ``is None`` test.
* Log-probabilities, for a request that asks for them (``output.logprobs``): the
  oracle's (:func:`~kvmesh.engines.mocker.tokens.logprob_at`, a function of the
  stream key and the position like the token), plus the step's ``logprob_shift`` (a
  ``corrupt`` fault). Requests that do not ask keep the plain mailbox and its hot path.

KV events and load reports go to the publisher given to the constructor. ``start``
resets the pool, so the first event of every start is ``AllBlocksCleared`` (telling
subscribers to drop whatever an earlier incarnation of this worker id published);
event ids count from 0 for the lifetime of the engine object.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.engines.base import KvBlockAccess
from kvmesh.engines.batching.adapters import AdapterHost
from kvmesh.engines.batching.engine import StepLoopEngine
from kvmesh.engines.lora import AdapterFiles, parse_lora_flags
from kvmesh.engines.batching.mailbox import Mailbox
from kvmesh.engines.batching.scheduler import Scheduler as BatchScheduler
from kvmesh.engines.mocker.faults import FaultInjector, FaultSpec
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.scheduler import MockSeq, Scheduler, StepOutput
from kvmesh.engines.mocker.tokens import logprob_at, request_key, top_alternatives
from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.protocol import (
    EngineConfig,
    GuidedDecoding,
    KvLayout,
    KvReservation,
    PreprocessedRequest,
    TokenLogprob,
)
from kvmesh.kv.hashing import chain_hashes, chain_one, local_block_hashes
from kvmesh.runtime.events import EventPublisher

if TYPE_CHECKING:  # the grammar engine (llguidance, numpy): imported by the first guided request
    from kvmesh.preprocess.guided import GuidedTokenizer

__all__ = ["MockerEngine"]

# Steps due sooner than this are not slept for; the loop only yields to other tasks.
_MIN_SLEEP_S = 0.0005
# How far behind its schedule the loop may run to catch up (absorbs sleep overshoot).
_MAX_CATCH_UP_S = 0.005


class _Mailbox(Mailbox):
    """The mocker's slot: tokens, and how many were ever pushed (for ``kv_detach``)."""

    __slots__ = ("pushed",)

    def __init__(self) -> None:
        super().__init__()
        self.pushed = 0

    def push(self, token: int) -> None:
        self.tokens.append(token)
        self.pushed += 1
        self._wake()

    def score(self, token: int, shift: float) -> None:
        """Push ``token``; a plain mailbox keeps no log-probabilities (``push``
        inlined; ``MockerEngine._deliver`` inlines this in turn)."""
        self.tokens.append(token)
        self.pushed += 1
        self._wake()


class _LogprobMailbox(_Mailbox):
    """A slot for a request that asked for log-probabilities: the oracle's, per token.
    ``position``: the absolute position of the next token (as the oracle draws it)."""

    __slots__ = ("key", "position", "top_n", "vocab_size")

    def __init__(self, key: int, position: int, top_n: int, vocab_size: int) -> None:
        super().__init__()
        self.key, self.position, self.top_n, self.vocab_size = key, position, top_n, vocab_size

    def score(self, token: int, shift: float) -> None:
        lp = logprob_at(self.key, self.position) + shift
        top = top_alternatives(token, lp, self.top_n, self.vocab_size) if self.top_n > 0 else []
        self.logprobs.append(TokenLogprob(token, lp, top))
        self.position += 1
        self.push(token)


class _ModelledLoads:
    """The mocker's adapter loads: a checked PEFT folder and ``--lora-load-ms`` of waiting."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def check(self, files: AdapterFiles) -> None:
        """The mocker has no weights to check the adapter against."""

    async def read(self, files: AdapterFiles) -> object:
        await asyncio.sleep(self.seconds)
        return None

    async def install(self, slot: int, files: AdapterFiles, weights: object) -> None:
        """Nothing is held per slot."""

    def clear(self, slot: int) -> None:
        """Nothing is held per slot."""


class MockerEngine(StepLoopEngine[_Mailbox, BatchScheduler[MockSeq]], KvBlockAccess):
    """A simulated vLLM-style engine; see the module docstring."""

    engine_name = "mocker"
    supports_guided = True

    def __init__(
        self,
        options: MockerOptions | None = None,
        publisher: EventPublisher | None = None,
        *,
        exit_fn: Callable[[int], object] = os._exit,
    ) -> None:
        super().__init__(publisher)
        self.options = options if options is not None else MockerOptions()
        self._scheduler = Scheduler(self.options, self._publisher)
        # Fault injection: None unless a fault is set (the step loop's only extra test).
        self._exit_fn = exit_fn  # what a "crash" fault calls; tests pass a recorder
        self._fault: FaultInjector | None = None
        self.set_fault(self.options.fault)
        # set by _admit for the _new_box that follows it: (stream key, next position, top n)
        self._scored: tuple[int, int, int] | None = None
        if self.options.max_loras > 0:  # LoRA adapters: modelled load time and capacity
            known = parse_lora_flags(self.options.loras)
            loader = _ModelledLoads(self.options.lora_load_ms / 1000.0 / self.options.speedup)
            self.adapters = AdapterHost(self.options.max_loras, known, loader, self._adapters_in_use, self._adapters_changed)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> EngineConfig:
        if self._task is None:
            self._scheduler.reset()
            self._start_loop()
            if self.adapters is not None:
                await self.adapters.open()
        return self.config

    @property
    def config(self) -> EngineConfig:
        config = self._scheduler.limits.engine_config(self.options.model, self.options.served_name)
        config.max_adapters = self.options.max_loras
        return config

    async def cleanup(self) -> None:
        if await self._stop_loop():
            self._scheduler.reset()  # publishes AllBlocksCleared: this worker's cache is gone

    def set_fault(self, spec: FaultSpec) -> None:
        """Inject ``spec`` from the next step on (``FaultSpec()`` clears it). Replacing
        a ``hang`` lets the stalled step loop go on."""
        old = self._fault
        self._fault = FaultInjector(spec, self.options.vocab_size, self._exit_fn) if spec.active else None
        if old is not None:
            old.release()

    @property
    def fault(self) -> FaultSpec:
        return FaultSpec() if self._fault is None else self._fault.spec

    # ------------------------------------------------------------------ introspection

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @property
    def active_blocks(self) -> int:
        return self._scheduler.blocks.active_blocks

    def _core(self) -> BatchScheduler[MockSeq]:
        return self._scheduler


    # ------------------------------------------------------------------ KV blocks
    # The mocker has no tensors: a block's "KV" on the wire is an 8-byte digest of the
    # tokens it holds (the chained block hash; a partial block hashes its partial
    # tokens). Imports are checked against the digests the receiver expects when the
    # reservation is committed, so a transfer that moved the wrong blocks fails loudly.

    def kv_layout(self) -> KvLayout:
        opts = self.options
        return KvLayout(
            engine="mocker",
            block_size=opts.block_size,
            num_blocks=opts.num_blocks,
            block_shape=(opts.block_size, opts.kv_bytes_per_token),
            dtype="uint8",
            bytes_per_block=opts.block_size * opts.kv_bytes_per_token,
            wire_bytes_per_block=_DIGEST.size,
            simulated_bytes_per_s=opts.kv_bandwidth * opts.speedup,
        )

    def kv_reserve(self, request: PreprocessedRequest) -> KvReservation | None:
        seq = self._scheduler.reserve_request(request)
        if seq is None:
            return None
        return KvReservation(request.request_id, self._scheduler.block_table(seq), len(seq.tokens), seq.num_computed)

    def kv_release(self, request_id: str) -> None:
        self._scheduler.release(request_id)

    def kv_export(self, block_ids: Sequence[int]) -> bytes:
        bs = self.options.block_size
        digests: dict[int, list[int]] = {}
        out = bytearray()
        for seq, index in self._locate(block_ids):
            if index * bs >= seq.num_computed:
                raise InvalidArgument(f"block {index} of request {seq.request_id!r} holds no computed KV yet")
            if seq.id not in digests:
                digests[seq.id] = block_digests(seq.tokens, seq.num_computed, bs)
            out += _DIGEST.pack(digests[seq.id][index])
        return bytes(out)

    def kv_import(self, block_ids: Sequence[int], data: bytes) -> None:
        size = _DIGEST.size
        if len(data) != size * len(block_ids):
            raise InvalidArgument(f"KV import of {len(block_ids)} blocks needs {size * len(block_ids)} bytes, got {len(data)}")
        for i, (seq, index) in enumerate(self._locate(block_ids)):
            seq.imported[index] = _DIGEST.unpack_from(data, i * size)[0]

    def kv_commit(self, request_id: str, computed_tokens: int) -> None:
        sched = self._scheduler
        seq = sched.reservation(request_id)
        if seq is None:
            raise InvalidArgument(f"no KV reservation for request {request_id!r}")
        bs = self.options.block_size
        want = block_digests(seq.tokens, computed_tokens, bs)
        for index in range(seq.num_computed // bs, len(want)):
            if seq.imported.get(index) != want[index]:
                raise InvalidArgument(f"KV block {index} of request {request_id!r} was not imported or holds other tokens")
        seq.imported.clear()
        sched.commit_reserved(request_id, computed_tokens)

    async def prefill_remote(
        self, request: PreprocessedRequest, prefix_kv: bytes, cached_tokens: int, upto: int
    ) -> bytes:
        bs = self.options.block_size
        tokens = request.token_ids
        if cached_tokens % bs or not 0 <= cached_tokens < upto <= len(tokens):
            raise InvalidArgument(f"remote prefill range [{cached_tokens}, {upto}) of {len(tokens)} tokens is not valid")
        digests = block_digests(tokens, upto, bs)
        first = cached_tokens // bs
        if len(prefix_kv) != first * _DIGEST.size or any(
            _DIGEST.unpack_from(prefix_kv, i * _DIGEST.size)[0] != digests[i] for i in range(first)
        ):
            raise InvalidArgument(f"the prefix KV read for request {request.request_id!r} holds other tokens")
        # a prefill in the step loop like any other: it shares passes (and their modelled
        # time) with the rest of this worker's work; its digests are the tokens' own
        seq = self._scheduler.submit_prefill(request, cached_tokens, upto)
        if seq is None:
            raise ResourceExhausted(f"no KV room for a remote prefill of {upto} tokens")
        try:
            await self._prefill_in_loop(seq.id)
        finally:
            self._release_prefill(seq.id)
        return b"".join(_DIGEST.pack(d) for d in digests[first:])

    def kv_detach(self, request_id: str) -> KvReservation | None:
        sid = self._sids.get(request_id)
        box = None if sid is None else self._boxes.get(sid)
        if sid is None or box is None:
            return None
        # a step in progress may have sampled a token not delivered yet: it is dropped
        seq = self._scheduler.detach_delivered(sid, box.pushed)
        if seq is None:
            return None
        del self._boxes[sid]
        box.cancel()
        return KvReservation(request_id, self._scheduler.block_table(seq), len(seq.tokens), seq.num_computed)

    def _locate(self, block_ids: Sequence[int]) -> list[tuple[MockSeq, int]]:
        """(reservation sequence, index in its block table) of each block id."""
        where: dict[int, tuple[MockSeq, int]] = {}
        for seq in self._scheduler.reservations():
            for index, b in enumerate(self._scheduler.block_table(seq)):
                where[b] = (seq, index)
        try:
            return [where[b] for b in block_ids]
        except KeyError as exc:
            raise InvalidArgument(f"KV block {exc.args[0]} belongs to no reservation on this worker") from None

    # ------------------------------------------------------------------ requests

    def _admit(self, request: PreprocessedRequest) -> int:
        if request.guided is not None and self._scheduler.guided is None:
            raise InvalidArgument("structured outputs on the mocker need its model folder's tokenizer.json")
        sid = self._scheduler.submit(request)
        n = request.output.logprobs
        self._scored = None if n is None else (request_key(request), len(request.token_ids), n)
        return sid

    async def _prepare_guided(self, request: PreprocessedRequest) -> None:
        """The model folder's tokenizer for the grammar engine (once), the grammar compiled (cached), in a thread."""
        guided = request.guided
        if guided is not None:
            self._scheduler.guided = await asyncio.to_thread(self._guided_tokenizer, guided)

    def _guided_tokenizer(self, guided: GuidedDecoding) -> GuidedTokenizer:
        tok = self._scheduler.guided
        if tok is None:
            folder = Path(self.options.model)
            if not (folder / "tokenizer.json").is_file():
                raise InvalidArgument(
                    "structured outputs on the mocker need a model folder with tokenizer.json (--model-path)"
                )
            from kvmesh.preprocess.guided import GuidedTokenizer

            opts = self.options
            eos = opts.eos_token_ids or (0,)
            tok = GuidedTokenizer.from_folder(folder, opts.vocab_size, eos)
        tok.compile(guided)
        return tok

    def _new_box(self, seq_id: int) -> _Mailbox:
        scored, self._scored = self._scored, None
        if scored is None:
            return _Mailbox()
        return _LogprobMailbox(*scored, self.options.vocab_size)

    # ------------------------------------------------------------------ step loop

    async def _loop(self, wake: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        sched = self._scheduler
        interval = self.options.load_report_interval_steps
        deadline = loop.time()
        steps = 0
        while True:
            if await self._idle(sched, wake):
                deadline = loop.time()
                continue
            out = sched.step()
            fault = self._fault
            if fault is not None:  # injected fault: may slow, corrupt, stall or end the loop
                out = await fault.apply(out)
            deadline = max(deadline, loop.time() - _MAX_CATCH_UP_S) + out.duration_ms / 1000.0
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > _MIN_SLEEP_S else 0)
            self._deliver(out)
            steps += 1
            if steps % interval == 0:
                self._publish_load()

    def _deliver(self, out: StepOutput) -> None:
        boxes = self._boxes
        shift = out.logprob_shift
        plain = _Mailbox
        for sid, token in out.tokens.items():
            box = boxes.get(sid)
            if box is None:
                continue
            if type(box) is plain:  # _Mailbox.score inlined (once per token per step)
                box.tokens.append(token)
                box.pushed += 1
                waiter = box._waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            else:
                box.score(token, shift)
        self._deliver_finished(out.finished)


_DIGEST = struct.Struct("<Q")


def block_digests(tokens: Sequence[int], upto: int, block_size: int) -> list[int]:
    """The mocker's stand-in for KV content: one chained hash per block of
    ``tokens[:upto]`` (the last block may be partial and hashes only its tokens)."""
    full = upto // block_size
    out = chain_hashes(local_block_hashes(tokens[: full * block_size], block_size))
    if upto > full * block_size:
        part = tokens[full * block_size : upto]
        out.append(chain_one(out[-1] if out else None, local_block_hashes(part, len(part))[0]))
    return out
