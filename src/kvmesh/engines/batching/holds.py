"""Sequences that hold KV blocks outside the batching scheduler's queues. Pure: no I/O,
no clock, no block manager.

Two small state machines the :class:`~kvmesh.engines.batching.scheduler.Scheduler`
delegates to. The blocks themselves stay the block manager's (the scheduler allocates
and frees them); these classes keep who holds them, in which state, and check the
moves.

:class:`Reservations`, by request id: blocks allocated for a request that is not
queued: ``kv_reserve`` (a decode worker's remote prefill, an incoming KV migration) or
``kv_detach`` (a request leaving with its KV)::

    put / detach ──▶ RESERVED ──commit(computed)──▶ RESERVED   (imported tokens now valid)
                        ├── adopt ───▶ WAITING   (queued with its blocks and computed tokens)
                        └── release ─▶ ENDED     (the caller frees its blocks)

A reservation is found by request id only, so a stream's abort by sequence id (its
``finally``) leaves a detached request's blocks alone.

:class:`HeldPrefills`, by sequence id: remote prefills (``Seq.prefill_upto``) whose
tokens are computed; their blocks stay until the engine exported the KV::

    hold ──▶ HELD ──release──▶ ENDED   (the caller frees its blocks)
"""

from __future__ import annotations

from typing import Generic, TypeVar

from kvmesh.engines.batching.sequence import Finished, S, State
from kvmesh.protocol import Usage

__all__ = ["Reservations", "HeldPrefills"]

_K = TypeVar("_K", str, int)


class _Held(Generic[_K, S]):
    """What both holders are: sequences by a key (a request id, a sequence id), each
    taken out at most once, in the state it leaves in."""

    __slots__ = ("_seqs",)

    def __init__(self) -> None:
        self._seqs: dict[_K, S] = {}

    def __contains__(self, key: _K) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def _take(self, key: _K, state: State) -> S | None:
        """Take ``key``'s sequence out, now in ``state``; None if none."""
        seq = self._seqs.pop(key, None)
        if seq is not None:
            seq.state = state
        return seq


class Reservations(_Held[str, S]):
    """Reserved sequences by request id; see the module docstring."""

    __slots__ = ()

    def get(self, request_id: str) -> S | None:
        return self._seqs.get(request_id)

    def all(self) -> list[S]:
        return list(self._seqs.values())

    def put(self, seq: S) -> None:
        """``seq`` (its blocks allocated, ``num_computed`` valid) becomes a reservation;
        ``ValueError`` when its request already holds one."""
        if seq.request_id in self._seqs:
            raise ValueError(f"request {seq.request_id!r} already holds a KV reservation")
        seq.state = State.RESERVED
        self._seqs[seq.request_id] = seq

    def detach(self, seq: S) -> None:
        """A queued or running ``seq`` (taken out of the queues by the caller) becomes a
        reservation. Its last token counts as not computed: whoever resumes it computes
        that token, to sample from."""
        seq.num_computed = min(seq.num_computed, len(seq.tokens) - 1)
        self.put(seq)

    def commit(self, request_id: str, computed: int) -> S:
        """The reservation's first ``computed`` tokens hold valid KV now (imported); at
        least one token is left to compute. Returns its sequence (the caller caches its
        full blocks); ``ValueError`` when there is none or ``computed`` is out of range."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise ValueError(f"no KV reservation for request {request_id!r}")
        if not seq.num_computed <= computed < len(seq.tokens):
            raise ValueError(f"computed tokens must be in [{seq.num_computed}, {len(seq.tokens) - 1}], got {computed}")
        seq.num_computed = computed
        return seq

    def adopt(self, request_id: str) -> S | None:
        """Take the reservation out to be queued (``WAITING``, blocks kept); None if none."""
        return self._take(request_id, State.WAITING)

    def release(self, request_id: str) -> S | None:
        """Take the reservation out to be freed (``ENDED``); None if none."""
        return self._take(request_id, State.ENDED)

    def clear(self) -> None:
        self._seqs.clear()


class HeldPrefills(_Held[int, S]):
    """Finished remote prefills by sequence id; see the module docstring."""

    __slots__ = ()

    def hold(self, seq: S) -> Finished:
        """``seq`` computed its ``prefill_upto`` tokens: keep it (``HELD``) and return its
        finish (``stop``, the prefilled tokens as the prompt, nothing generated)."""
        if seq.prefill_upto is None:
            raise ValueError(f"sequence {seq.id} is not a remote prefill")
        seq.state = State.HELD
        self._seqs[seq.id] = seq
        return Finished(seq.id, seq.request_id, "stop", Usage(prompt_tokens=seq.target, completion_tokens=0))

    def release(self, seq_id: int) -> S | None:
        """Take a held prefill out to be freed (``ENDED``); None if none."""
        return self._take(seq_id, State.ENDED)

    def clear(self) -> list[int]:
        """Forget every held prefill; returns their sequence ids."""
        ids = list(self._seqs)
        self._seqs.clear()
        return ids
