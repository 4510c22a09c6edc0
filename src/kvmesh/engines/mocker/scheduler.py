"""A vLLM-v1-style continuous-batching scheduler, simulated. Pure: no asyncio, no clock.

Lifecycle (the engine or the virtual-clock driver calls, one at a time)::

    sid = scheduler.add(request)      queue a request; returns its sequence id
    out = scheduler.step()            plan and "run" one forward pass, return what it made
    scheduler.abort(sid)              drop a request wherever it is, freeing its blocks

One step, in order:

1. **running requests**, decodes first then unfinished (chunked) prefills, each in
   admission order, each taking ``min(remaining tokens, budget)`` of the
   ``max_num_batched_tokens`` budget (a decode costs 1). If its blocks cannot grow,
   the most recently admitted running request not yet scheduled in this step is
   preempted (recompute style: blocks freed, progress forgotten, pushed back to the
   front of the waiting queue) until it fits; with nobody left to preempt, the request
   preempts itself, or fails with ``error`` when it is alone (it can never fit).
2. **waiting requests**, FCFS within a priority tier (premium, standard, best_effort), only if step 1 preempted nobody: reuse the longest
   cached prefix (at least one token is always recomputed, to sample from), allocate
   blocks for the first chunk; stop at the first that does not fit, at
   ``max_num_seqs`` running, or when the budget is spent.
3. **execute**: advance computed tokens, commit full blocks to the prefix cache, and
   sample one token (see :mod:`kvmesh.engines.mocker.tokens`) for every request whose
   sequence is fully computed; finish on EOS / stop token (``stop``) or max tokens
   (``length``), freeing blocks.

The step's modelled duration is :meth:`MockerOptions.step_ms` over the pass's new
prefill tokens, its decode count and the KV usage after allocation.

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

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.engines.mocker.block_manager import BlockManager
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.tokens import (
    drawable_vocab,
    eos_threshold,
    excluded_ids,
    position_hash,
    request_key,
    token_at,
)
from kvmesh.protocol import FinishReason, LoadReport, PreprocessedRequest, Usage
from kvmesh.router.hashing import chain_hashes, chain_one, local_block_hashes
from kvmesh.runtime.events import EventPublisher

__all__ = ["Scheduler", "StepOutput", "Finished"]

_BATCH_EMA = 0.25  # weight of the latest pass in the load report's batch_tokens
_PRIORITY_RANK = {"premium": 0, "standard": 1, "best_effort": 2, None: 1}


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that ended in a step; its blocks are already free."""

    seq_id: int
    request_id: str
    reason: FinishReason
    usage: Usage
    error: str | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one pass produced.

    ``tokens``: sequence id -> the token it generated (requests still prefilling, or
    ending on a silent EOS, have none). ``duration_ms`` is already divided by speedup.
    """

    tokens: dict[int, int] = field(default_factory=dict)
    finished: list[Finished] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    duration_ms: float = 0.0


class _Seq:
    """Scheduler-side state of one request. ``tokens`` = prompt + generated; the first
    ``num_computed`` have KV. Hashes cover every full block of ``tokens`` (only kept
    when prefix caching is on)."""

    __slots__ = (
        "id", "request_id", "tokens", "prompt_len", "origin_len", "max_tokens", "min_tokens", "ignore_eos",
        "stop_ids", "key", "rank", "vocab", "local_hashes", "seq_hashes", "num_computed",
        "cached_tokens", "admitted", "running", "ever_admitted", "reserved", "imported",
    )  # fmt: skip

    def __init__(self, seq_id: int, request: PreprocessedRequest, max_tokens: int) -> None:
        self.id = seq_id
        self.request_id = request.request_id
        self.tokens = list(request.token_ids)
        self.prompt_len = len(self.tokens)
        # where the user's prompt ends (a migrated request carries its output so far)
        origin = request.original_prompt_len
        self.origin_len = self.prompt_len if origin is None else min(origin, self.prompt_len)
        self.max_tokens = max_tokens
        self.min_tokens = request.stop.min_tokens
        self.ignore_eos = request.stop.ignore_eos
        self.stop_ids = frozenset(request.stop.stop_token_ids)
        self.key = request_key(request)
        # lower is more urgent: premium 0, standard 1, best_effort 2 (vLLM's priority policy)
        self.rank = _PRIORITY_RANK.get(request.routing.priority if request.routing else None, 1)
        self.vocab: tuple[int, ...] = ()
        self.local_hashes: list[int] = []
        self.seq_hashes: list[int] = []
        self.num_computed = 0
        self.cached_tokens = 0
        self.admitted = -1
        self.running = False
        self.ever_admitted = False
        # holds blocks outside the queues (kv_reserve / kv_detach): admitted as is
        self.reserved = False
        self.imported: dict[int, int] = {}  # block -> digest written into it (KV import)

    @property
    def is_decode(self) -> bool:
        return self.num_computed == len(self.tokens) - 1 and self.num_computed >= self.prompt_len

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len


class _Plan:
    """The pass being built by one :meth:`Scheduler.step`."""

    __slots__ = ("budget", "scheduled", "preempted", "failed", "prefill_tokens", "decode_seqs")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: list[tuple[_Seq, int]] = []
        self.preempted: list[int] = []
        self.failed: list[_Seq] = []
        self.prefill_tokens = 0
        self.decode_seqs = 0

    def add(self, seq: _Seq, n: int) -> None:
        self.scheduled.append((seq, n))
        self.budget -= n
        # one token that completes the sequence costs a decode: a decode proper, or the
        # last prompt token after a remote prefill (or a prefix hit of all but one token)
        if n == 1 and seq.num_computed == len(seq.tokens) - 1:
            self.decode_seqs += 1
        else:
            self.prefill_tokens += n


class Scheduler:
    """One worker's scheduler and KV pool. See the module docstring for the policy."""

    def __init__(self, options: MockerOptions, publisher: EventPublisher | None = None) -> None:
        self.options = options
        self.blocks = BlockManager(
            options.num_blocks,
            options.block_size,
            publisher=publisher,
            worker_id=options.worker_id,
            enable_prefix_caching=options.enable_prefix_caching,
            ring_capacity=options.event_ring_capacity,
        )
        self._caching = options.enable_prefix_caching
        self._eos_threshold = eos_threshold(options.eos_rate)
        self._waiting: deque[_Seq] = deque()
        # graceful degradation may shrink the batch at run time (set_batch_multiplier)
        self.max_num_seqs = options.max_num_seqs
        self._running: list[_Seq] = []
        self._seqs: dict[int, _Seq] = {}
        self._rejected: list[Finished] = []
        # request id -> a sequence holding blocks outside the queues (disaggregation, migration)
        self._reserved: dict[str, _Seq] = {}
        self._next_id = 0
        self._admissions = 0
        self._batch_tokens = 0.0  # moving average of tokens per pass (load reports)

    # ------------------------------------------------------------------ queries

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._rejected)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def load_report(self, timestamp_ms: float = 0.0) -> LoadReport:
        return LoadReport(
            worker_id=self.options.worker_id,
            active_blocks=self.blocks.active_blocks,
            total_blocks=self.blocks.num_blocks,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            timestamp_ms=timestamp_ms,
            batch_tokens=round(self._batch_tokens, 1),
        )

    def kv_dump(self) -> set[int]:
        return self.blocks.dump()

    # ------------------------------------------------------------------ requests

    def add(self, request: PreprocessedRequest) -> int:
        """Queue ``request`` (FCFS) and return its sequence id. A request that can never
        run is not queued; it finishes with ``error`` at the next :meth:`step`. A request
        with a reservation (:meth:`reserve`) is queued with its blocks and computed tokens."""
        seq = self._reserved.pop(request.request_id, None)
        if seq is not None:
            self._seqs[seq.id] = seq
            self._enqueue(seq)
            return seq.id
        seq, problem = self._new_seq(request)
        if problem is not None:
            self._rejected.append(_finished(seq, "error", problem))
            return seq.id
        self._seqs[seq.id] = seq
        self._enqueue(seq)
        return seq.id

    def _new_seq(self, request: PreprocessedRequest) -> tuple[_Seq, str | None]:
        seq_id = self._next_id
        self._next_id += 1
        opts = self.options
        prompt_len = len(request.token_ids)
        room = opts.context_length - prompt_len
        max_tokens = request.stop.max_tokens
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        seq = _Seq(seq_id, request, max_tokens)
        problem = self._admission_problem(prompt_len, request.stop.max_tokens)
        if problem is None:
            excluded = excluded_ids(opts.eos_token_ids, request.eos_token_ids, opts.special_token_ids)
            try:
                seq.vocab = drawable_vocab(opts.vocab_size, excluded)
            except ValueError as exc:
                problem = str(exc)
        if problem is None and self._caching:
            seq.local_hashes = local_block_hashes(seq.tokens, opts.block_size)
            seq.seq_hashes = chain_hashes(seq.local_hashes)
        return seq, problem

    # ------------------------------------------------------------------ reservations

    def reserve(self, request: PreprocessedRequest) -> _Seq | None:
        """Allocate blocks for all of ``request``'s prompt without queueing it (prefix
        hits reused, at least one token left to compute). None when the pool is short
        or the request could never run. The next :meth:`add` of the same request id
        queues it with these blocks; :meth:`release` gives them back."""
        if request.request_id in self._reserved:
            raise ValueError(f"request {request.request_id!r} already holds a reservation")
        seq, problem = self._new_seq(request)
        if problem is not None:
            return None
        bs = self.options.block_size
        hit = self.blocks.lookup(seq.seq_hashes[: (len(seq.tokens) - 1) // bs]) if self._caching else 0
        if not self.blocks.allocate(seq.id, len(seq.tokens), seq.seq_hashes[:hit]):
            return None
        seq.num_computed = seq.cached_tokens = hit * bs
        seq.ever_admitted = seq.reserved = True
        self._reserved[request.request_id] = seq
        return seq

    def reservation(self, request_id: str) -> _Seq | None:
        return self._reserved.get(request_id)

    def reservations(self) -> list[_Seq]:
        return list(self._reserved.values())

    def block_ids(self, seq: _Seq) -> list[int]:
        return self.blocks.block_table(seq.id)

    def commit_reserved(self, request_id: str, computed_tokens: int) -> None:
        """The reservation's first ``computed_tokens`` tokens hold valid KV now (imported):
        full blocks join the prefix cache (``BlockStored``)."""
        seq = self._reserved[request_id]
        if not seq.num_computed <= computed_tokens < len(seq.tokens):
            raise ValueError(
                f"computed tokens must be in [{seq.num_computed}, {len(seq.tokens) - 1}], got {computed_tokens}"
            )
        seq.num_computed = computed_tokens
        if self._caching:
            self.blocks.commit(seq.id, seq.seq_hashes, seq.local_hashes, computed_tokens // self.options.block_size)

    def release(self, request_id: str) -> bool:
        """Give back a reservation's blocks; False if there is none."""
        seq = self._reserved.pop(request_id, None)
        if seq is None:
            return False
        self.blocks.free(seq.id)
        return True

    def detach(self, seq_id: int, delivered: int) -> _Seq | None:
        """Take a queued or running request out of the schedule, keeping its blocks and
        computed tokens as a reservation (KV migration's source side). Output tokens
        beyond the first ``delivered`` are forgotten, and the last kept token counts as
        not computed (whoever resumes computes it, to sample from)."""
        seq = self._seqs.get(seq_id)
        if seq is None or not self.blocks.held_blocks(seq_id):
            return None
        del self._seqs[seq_id]
        del seq.tokens[seq.prompt_len + delivered :]
        seq.num_computed = min(seq.num_computed, len(seq.tokens) - 1)
        if seq.running:
            self._running.remove(seq)
            seq.running = False
        else:
            self._waiting.remove(seq)
        seq.reserved = True
        self._reserved[seq.request_id] = seq
        return seq

    def _enqueue(self, seq: _Seq, front: bool = False) -> None:
        """FCFS within a priority tier; a more urgent request waits ahead of less
        urgent ones (all requests are ``standard`` unless they say otherwise).
        ``front``: first of its tier (a preempted request resumes before newcomers)."""
        waiting = self._waiting
        if not front and (not waiting or waiting[-1].rank <= seq.rank):
            waiting.append(seq)
            return
        for i, other in enumerate(waiting):
            if other.rank > seq.rank or (front and other.rank == seq.rank):
                waiting.insert(i, seq)
                return
        waiting.append(seq)

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

    def abort(self, seq_id: int) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already ended."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            before = len(self._rejected)
            self._rejected = [f for f in self._rejected if f.seq_id != seq_id]
            return len(self._rejected) != before
        if seq.running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.blocks.free(seq_id)
        return True

    def reset(self) -> list[int]:
        """Abort everything and clear the prefix cache (emits ``AllBlocksCleared``);
        returns the aborted sequence ids."""
        aborted = list(self._seqs) + [f.seq_id for f in self._rejected]
        self._waiting.clear()
        self._running.clear()
        self._seqs.clear()
        self._rejected.clear()
        self._reserved.clear()
        self.blocks.reset()
        return aborted

    # ------------------------------------------------------------------ one pass

    def step(self) -> StepOutput:
        """Schedule and execute one forward pass (see the module docstring)."""
        plan = _Plan(self.options.max_num_batched_tokens)
        yielded = self._yield_to_priority(plan)
        self._schedule_running(plan)
        if not plan.preempted or yielded:
            self._admit_waiting(plan)
        usage = self.blocks.usage
        finished, self._rejected = self._rejected, []
        finished.extend(self._fail(seq) for seq in plan.failed)
        tokens = self._execute(plan, finished)
        self._batch_tokens += _BATCH_EMA * (plan.prefill_tokens + plan.decode_seqs - self._batch_tokens)
        return StepOutput(
            tokens=tokens,
            finished=finished,
            preempted=plan.preempted,
            prefill_tokens=plan.prefill_tokens,
            decode_seqs=plan.decode_seqs,
            duration_ms=self.options.step_ms(plan.prefill_tokens, plan.decode_seqs, usage),
        )

    def _schedule_running(self, plan: _Plan) -> None:
        order: list[_Seq] = []
        prefills: list[_Seq] = []
        for s in self._running:
            (order if s.is_decode else prefills).append(s)
        order.extend(prefills)
        for i, seq in enumerate(order):
            if plan.budget <= 0:
                return
            if not seq.running:  # preempted earlier in this pass
                continue
            n = min(len(seq.tokens) - seq.num_computed, plan.budget)
            if self._make_room(seq, n, order, i, plan):
                plan.add(seq, n)

    def _make_room(self, seq: _Seq, n: int, order: list[_Seq], i: int, plan: _Plan) -> bool:
        """Grow ``seq``'s blocks for ``n`` more tokens, preempting later-scheduled
        requests (most recently admitted first) as needed. False if ``seq`` itself had
        to give way (preempted, or failed when it can never fit)."""
        while not self.blocks.allocate(seq.id, seq.num_computed + n):
            victim = _latest_admitted(s for s in order[i + 1 :] if s.running)
            if victim is not None:
                self._preempt(victim, plan)
                continue
            if plan.scheduled:
                self._preempt(seq, plan)
            else:
                self._running.remove(seq)
                seq.running = False
                plan.failed.append(seq)
            return False
        return True

    def set_batch_multiplier(self, multiplier: float) -> None:
        """Run at most ``multiplier`` × ``max_num_seqs`` sequences (at least 1); running
        ones beyond that finish, no new one is admitted meanwhile. Premium requests may
        still fill the full ``max_num_seqs``: the reduced batch sheds the less urgent."""
        if not 0 < multiplier <= 1:
            raise ValueError(f"the batch multiplier must be in (0, 1], got {multiplier}")
        self.max_num_seqs = max(1, int(self.options.max_num_seqs * multiplier))

    def _cap(self, seq: _Seq) -> int:
        """Running sequences allowed when admitting ``seq``."""
        return self.options.max_num_seqs if seq.rank == 0 else self.max_num_seqs

    def _yield_to_priority(self, plan: _Plan) -> bool:
        """With every sequence slot taken, a waiting request of a more urgent tier
        preempts the least urgent, most recently admitted running one (vLLM's priority
        policy). Returns whether anything was preempted for that reason."""
        yielded = False
        while self._waiting and len(self._running) >= self._cap(self._waiting[0]):
            head = self._waiting[0]
            victim = max(self._running, key=lambda q: (q.rank, q.admitted))
            if victim.rank <= head.rank:
                break
            self._running.remove(victim)
            self.blocks.free(victim.id)
            victim.running = False
            victim.num_computed = 0
            self._enqueue(victim, front=True)
            plan.preempted.append(victim.id)
            yielded = True
        return yielded

    def _preempt(self, seq: _Seq, plan: _Plan) -> None:
        self._running.remove(seq)
        self.blocks.free(seq.id)
        seq.running = False
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        plan.preempted.append(seq.id)

    def _admit_waiting(self, plan: _Plan) -> None:
        bs = self.options.block_size
        while self._waiting and plan.budget > 0 and len(self._running) < self._cap(self._waiting[0]):
            seq = self._waiting[0]
            if seq.reserved:  # holds its blocks and computed tokens already
                computed = seq.num_computed
                hit = 0
            elif self._caching:
                hit = self.blocks.lookup(seq.seq_hashes[: (len(seq.tokens) - 1) // bs])
                computed = hit * bs
            else:
                hit = computed = 0
            n = min(len(seq.tokens) - computed, plan.budget)
            if not self.blocks.allocate(seq.id, computed + n, seq.seq_hashes[:hit]):
                return
            self._waiting.popleft()
            seq.num_computed = computed
            seq.reserved = False
            if not seq.ever_admitted:
                seq.ever_admitted = True
                seq.cached_tokens = computed
            seq.admitted = self._admissions
            self._admissions += 1
            seq.running = True
            self._running.append(seq)
            plan.add(seq, n)

    def _execute(self, plan: _Plan, finished: list[Finished]) -> dict[int, int]:
        tokens: dict[int, int] = {}
        bs = self.options.block_size
        blocks = self.blocks
        caching = self._caching
        done = False
        for seq, n in plan.scheduled:
            seq.num_computed += n
            if caching and (n > 1 or seq.num_computed % bs == 0):
                blocks.commit(seq.id, seq.seq_hashes, seq.local_hashes, seq.num_computed // bs)
            if seq.num_computed < len(seq.tokens):
                continue  # still prefilling
            token, reason = self._sample(seq)
            if token is not None:
                tokens[seq.id] = token
                self._append(seq, token)
            if reason is not None:
                finished.append(self._finish(seq, reason))
                done = True
        if done:
            self._running = [s for s in self._running if s.running]
        return tokens

    def _sample(self, seq: _Seq) -> tuple[int | None, FinishReason | None]:
        """The token at the sequence's next position, and whether the request ends."""
        i = len(seq.tokens) - seq.prompt_len
        h = position_hash(seq.key, len(seq.tokens))
        eos_allowed = not seq.ignore_eos and i >= seq.min_tokens and len(seq.tokens) > seq.origin_len
        if eos_allowed and (h >> 32) < self._eos_threshold:
            return None, "stop"
        token = token_at(h, seq.vocab)
        if token in seq.stop_ids and i + 1 >= seq.min_tokens:
            return token, "stop"
        if i + 1 >= seq.max_tokens:
            return token, "length"
        return token, None

    def _append(self, seq: _Seq, token: int) -> None:
        tokens = seq.tokens
        tokens.append(token)
        bs = self.options.block_size
        if self._caching and len(tokens) % bs == 0:
            local = local_block_hashes(tokens[-bs:], bs)[0]
            parent = seq.seq_hashes[-1] if seq.seq_hashes else None
            seq.local_hashes.append(local)
            seq.seq_hashes.append(chain_one(parent, local))

    def _finish(self, seq: _Seq, reason: FinishReason) -> Finished:
        seq.running = False
        del self._seqs[seq.id]
        self.blocks.free(seq.id)
        return _finished(seq, reason)

    def _fail(self, seq: _Seq) -> Finished:
        del self._seqs[seq.id]
        self.blocks.free(seq.id)
        total = self.options.total_tokens
        return _finished(seq, "error", f"sequence of {len(seq.tokens)} tokens exceeds the KV cache ({total} tokens)")


def _finished(seq: _Seq, reason: FinishReason, error: str | None = None) -> Finished:
    usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=seq.num_output, cached_tokens=seq.cached_tokens)
    return Finished(seq.id, seq.request_id, reason, usage, error)


def _latest_admitted(seqs: Iterable[_Seq]) -> _Seq | None:
    best: _Seq | None = None
    for s in seqs:
        if best is None or s.admitted > best.admitted:
            best = s
    return best

