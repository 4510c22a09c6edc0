"""One request as the batching scheduler sees it (:class:`Seq`), its states and how it
ended (:class:`Finished`). Pure values; :mod:`.scheduler` moves them between its queues,
:mod:`.holds` keeps those that hold blocks outside the queues."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

from kvmesh.protocol import FinishReason, Usage

__all__ = ["State", "Seq", "S", "Finished"]


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"  # holds blocks outside the queues (kv_reserve, kv_detach)
    HELD = "held"  # a remote prefill that is done: blocks kept until exported
    ENDED = "ended"


class Seq:
    """One request as the scheduler sees it. ``tokens`` = prompt + output; the first
    ``num_computed`` have KV in the pool. ``prefill_upto`` set: a remote prefill that
    computes that many tokens and samples nothing. Engines subclass it for their own
    per-request state (sampling parameters, the mocker's token oracle key). ``salt``: the
    parent its block hash chain starts from (:func:`kvmesh.kv.hashing.hash_salt` of its
    LoRA adapter and cache namespace; None: the base model's shared namespace); ``adapter``
    the adapter's name."""

    __slots__ = (
        "id", "request_id", "tokens", "prompt_len", "max_tokens", "min_tokens", "ignore_eos",
        "eos_ids", "stop_ids", "rank", "local_hashes", "seq_hashes", "num_computed",
        "cached_tokens", "state", "admitted", "prefill_upto", "salt", "adapter",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        tokens: list[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        eos_ids: frozenset[int] = frozenset(),
        stop_ids: frozenset[int] = frozenset(),
        rank: int = 1,
        prefill_upto: int | None = None,
        salt: int | None = None,
        adapter: str | None = None,
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
        self.rank = rank
        self.local_hashes: list[int] = []
        self.seq_hashes: list[int] = []
        self.num_computed = 0
        self.cached_tokens = 0
        self.state = State.WAITING
        self.admitted = -1
        self.prefill_upto = prefill_upto
        self.salt = salt
        self.adapter = adapter  # the LoRA adapter it runs with (None: the base model)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def target(self) -> int:
        """Tokens that must have KV before this sequence samples (or, prefill-only, ends)."""
        return self.prefill_upto if self.prefill_upto is not None else len(self.tokens)

    @property
    def is_decode(self) -> bool:
        return self.num_computed == self.target - 1 and self.num_computed >= self.prompt_len

    def banned(self) -> tuple[int, ...]:
        """Token ids a sampler must not pick now (EOS and stop ids before ``min_tokens``)."""
        if self.num_output >= self.min_tokens:
            return ()
        ids = set(self.stop_ids)
        if not self.ignore_eos:
            ids |= self.eos_ids
        return tuple(sorted(ids))


S = TypeVar("S", bound=Seq)


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that ended (its blocks freed, or kept when ``HELD``)."""

    seq_id: int
    request_id: str
    reason: FinishReason
    usage: Usage
    error: str | None = None
