"""The ``hf`` engine's continuous-batching scheduler. Pure: no torch, no asyncio, no clock.

Lifecycle (the engine's step loop calls, one at a time, on the event loop)::

    scheduler.add(seq)                queue a request (or a reservation adopted by generate)
    plan = scheduler.schedule()       pick this pass's work; blocks allocated
        ... the forward pass runs elsewhere (a thread), meanwhile abort / detach /
        release may be called: blocks of sequences in the pass are freed only after it
    finished = scheduler.complete(plan, sampled)   advance, cache full blocks, stop rules

One pass (:meth:`Scheduler.schedule`):

1. **running** sequences, decodes first then unfinished (chunked) prefills, each
   taking ``min(tokens left, budget)`` of the ``max_num_batched_tokens`` budget. When
   its blocks cannot grow, the most recently admitted other running sequence is
   preempted (recompute: blocks freed, back to the front of the queue); alone, a
   sequence that can never fit fails with ``error``.
2. **waiting** sequences, FCFS, while fewer than ``max_num_seqs`` run and budget is
   left (only when nobody was preempted): reuse the longest cached prefix of full
   blocks (at least one token is always computed, to sample from), allocate for the
   first chunk; stop at the first that does not fit.

Stop rules (:meth:`Scheduler.complete`): an EOS ends with ``stop`` and is *not*
emitted (not with ``ignore_eos``, where it is an ordinary token); a ``stop_token_ids``
token is emitted and ends with ``stop``; ``max_tokens`` (capped by the context) ends
with ``length``. Before ``min_tokens`` tokens are out, the sampler bans EOS and stop
ids (:meth:`Seq.banned`), so they cannot end a stream early.

Blocks, the prefix cache and KV events are the shared
:class:`~kvmesh.engines.mocker.block_manager.BlockManager`'s: a block is cached under
its chained hash (:mod:`kvmesh.router.hashing`) once full of computed tokens, prompt
and output alike.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from kvmesh.engines.hf.sampling import SampleParams
from kvmesh.engines.mocker.block_manager import BlockManager
from kvmesh.protocol import FinishReason, LoadReport, Usage
from kvmesh.router.hashing import chain_hashes, chain_one, local_block_hashes
from kvmesh.runtime.events import EventPublisher

__all__ = ["Scheduler", "SchedulerLimits", "Seq", "State", "Plan", "Finished"]


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"  # holds blocks outside the queues (kv_reserve, kv_detach)
    HELD = "held"  # a remote prefill that is done: blocks kept until exported
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    context_length: int
    enable_prefix_caching: bool = True
    worker_id: int = 0
    event_ring_capacity: int = 1024


class Seq:
    """One request as the scheduler sees it. ``tokens`` = prompt + output; the first
    ``num_computed`` have KV in the pool. ``prefill_upto`` set: a remote prefill that
    computes that many tokens and samples nothing."""

    __slots__ = (
        "id", "request_id", "tokens", "prompt_len", "max_tokens", "min_tokens", "ignore_eos",
        "eos_ids", "stop_ids", "params", "local_hashes", "seq_hashes", "num_computed",
        "cached_tokens", "state", "admitted", "prefill_upto",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        tokens: list[int],
        params: SampleParams,
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        eos_ids: frozenset[int] = frozenset(),
        stop_ids: frozenset[int] = frozenset(),
        prefill_upto: int | None = None,
    ) -> None:
        self.id = -1  # assigned by the scheduler
        self.request_id = request_id
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.ignore_eos = ignore_eos
        self.eos_ids = eos_ids
        self.stop_ids = stop_ids
        self.params = params
        self.local_hashes: list[int] = []
        self.seq_hashes: list[int] = []
        self.num_computed = 0
        self.cached_tokens = 0
        self.state = State.WAITING
        self.admitted = -1
        self.prefill_upto = prefill_upto

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def target(self) -> int:
        """Tokens that must have KV before this sequence samples (or, prefill-only, ends)."""
        return self.prefill_upto if self.prefill_upto is not None else len(self.tokens)

    def banned(self) -> tuple[int, ...]:
        """Token ids the sampler must not pick now (EOS and stop ids before ``min_tokens``)."""
        if self.num_output >= self.min_tokens:
            return ()
        ids = set(self.stop_ids)
        if not self.ignore_eos:
            ids |= self.eos_ids
        return tuple(sorted(ids))


@dataclass(frozen=True, slots=True)
class Finished:
    """A sequence that ended in a pass (its blocks freed, or kept when ``HELD``)."""

    seq_id: int
    reason: FinishReason
    usage: Usage
    error: str | None = None


@dataclass(slots=True)
class Plan:
    """One pass: ``entries`` are (sequence, new tokens) in pass order; ``samples`` the
    sequences among them that sample a token after this pass."""

    entries: list[tuple[Seq, int]] = field(default_factory=list)
    failed: list[Finished] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    budget: int = 0

    @property
    def samples(self) -> list[Seq]:
        return [s for s, n in self.entries if s.prefill_upto is None and s.num_computed + n == len(s.tokens)]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)


class Scheduler:
    """One engine's queues and KV block pool. See the module docstring."""

    def __init__(self, limits: SchedulerLimits, publisher: EventPublisher | None = None) -> None:
        self.limits = limits
        self.blocks = BlockManager(
            limits.num_blocks,
            limits.block_size,
            publisher=publisher,
            worker_id=limits.worker_id,
            enable_prefix_caching=limits.enable_prefix_caching,
            ring_capacity=limits.event_ring_capacity,
        )
        self.max_num_seqs = limits.max_num_seqs
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._seqs: dict[int, Seq] = {}
        self._reserved: dict[str, Seq] = {}
        self._next_id = 0
        self._admissions = 0
        # sequences in the pass now running elsewhere; their blocks are freed after it
        self._in_flight: set[int] = set()
        self._deferred_free: list[int] = []

    # ------------------------------------------------------------------ queries

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, seq_id: int) -> Seq | None:
        return self._seqs.get(seq_id)

    def reservation(self, request_id: str) -> Seq | None:
        return self._reserved.get(request_id)

    def reservations(self) -> list[Seq]:
        return list(self._reserved.values())

    def block_table(self, seq: Seq) -> list[int]:
        return self.blocks.block_table(seq.id)

    def load_report(self, timestamp_ms: float = 0.0) -> LoadReport:
        return LoadReport(
            worker_id=self.limits.worker_id,
            active_blocks=self.blocks.active_blocks,
            total_blocks=self.blocks.num_blocks,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            timestamp_ms=timestamp_ms,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks.blocks_for(num_tokens)

    # ------------------------------------------------------------------ requests

    def _register(self, seq: Seq) -> None:
        seq.id = self._next_id
        self._next_id += 1
        self._seqs[seq.id] = seq
        if self.limits.enable_prefix_caching:
            seq.local_hashes = local_block_hashes(seq.tokens, self.limits.block_size)
            seq.seq_hashes = chain_hashes(seq.local_hashes)

    def add(self, seq: Seq) -> int:
        """Queue a new sequence (FCFS); returns its id."""
        self._register(seq)
        self._waiting.append(seq)
        return seq.id

    def adopt(self, request_id: str) -> Seq | None:
        """Queue the reservation held for ``request_id`` (its blocks and computed
        tokens kept); None when there is none."""
        seq = self._reserved.pop(request_id, None)
        if seq is not None:
            seq.state = State.WAITING
            self._seqs[seq.id] = seq
            self._waiting.append(seq)
        return seq

    def abort(self, seq_id: int) -> bool:
        """Drop a sequence wherever it is and free its blocks; False if unknown."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.state is State.RUNNING:
            self._running.remove(seq)
        elif seq.state is State.WAITING:
            self._waiting.remove(seq)
        seq.state = State.ENDED
        self._free(seq.id)
        return True

    def _free(self, seq_id: int) -> None:
        if seq_id in self._in_flight:  # the running pass may still write these blocks
            self._deferred_free.append(seq_id)
        else:
            self.blocks.free(seq_id)

    def reset(self) -> None:
        """Forget everything and clear the prefix cache (emits ``AllBlocksCleared``)."""
        self._waiting.clear()
        self._running.clear()
        self._seqs.clear()
        self._reserved.clear()
        self._in_flight.clear()
        self._deferred_free.clear()
        self.blocks.reset()

    def set_batch_multiplier(self, multiplier: float) -> None:
        if not 0 < multiplier <= 1:
            raise ValueError(f"the batch multiplier must be in (0, 1], got {multiplier}")
        self.max_num_seqs = max(1, int(self.limits.max_num_seqs * multiplier))

    # ------------------------------------------------------------------ reservations

    def _prefix_hit(self, seq: Seq) -> int:
        """Cached leading blocks usable by ``seq`` (its last token always computed)."""
        if not self.limits.enable_prefix_caching:
            return 0
        return self.blocks.lookup(seq.seq_hashes[: (len(seq.tokens) - 1) // self.limits.block_size])

    def reserve(self, seq: Seq) -> bool:
        """Allocate blocks for all of ``seq.tokens`` outside the queues (prefix hits
        reused); False, changing nothing, when the pool is short."""
        if seq.request_id in self._reserved:
            raise ValueError(f"request {seq.request_id!r} already holds a KV reservation")
        self._register(seq)
        hit = self._prefix_hit(seq)
        if not self.blocks.allocate(seq.id, len(seq.tokens), seq.seq_hashes[:hit]):
            del self._seqs[seq.id]
            return False
        seq.num_computed = seq.cached_tokens = hit * self.limits.block_size
        self._to_reserved(seq)
        return True

    def _to_reserved(self, seq: Seq) -> None:
        # reservations are found by request id only: a stream's abort by sequence id
        # (its ``finally``) leaves a detached request's blocks alone
        seq.state = State.RESERVED
        self._seqs.pop(seq.id, None)
        self._reserved[seq.request_id] = seq

    def commit_reserved(self, request_id: str, computed: int) -> None:
        """The reservation's first ``computed`` tokens hold valid KV now; full blocks
        join the prefix cache."""
        seq = self._reserved[request_id]
        if not seq.num_computed <= computed < len(seq.tokens):
            raise ValueError(f"computed tokens must be in [{seq.num_computed}, {len(seq.tokens) - 1}], got {computed}")
        seq.num_computed = computed
        self._commit(seq)

    def release(self, request_id: str) -> bool:
        """Give back a reservation's blocks; False if there is none."""
        seq = self._reserved.pop(request_id, None)
        if seq is None:
            return False
        self._seqs.pop(seq.id, None)
        seq.state = State.ENDED
        self._free(seq.id)
        return True

    def detach(self, seq_id: int) -> Seq | None:
        """Take a queued or running sequence out of the schedule, keeping its blocks
        and computed tokens as a reservation (KV migration's source side). The last
        token counts as not computed: whoever resumes computes it, to sample from."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.state not in (State.WAITING, State.RUNNING) or not self.blocks.held_blocks(seq_id):
            return None
        if seq.request_id in self._reserved:
            return None
        (self._running if seq.state is State.RUNNING else self._waiting).remove(seq)
        seq.num_computed = min(seq.num_computed, len(seq.tokens) - 1)
        self._to_reserved(seq)
        return seq

    def hold_prefill(self, seq: Seq, cached_tokens: int) -> bool:
        """Queue a remote prefill over fresh blocks whose first ``cached_tokens`` tokens
        the caller fills (imported prefix); False when the pool is short."""
        self._register(seq)
        if not self.blocks.allocate(seq.id, seq.target):
            del self._seqs[seq.id]
            return False
        seq.num_computed = seq.cached_tokens = cached_tokens
        self._waiting.append(seq)
        return True

    def release_held(self, seq_id: int) -> None:
        """Free a remote prefill's blocks (after its KV was exported, or it was given up)."""
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.state is State.HELD:
            del self._seqs[seq_id]
            seq.state = State.ENDED
            self._free(seq_id)
        elif seq is not None:
            self.abort(seq_id)

    # ------------------------------------------------------------------ one pass

    def schedule(self) -> Plan:
        """Pick this pass's work (see the module docstring) and mark it in flight."""
        plan = Plan(budget=self.limits.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._admit_waiting(plan)
        self._in_flight = {s.id for s, _ in plan.entries}
        return plan

    def _schedule_running(self, plan: Plan) -> None:
        order = sorted(self._running, key=lambda s: s.target - s.num_computed > 1)  # decodes first, stable
        for i, seq in enumerate(order):
            if plan.budget <= 0:
                return
            if seq.state is not State.RUNNING:  # preempted earlier in this pass
                continue
            n = min(seq.target - seq.num_computed, plan.budget)
            if self._make_room(seq, n, order[i + 1 :], plan):
                plan.entries.append((seq, n))
                plan.budget -= n

    def _make_room(self, seq: Seq, n: int, later: list[Seq], plan: Plan) -> bool:
        """Grow ``seq``'s blocks for ``n`` more tokens, preempting later sequences
        (most recently admitted first). False if ``seq`` itself gave way."""
        while not self.blocks.allocate(seq.id, seq.num_computed + n):
            victims = [s for s in later if s.state is State.RUNNING and s.prefill_upto is None]
            if victims:
                self._preempt(max(victims, key=lambda s: s.admitted), plan)
                continue
            if plan.entries and seq.prefill_upto is None:
                self._preempt(seq, plan)
            else:
                self._running.remove(seq)
                plan.failed.append(self._end(seq, "error", self._too_big(seq)))
            return False
        return True

    def _too_big(self, seq: Seq) -> str:
        total = self.limits.num_blocks * self.limits.block_size
        return f"sequence of {seq.target} tokens does not fit the KV cache ({total} tokens) beside the others"

    def _preempt(self, seq: Seq, plan: Plan) -> None:
        self._running.remove(seq)
        self.blocks.free(seq.id)
        seq.state = State.WAITING
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        plan.preempted.append(seq.id)

    def _admit_waiting(self, plan: Plan) -> None:
        bs = self.limits.block_size
        while self._waiting and plan.budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            holds = self.blocks.held_blocks(seq.id) > 0  # adopted reservation / remote prefill
            hit = 0 if holds else self._prefix_hit(seq)
            computed = seq.num_computed if holds else hit * bs
            n = min(seq.target - computed, plan.budget)
            if not self.blocks.allocate(seq.id, computed + n, seq.seq_hashes[:hit]):
                if not self._running and not plan.entries and not self._reserved:
                    self._waiting.popleft()  # alone with an empty pool and still no room: never fits
                    plan.failed.append(self._end(seq, "error", self._too_big(seq)))
                    continue
                return
            self._waiting.popleft()
            if not holds and seq.admitted < 0:
                seq.cached_tokens = computed
            seq.num_computed = computed
            seq.admitted = self._admissions
            self._admissions += 1
            seq.state = State.RUNNING
            self._running.append(seq)
            plan.entries.append((seq, n))
            plan.budget -= n

    def complete(self, plan: Plan, sampled: dict[int, int]) -> tuple[list[Finished], list[int]]:
        """Apply a finished pass: ``sampled`` maps sequence id -> the token drawn for it.
        Returns the sequences that ended, and the ids of those whose token is emitted
        (all but an ending EOS). Sequences aborted or detached meanwhile are skipped."""
        finished: list[Finished] = []
        emitted: list[int] = []
        for seq, n in plan.entries:
            if seq.state is not State.RUNNING:
                continue
            seq.num_computed += n
            if seq.prefill_upto is not None:
                if seq.num_computed >= seq.prefill_upto:
                    finished.append(self._hold(seq))
                continue
            self._commit(seq)
            token = sampled.get(seq.id)
            if token is not None:
                reason = self._append(seq, token)
                if reason != "eos":
                    emitted.append(seq.id)
                if reason is not None:
                    finished.append(self._end(seq, "stop" if reason == "eos" else reason))
        if finished:
            self._running = [s for s in self._running if s.state is State.RUNNING]
        self._in_flight = set()
        for seq_id in self._deferred_free:
            self.blocks.free(seq_id)
        self._deferred_free.clear()
        return finished, emitted

    def _commit(self, seq: Seq) -> None:
        if self.limits.enable_prefix_caching:
            full = min(seq.num_computed // self.limits.block_size, len(seq.seq_hashes))
            self.blocks.commit(seq.id, seq.seq_hashes, seq.local_hashes, full)

    def _append(self, seq: Seq, token: int) -> FinishReason | Literal["eos"] | None:
        """Add a sampled token (not an ending EOS: ``"eos"``); the finish reason, if any."""
        if token in seq.eos_ids and not seq.ignore_eos:
            return "eos"
        seq.tokens.append(token)
        bs = self.limits.block_size
        if self.limits.enable_prefix_caching and len(seq.tokens) % bs == 0:
            local = local_block_hashes(seq.tokens[-bs:], bs)[0]
            seq.local_hashes.append(local)
            seq.seq_hashes.append(chain_one(seq.seq_hashes[-1] if seq.seq_hashes else None, local))
        if token in seq.stop_ids:
            return "stop"
        if seq.num_output >= seq.max_tokens or len(seq.tokens) >= self.limits.context_length:
            return "length"
        return None

    def _hold(self, seq: Seq) -> Finished:
        seq.state = State.HELD
        return Finished(seq.id, "stop", Usage(prompt_tokens=seq.target, completion_tokens=0))

    def _end(self, seq: Seq, reason: FinishReason, error: str | None = None) -> Finished:
        seq.state = State.ENDED
        self._seqs.pop(seq.id, None)
        self._free(seq.id)
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=seq.num_output, cached_tokens=seq.cached_tokens)
        return Finished(seq.id, reason, usage, error)
