"""Request migration policy: when a request may move, and how.

A request whose worker fails mid-stream with an error in
:data:`kvmesh.errors.MIGRATABLE` is re-issued on another worker as
``prompt + tokens generated so far`` (engines are deterministic per position, so the
stream continues where it stopped), at most ``MigrationBudget.limit`` times.

The new worker needs the KV of every token so far. Two ways to get it::

    kv_transfer: tokens × kv_bytes_per_token / link_bytes_per_s     (copy it over)
    re_prefill:  prefill_ms_fn(tokens)                               (recompute it)

What to do when a worker fails is :func:`next_step` (pure): retry elsewhere before any
token, migrate after some, finish when every token was already delivered, or fail;
:func:`migration_method` picks the method for a request a worker handed off.

The cheaper one wins, except that a transfer estimated over ``max_transfer_ms``
(500 ms, from the design) or with no usable link falls back to re-prefill. Both costs
grow linearly with the token count, so which is cheaper depends on the link's speed
against the prefill rate; for a 70B model (40 KB of KV per token per shard, 5000
prefill tokens/s) copying wins on any link faster than ~205 MB/s, and on PCIe (28 GB/s)
the 500 ms budget, not the cost, sends sequences past ~340K tokens to re-prefill.

When health checks take a worker out of routing while it still answers (UNHEALTHY by
latency or errors, given up on: DRAINING), its in-flight requests leave with their KV,
as on a graceful drain, unless it was ejected for corruption (its KV may be wrong):
:func:`handoff_allowed` says which; the worker hands them off in :func:`handoff_order`
(premium first); each moves to the target a :class:`CapacityLedger` picks (most free
KV blocks for its load) and copies the KV when :func:`migration_method`'s 500 ms rule
allows, else re-prefills. :class:`HandOffReport` is the worker's answer (wire type).

Pure functions, one small counter and the ledger; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import msgspec

from kvmesh.errors import MIGRATABLE
from kvmesh.protocol import DisaggregatedParams, PreprocessedRequest

__all__ = [
    "MigrationMethod",
    "Step",
    "RETRIES_BEFORE_OUTPUT",
    "next_step",
    "migration_method",
    "LINK_BYTES_PER_S",
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "DEFAULT_MAX_TRANSFER_MS",
    "MigrationCost",
    "prefill_ms_at",
    "estimate_migration",
    "is_migratable",
    "MigrationBudget",
    "resume_request",
    "MAX_HANDOFFS",
    "HandedOff",
    "HandOffReport",
    "handoff_allowed",
    "handoff_order",
    "TargetCapacity",
    "CapacityLedger",
]

MigrationMethod = Literal["kv_transfer", "re_prefill"]

# Effective bandwidths of the design's link types (bytes/s).
LINK_BYTES_PER_S: dict[str, float] = {
    "nvlink": 900e9,
    "nvswitch": 600e9,
    "infiniband": 50e9,
    "pcie": 28e9,
    "tcp": 10e9,  # the design's conservative fallback
}
# The design's prefill throughput for a 70B model at TP=8.
DEFAULT_PREFILL_TOKENS_PER_S = 5000.0
DEFAULT_MAX_TRANSFER_MS = 500.0


@dataclass(frozen=True, slots=True)
class MigrationCost:
    tokens: int
    total_bytes: int
    transfer_ms: float  # inf when there is no usable link
    reprefill_ms: float
    method: MigrationMethod


def prefill_ms_at(tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S) -> Callable[[int], float]:
    """A linear prefill-time model, for ``prefill_ms_fn``."""
    if not (math.isfinite(tokens_per_s) and tokens_per_s > 0):
        raise ValueError(f"tokens_per_s must be a positive finite number, got {tokens_per_s}")
    return lambda tokens: tokens / tokens_per_s * 1000.0


def estimate_migration(
    prompt_tokens: int,
    generated_tokens: int,
    kv_bytes_per_token: int,
    link_bytes_per_s: float | None,
    prefill_ms_fn: Callable[[int], float],
    *,
    max_transfer_ms: float = DEFAULT_MAX_TRANSFER_MS,
) -> MigrationCost:
    """Both costs and the chosen method; see the module docstring."""
    if prompt_tokens < 0 or generated_tokens < 0 or kv_bytes_per_token < 0:
        raise ValueError("token counts and kv_bytes_per_token must be >= 0")
    tokens = prompt_tokens + generated_tokens
    total_bytes = tokens * kv_bytes_per_token
    if link_bytes_per_s is None or not link_bytes_per_s > 0:
        transfer_ms = math.inf
    else:
        transfer_ms = total_bytes / link_bytes_per_s * 1000.0
    reprefill_ms = prefill_ms_fn(tokens)
    transfer_wins = transfer_ms < reprefill_ms and transfer_ms <= max_transfer_ms
    method: MigrationMethod = "kv_transfer" if transfer_wins else "re_prefill"
    return MigrationCost(tokens, total_bytes, transfer_ms, reprefill_ms, method)


def is_migratable(error: BaseException) -> bool:
    """May a request that failed with ``error`` be re-issued on another worker?"""
    return isinstance(error, MIGRATABLE)


Step = Literal["retry", "migrate", "finish", "fail"]
# a request that failed before its first token is re-routed at most this many times
RETRIES_BEFORE_OUTPUT = 3


def next_step(
    failure: BaseException, *, stopped: bool, delivered: int, max_tokens: int | None, attempts: int,
    migrations_left: int,
) -> Step:  # fmt: skip
    """What a request does after its worker's stream failed with ``failure``.

    ``stopped``: the request's context was stopped (client gone, cancelled): never
    moved. ``delivered``: tokens already sent to the client. ``attempts``: workers
    tried so far, the failed one included. ``migrations_left``: the budget.

    * ``fail``: not migratable, stopped, out of retries (before output) or of budget;
    * ``retry``: no token yet: route it again, to another worker;
    * ``finish``: every token the request may have was delivered, only the end was
      lost: it ends with ``length`` (takes the budget like a move);
    * ``migrate``: prompt + delivered tokens to another worker, the rest of the budget.
    """
    if stopped or not isinstance(failure, MIGRATABLE):
        return "fail"
    if not delivered:
        return "retry" if attempts <= RETRIES_BEFORE_OUTPUT else "fail"
    if migrations_left <= 0:
        return "fail"
    if max_tokens is not None and delivered >= max_tokens:
        return "finish"
    return "migrate"


def migration_method(prompt_tokens: int, generated: int, handoff: DisaggregatedParams | None) -> MigrationMethod:
    """KV transfer or re-prefill, by the cost model: a worker that handed the request
    off with its KV (``handoff``) offers the link; without one, re-prefill."""
    layout = handoff.layout if handoff is not None and handoff.kind == "kv_source" else None
    if layout is None:
        return "re_prefill"
    link = layout.simulated_bytes_per_s or LINK_BYTES_PER_S["tcp"]
    per_token = layout.bytes_per_block // layout.block_size
    return estimate_migration(prompt_tokens, generated, per_token, link, prefill_ms_at()).method


class MigrationBudget:
    """How many more times one request may migrate (default 3)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int = 3) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self.used = 0

    @property
    def remaining(self) -> int:
        return self.limit - self.used

    def try_spend(self) -> bool:
        """Take one migration from the budget; False (and no change) when exhausted."""
        if self.used >= self.limit:
            return False
        self.used += 1
        return True

    def __repr__(self) -> str:
        return f"MigrationBudget(used={self.used}, limit={self.limit})"


def resume_request(request: PreprocessedRequest, generated: list[int]) -> PreprocessedRequest:
    """The request to send to the new worker: the generated tokens appended to the
    prompt, ``max_tokens`` / ``min_tokens`` reduced by as many (the stream continues)."""
    if not generated:
        return request
    done = len(generated)
    stop = request.stop
    max_tokens = None if stop.max_tokens is None else max(0, stop.max_tokens - done)
    new_stop = msgspec.structs.replace(stop, max_tokens=max_tokens, min_tokens=max(0, stop.min_tokens - done))
    original = request.original_prompt_len if request.original_prompt_len is not None else len(request.token_ids)
    return msgspec.structs.replace(
        request, token_ids=[*request.token_ids, *generated], stop=new_stop, original_prompt_len=original
    )


# ------------------------------------------------------------------ hand-off on ejection

MAX_HANDOFFS = 4096  # requests one hand-off answer may list (a worker's batch is far smaller)
_PRIORITY_RANK = {"premium": 0, "standard": 1, "best_effort": 2}


class HandedOff(msgspec.Struct, frozen=True):
    """One request a worker handed off with its KV (in the order it did)."""

    request_id: Annotated[str, msgspec.Meta(max_length=256)]
    priority: Annotated[str, msgspec.Meta(max_length=16)] = "standard"
    tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class HandOffReport(msgspec.Struct, frozen=True):
    """A worker's answer to ``handoff``: what left with its KV (in order), and how many
    in-flight requests had no KV to hand off (``kept``: still queued there)."""

    moved: Annotated[list[HandedOff], msgspec.Meta(max_length=MAX_HANDOFFS)] = []
    kept: Annotated[int, msgspec.Meta(ge=0)] = 0




def handoff_allowed(reason: str) -> bool:
    """May a worker taken out of routing for ``reason`` (a transition's reason, e.g.
    ``check: latency_spike``) hand its requests off with their KV? Not when it computed
    wrong results: its KV may be corrupt too, so those re-prefill."""
    from kvmesh.health.state import CORRUPTION_KINDS  # the health state machine: not imported by a request's owner

    cause = reason.rsplit(":", 1)[-1].strip()
    return cause not in CORRUPTION_KINDS


T = TypeVar("T")


def handoff_order(items: Iterable[T], priority: Callable[[T], str | None]) -> list[T]:
    """``items`` premium first, then standard (also: no priority), then best effort;
    arrival order within a tier."""
    return sorted(items, key=lambda item: _PRIORITY_RANK.get(priority(item) or "standard", 1))


@dataclass(slots=True)
class TargetCapacity:
    """A healthy worker a moved request may go to: free KV blocks and requests held."""

    worker_id: int
    free_blocks: int
    load: int  # running + waiting requests


class CapacityLedger:
    """Where the requests handed off by one worker go: each claim takes the target with
    the most free KV blocks per request it holds (+1) that can hold the request's
    blocks, and books them there, so the next claim sees what is left."""

    __slots__ = ("targets", "block_size")

    def __init__(self, targets: Sequence[TargetCapacity], block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.targets = [TargetCapacity(t.worker_id, t.free_blocks, t.load) for t in targets]
        self.block_size = block_size

    def claim(self, tokens: int, exclude: Iterable[int] = ()) -> int | None:
        """The worker for a request of ``tokens`` tokens (booked), or None when no
        target has room (the router picks; the request re-prefills if it must)."""
        need = -(-max(0, tokens) // self.block_size)
        skip = set(exclude)
        fits = [t for t in self.targets if t.worker_id not in skip and t.free_blocks >= need]
        if not fits:
            return None
        best = max(fits, key=lambda t: (t.free_blocks / (1 + t.load), -t.worker_id))
        best.free_blocks -= need
        best.load += 1
        return best.worker_id
