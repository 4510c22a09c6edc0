"""The mocker's scheduler: the shared batching core (:mod:`kvmesh.engines.batching.scheduler`)
plus a token oracle and a timing model. Pure: no asyncio, no clock.

Lifecycle (the engine or the virtual-clock driver calls, one at a time)::

    sid = scheduler.submit(request)   queue a request; returns its sequence id
    out = scheduler.step()            plan and "run" one forward pass, return what it made
    scheduler.abort(sid)              drop a request wherever it is, freeing its blocks

One step: the shared core plans the pass (priority tiers, running requests with
chunked prefill and preemption, then waiting ones; see its module docstring), the
oracle draws one token (:mod:`kvmesh.engines.mocker.tokens`) for every request whose
sequence the pass completes, and the core applies the pass: computed tokens advance,
full blocks join the prefix cache, finish rules free the blocks of ended requests.

With KV tiers (``host_kv_blocks``/``disk_kv_blocks``), the blocks the pass's
admissions brought up from host memory or disk cost their bytes ÷ the tier's bandwidth,
overlapped with the pass's decode part (:meth:`MockerOptions.tiered_step_ms`); writing
blocks down is off the critical path (free).

The step's modelled duration is :meth:`MockerOptions.step_ms` over the pass's new
prefill tokens (all of its prefills together), its decode count and the KV its decodes
attend to (:class:`~kvmesh.engines.batching.scheduler.Plan`). With
``long_prefill_token_threshold`` set (off by default, as in vLLM), a long prompt takes
at most that many tokens of a pass while other prefills share it, and one long prompt
prefills at a time, so short requests are admitted beside it.

Finish rules: a natural EOS ends the stream with ``stop`` and is *not* emitted; a
drawn token in ``stop_token_ids`` ends it with ``stop`` and *is* emitted; both only
once ``min_tokens`` tokens are out (EOS checks are skipped with ``ignore_eos``, stop
token ids still apply). A natural EOS never takes the first position after the user's
prompt (``original_prompt_len``), so a completion is never empty. ``max_tokens``
defaults to ``context_length - len(prompt)`` and is capped by it. An empty prompt, a
prompt that fills the context, or one larger than the whole KV pool finishes at the
next step with ``error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvmesh.engines.batching.scheduler import EOS, Finished, Plan, Seq, SchedulerLimits, priority_rank
from kvmesh.engines.batching.scheduler import Scheduler as BatchScheduler
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.tokens import (
    MASK32,
    PAIR,
    TOKEN_SEED,
    XXH3,
    drawable_vocab,
    eos_threshold,
    excluded_ids,
    position_hash,
    request_key,
    token_at,
)
from kvmesh.kv.hashing import hash_salt
from kvmesh.protocol import PreprocessedRequest
from kvmesh.runtime.events import EventPublisher

if TYPE_CHECKING:  # the grammar engine (llguidance, numpy): imported by the first guided request
    from kvmesh.preprocess.guided import Guide, GuidedTokenizer

__all__ = ["Scheduler", "StepOutput", "Finished", "MockSeq"]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one pass produced.

    ``tokens``: sequence id -> the token it generated (requests still prefilling, or
    ending on a silent EOS, have none). ``duration_ms`` is already divided by speedup.
    ``logprob_shift``: nats added to the step's log-probabilities (0; a ``corrupt``
    fault moves it).
    """

    tokens: dict[int, int] = field(default_factory=dict)
    finished: list[Finished] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    duration_ms: float = 0.0
    logprob_shift: float = 0.0


class MockSeq(Seq):
    """A request with the token oracle's state: its key, drawable vocabulary, where the
    user's prompt ends (a migrated request carries its output so far), and the KV
    digests imported into its blocks."""

    __slots__ = ("origin_len", "key", "vocab", "imported", "guide")

    def __init__(self, request: PreprocessedRequest, max_tokens: int, *, prefill_upto: int | None = None) -> None:
        stop = request.stop
        super().__init__(
            request.request_id,
            list(request.token_ids),
            max_tokens=max_tokens,
            min_tokens=stop.min_tokens,
            ignore_eos=stop.ignore_eos,
            stop_ids=frozenset(stop.stop_token_ids),
            rank=priority_rank(request.routing.priority if request.routing else None),
            prefill_upto=prefill_upto,
            salt=hash_salt(request.adapter, request.cache_salt),  # issue 30: no block shared across adapters
            adapter=request.adapter,
        )
        origin = request.original_prompt_len
        self.origin_len = self.prompt_len if origin is None else min(origin, self.prompt_len)
        self.key = request_key(request)
        self.vocab: tuple[int, ...] = ()
        self.imported: dict[int, int] = {}  # block -> digest written into it (KV import)
        self.guide: Guide | None = None  # structured outputs: the request's grammar (guided.py)


def limits_of(options: MockerOptions) -> SchedulerLimits:
    limits = SchedulerLimits.of(options, num_blocks=options.num_blocks, context_length=options.context_length)
    return replace(limits, onboard_tiers=options.onboard_tiers)


class Scheduler(BatchScheduler[MockSeq]):
    """One simulated worker: the shared scheduler and KV pool (the batching core, typed
    for :class:`MockSeq`), with each pass's tokens drawn by the oracle and its duration
    by the timing model. Requests come in as :class:`PreprocessedRequest`
    (:meth:`submit`, :meth:`reserve_request`); the rest is the core's."""

    def __init__(self, options: MockerOptions, publisher: EventPublisher | None = None) -> None:
        super().__init__(limits_of(options), publisher)
        self.options = options
        self._eos_threshold = eos_threshold(options.eos_rate)
        self.guided: GuidedTokenizer | None = None  # set by the engine on the first guided request

    # ------------------------------------------------------------------ requests

    def submit(self, request: PreprocessedRequest) -> int:
        """Queue ``request`` (FCFS within its priority tier) and return its sequence id.
        A request that can never run is not queued; it finishes with ``error`` at the
        next :meth:`step`. A request with a reservation (:meth:`reserve_request`) is
        queued with its blocks and computed tokens."""
        seq = self.adopt(request.request_id)
        if seq is not None:
            return seq.id
        seq, problem = self._new_seq(request)
        if problem is not None:
            return self.reject(seq, problem)
        return self.add(seq)

    def _new_seq(self, request: PreprocessedRequest) -> tuple[MockSeq, str | None]:
        opts = self.options
        room = opts.context_length - len(request.token_ids)
        max_tokens = request.stop.max_tokens
        seq = MockSeq(request, room if max_tokens is None else min(max_tokens, room))
        if request.guided is not None and self.guided is not None:
            seq.guide = self.guided.guide(request.guided, request.token_ids[seq.origin_len :])
        problem = self._admission_problem(len(request.token_ids), max_tokens)
        if problem is None:
            excluded = excluded_ids(opts.eos_token_ids, request.eos_token_ids, opts.special_token_ids)
            try:
                seq.vocab = drawable_vocab(opts.vocab_size, excluded)
            except ValueError as exc:
                problem = str(exc)
        return seq, problem

    def _admission_problem(self, prompt_len: int, max_tokens: int | None) -> str | None:
        opts = self.options
        if prompt_len == 0:
            return "empty prompt"
        if max_tokens is not None and max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}"
        if prompt_len >= opts.context_length:
            return f"prompt of {prompt_len} tokens leaves no room in context length {opts.context_length}"
        if self.blocks.blocks_for(prompt_len) > opts.num_blocks:
            return f"prompt of {prompt_len} tokens exceeds the KV cache ({opts.total_tokens} tokens)"
        return None

    # ------------------------------------------------------------------ reservations

    def reserve_request(self, request: PreprocessedRequest) -> MockSeq | None:
        """Allocate blocks for all of ``request``'s prompt without queueing it (prefix
        hits reused, at least one token left to compute). None when the pool is short
        or the request could never run. The next :meth:`submit` of the same request id
        queues it with these blocks; :meth:`release` gives them back."""
        if self.reservation(request.request_id) is not None:
            raise ValueError(f"request {request.request_id!r} already holds a reservation")
        seq, problem = self._new_seq(request)
        if problem is not None:
            self.assign_id(seq)
            return None
        return seq if self.reserve(seq) else None

    def submit_prefill(self, request: PreprocessedRequest, cached_tokens: int, upto: int) -> MockSeq | None:
        """Queue a remote prefill of ``request.token_ids[:upto]`` over fresh blocks whose
        first ``cached_tokens`` tokens the caller filled: scheduled like any prefill, it
        samples nothing and is held when done (:meth:`release_held`). None when the pool
        is short."""
        seq = MockSeq(request, 1, prefill_upto=upto)
        return seq if self.hold_prefill(seq, cached_tokens) else None

    def detach_delivered(self, seq_id: int, delivered: int) -> MockSeq | None:
        """:meth:`detach` (KV migration's source side), forgetting the output tokens
        beyond the first ``delivered`` (a step in progress may have drawn one the
        client never got); the last kept token counts as not computed."""
        seq = self.get(seq_id)
        if seq is None or not self.blocks.held_blocks(seq_id):
            return None
        kept = seq.tokens[seq.prompt_len + delivered :]
        del seq.tokens[seq.prompt_len + delivered :]
        if self.detach(seq_id) is None:
            seq.tokens.extend(kept)
            return None
        return seq

    # ------------------------------------------------------------------ one pass

    def step(self) -> StepOutput:
        """Schedule and execute one forward pass (see the module docstring)."""
        plan = self.schedule()
        drawn = self._draw_all(plan.samples)
        finished, emitted = self.complete(plan, drawn)
        return StepOutput(
            # emitted ⊆ drawn: the same size, the same keys (every draw but a silent EOS)
            tokens=drawn if len(emitted) == len(drawn) else {sid: drawn[sid] for sid in emitted},
            finished=plan.failed + finished,
            preempted=plan.preempted,
            prefill_tokens=plan.prefill_tokens,
            decode_seqs=plan.decode_seqs,
            duration_ms=self._duration_ms(plan),
        )

    def _duration_ms(self, plan: Plan[MockSeq]) -> float:
        """The pass's modelled time; with KV tiers, plus the onboarding its prefills wait for."""
        opts = self.options
        if not self.blocks.tiers.enabled:
            return opts.step_ms(plan.prefill_tokens, plan.decode_seqs, plan.kv_usage)
        onboard = opts.onboard_ms(self.blocks.take_onboarded())
        return opts.tiered_step_ms(plan.prefill_tokens, plan.decode_seqs, plan.kv_usage, onboard)

    def _draw_all(self, seqs: list[MockSeq]) -> dict[int, int]:
        """``{seq.id: self._draw(seq)}`` with :meth:`_draw`'s unguided path inlined (once
        per running request per step: the oracle's hash and pick without three calls)."""
        drawn: dict[int, int] = {}
        threshold = self._eos_threshold
        for seq in seqs:
            if seq.guide is not None:
                drawn[seq.id] = self._draw(seq)
                continue
            position = len(seq.tokens)
            h = XXH3(PAIR(seq.key, position), TOKEN_SEED)
            if (
                (h >> 32) < threshold
                and not seq.ignore_eos
                and position - seq.prompt_len >= seq.min_tokens
                and position > seq.origin_len
            ):
                drawn[seq.id] = EOS
            else:
                vocab = seq.vocab
                drawn[seq.id] = vocab[(h & MASK32) % len(vocab)]
        return drawn

    def _draw(self, seq: MockSeq) -> int:
        """The oracle's token at the sequence's next position (:data:`EOS`: it ends)."""
        h = position_hash(seq.key, len(seq.tokens))
        eos_allowed = not seq.ignore_eos and seq.num_output >= seq.min_tokens and len(seq.tokens) > seq.origin_len
        if seq.guide is not None:
            from kvmesh.engines.mocker.guided import guided_token  # loaded with the guide's tokenizer

            eos_drawn = eos_allowed and (h >> 32) < self._eos_threshold
            token = guided_token(seq.guide, h, seq.vocab, seq.max_tokens - seq.num_output, eos_drawn)
            return EOS if token is None else token
        if eos_allowed and (h >> 32) < self._eos_threshold:
            return EOS
        return token_at(h, seq.vocab)
