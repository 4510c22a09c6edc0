"""The hf scheduler on its own (pure): chunked prefill under the token budget, decodes
first, prefix reuse, preemption, stop rules, and blocks of a pass in flight."""

from __future__ import annotations

import pytest

from kvmesh.engines.hf.sampling import SampleParams
from kvmesh.engines.hf.scheduler import Scheduler, SchedulerLimits, Seq, State
from kvmesh.runtime.events import RecordingPublisher

pytest.importorskip("torch")


def _sched(num_blocks: int = 16, budget: int = 8, **kw) -> Scheduler:
    limits = SchedulerLimits(block_size=4, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=budget,
                             context_length=64, **kw)  # fmt: skip
    return Scheduler(limits, RecordingPublisher())


def _seq(tokens, rid: str = "r", max_tokens: int = 8, **kw) -> Seq:
    return Seq(rid, list(tokens), SampleParams(), max_tokens=max_tokens, **kw)


def _pass(s: Scheduler, token: int = 7) -> tuple[list[tuple[int, int]], list]:
    plan = s.schedule()
    entries = [(seq.id, n) for seq, n in plan.entries]
    finished, _ = s.complete(plan, {seq.id: token for seq in plan.samples})
    return entries, plan.failed + finished


def test_long_prompt_is_prefilled_in_chunks_and_decodes_go_first():
    s = _sched(budget=8)
    a = s.add(_seq(range(1, 11), "a"))  # 10 tokens: chunks 8 + 2
    assert _pass(s)[0] == [(a, 8)]
    b = s.add(_seq(range(20, 23), "b"))
    assert _pass(s)[0] == [(a, 2), (b, 3)]  # a samples its first token, b prefills
    assert _pass(s)[0] == [(a, 1), (b, 1)]  # both decode now


def test_prefix_reuse_keeps_the_last_token_to_compute():
    s = _sched()
    first = _seq(range(1, 9), "a", max_tokens=1)  # exactly two full blocks
    s.add(first)
    _pass(s)
    again = _seq(range(1, 9), "b", max_tokens=1)
    s.add(again)
    entries, finished = _pass(s)
    assert entries == [(again.id, 4)]  # one block reused; the last block recomputed
    assert finished[0].usage.cached_tokens == 4


def test_preemption_frees_the_latest_admitted_and_it_resumes():
    s = _sched(num_blocks=4, budget=16)
    a = s.add(_seq(range(1, 8), "a", max_tokens=20))  # 7 tokens: 2 blocks
    b = s.add(_seq(range(30, 37), "b", max_tokens=20))  # 2 blocks: the pool is full
    _pass(s)
    _pass(s)  # both at 8 + 1 tokens: the next decode needs a third block each
    plan = s.schedule()
    assert [seq.id for seq, _ in plan.entries] == [a] and plan.preempted == [b]
    s.complete(plan, {a: 7})
    assert s.get(b).state is State.WAITING and s.get(b).num_computed == 0


def test_stop_rules_and_min_tokens_bans():
    s = _sched()
    seq = _seq([1, 2, 3], "a", max_tokens=5, min_tokens=2, eos_ids=frozenset({9}), stop_ids=frozenset({8}))
    s.add(seq)
    assert seq.banned() == (8, 9)
    _pass(s, token=5)
    _pass(s, token=5)
    assert seq.banned() == ()
    entries, finished = _pass(s, token=9)  # EOS: ends, not emitted
    assert finished[0].reason == "stop" and seq.tokens == [1, 2, 3, 5, 5]
    other = _seq([1, 2, 3], "b", max_tokens=5, ignore_eos=True, eos_ids=frozenset({9}), stop_ids=frozenset({8}))
    s.add(other)
    _pass(s, token=9)  # ignore_eos: an ordinary token
    _, finished = _pass(s, token=8)  # a stop id is emitted
    assert finished[0].reason == "stop" and other.tokens[-2:] == [9, 8]


def test_blocks_of_a_pass_in_flight_are_freed_only_after_it():
    s = _sched()
    a = s.add(_seq(range(1, 6), "a"))
    plan = s.schedule()
    assert s.blocks.active_blocks == 2
    s.abort(a)  # while the forward pass would be running
    assert s.blocks.active_blocks == 2
    finished, emitted = s.complete(plan, {a: 7})
    assert finished == [] and emitted == [] and s.blocks.active_blocks == 0


def test_reservation_detach_and_release():
    s = _sched()
    res = _seq(range(1, 11), "a")
    assert s.reserve(res) and res.state is State.RESERVED and s.blocks.active_blocks == 3
    s.commit_reserved("a", 8)
    assert s.adopt("a") is res
    entries, _ = _pass(s)
    assert entries == [(res.id, 2)]  # only the uncommitted tokens
    detached = s.detach(res.id)
    assert detached is res and res.num_computed == len(res.tokens) - 1
    assert not s.abort(res.id)  # a stream's abort by id leaves the reservation alone
    assert s.release("a") and s.blocks.active_blocks == 0
