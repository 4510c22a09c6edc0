"""The batching scheduler's holds (engines/batching/holds.py): reservations by request id
and finished remote prefills by sequence id, as pure state machines, and the scheduler
delegating to them (blocks allocated and freed where they were before)."""

from __future__ import annotations

import pytest

from kvmesh.engines.batching.holds import HeldPrefills, Reservations
from kvmesh.engines.batching.scheduler import Scheduler, SchedulerLimits
from kvmesh.engines.batching.sequence import Seq, State

BS = 4


def _seq(rid: str, n: int = 10, *, computed: int = 0, upto: int | None = None, sid: int = 0) -> Seq:
    seq = Seq(rid, list(range(1, n + 1)), max_tokens=4, prefill_upto=upto)
    seq.id, seq.num_computed = sid, computed
    return seq


# ------------------------------------------------------------------ Reservations (pure)


def test_a_reservation_is_put_found_by_request_id_and_adopted_into_the_queue() -> None:
    holds: Reservations[Seq] = Reservations()
    seq = _seq("a", computed=4)
    holds.put(seq)
    assert seq.state is State.RESERVED and "a" in holds and holds.get("a") is seq and holds.all() == [seq]
    with pytest.raises(ValueError, match="'a' already holds a KV reservation"):
        holds.put(_seq("a", sid=1))
    assert holds.adopt("a") is seq and seq.state is State.WAITING and seq.num_computed == 4
    assert not holds and holds.adopt("a") is None and holds.release("a") is None


def test_a_commit_moves_the_valid_prefix_within_the_reservation_only() -> None:
    holds: Reservations[Seq] = Reservations()
    seq = _seq("a", 10, computed=4)
    holds.put(seq)
    for bad in (3, 10):  # below what is valid already; no token left to compute
        with pytest.raises(ValueError, match=r"computed tokens must be in \[4, 9\]"):
            holds.commit("a", bad)
    assert seq.num_computed == 4
    assert holds.commit("a", 9) is seq and seq.num_computed == 9
    with pytest.raises(ValueError, match="no KV reservation for request 'b'"):
        holds.commit("b", 1)


def test_a_detached_sequence_keeps_all_but_its_last_token_computed_and_release_ends_it() -> None:
    holds: Reservations[Seq] = Reservations()
    seq = _seq("a", 10, computed=10)
    holds.detach(seq)
    assert seq.num_computed == 9 and seq.state is State.RESERVED
    assert holds.release("a") is seq and seq.state is State.ENDED and len(holds) == 0


# ------------------------------------------------------------------ HeldPrefills (pure)


def test_a_finished_remote_prefill_is_held_until_released() -> None:
    held: HeldPrefills[Seq] = HeldPrefills()
    with pytest.raises(ValueError, match="not a remote prefill"):
        held.hold(_seq("a"))
    seq = _seq("a", 10, upto=8, sid=7)
    fin = held.hold(seq)
    assert (fin.seq_id, fin.request_id, fin.reason) == (7, "a", "stop")
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (8, 0)
    assert seq.state is State.HELD and 7 in held and len(held) == 1
    assert held.release(7) is seq and seq.state is State.ENDED and held.release(7) is None
    held.hold(_seq("b", 10, upto=8, sid=8))
    assert held.clear() == [8] and len(held) == 0


# ------------------------------------------------------------------ the scheduler delegating


def _scheduler() -> Scheduler[Seq]:
    return Scheduler(SchedulerLimits(block_size=BS, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, context_length=64))


def _run_to_hold(s: Scheduler[Seq], seq: Seq) -> None:
    plan = s.schedule()
    assert [x for x, _ in plan.entries] == [seq] and plan.samples == []
    finished, emitted = s.complete(plan, {})
    assert [f.request_id for f in finished] == [seq.request_id] and emitted == []


def test_a_held_prefill_keeps_its_blocks_out_of_the_queues_until_released() -> None:
    s = _scheduler()
    seq = _seq("p", 10, upto=8)
    assert s.hold_prefill(seq, 4)
    _run_to_hold(s, seq)
    assert seq.state is State.HELD and s.get(seq.id) is None and not s.has_work
    assert s.blocks.held_blocks(seq.id) == 2  # kept for the export
    s.release_held(seq.id)
    assert s.blocks.active_blocks == 0 and seq.state is State.ENDED


def test_aborting_or_resetting_frees_a_held_prefill() -> None:
    s = _scheduler()
    seq = _seq("p", 10, upto=8)
    s.hold_prefill(seq, 0)
    _run_to_hold(s, seq)
    assert s.abort(seq.id) and s.blocks.active_blocks == 0 and not s.abort(seq.id)
    again = _seq("q", 10, upto=8)
    s.hold_prefill(again, 0)
    _run_to_hold(s, again)
    assert s.reset() == [again.id]


def test_a_reservation_is_outside_the_queues_and_a_stream_abort_by_id_leaves_it() -> None:
    s = _scheduler()
    seq = _seq("r", 10)
    assert s.reserve(seq) and s.reservation("r") is seq and s.reservations() == [seq]
    assert not s.abort(seq.id)  # a stream's finally aborts by sequence id: not this one
    assert s.blocks.held_blocks(seq.id) == 3 and not s.has_work
    s.commit_reserved("r", 8)
    assert seq.num_computed == 8
    assert s.adopt("r") is seq and s.num_waiting == 1 and s.reservation("r") is None
    assert s.detach(seq.id) is seq and s.reservation("r") is seq and s.num_waiting == 0
    assert s.release("r") and s.blocks.active_blocks == 0 and not s.release("r")
