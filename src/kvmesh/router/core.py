"""The KV-aware router's decision core. Pure and synchronous: the clock is an argument.

Composes the indexer (``kv``: from workers' KV events) or the approximate indexer
(``kv-approx``: from its own past decisions), active-load tracking and the cost
function::

    cost(w) = overlap_weight × prefill_blocks(w) + decode_blocks(w)      (lower wins)
    prefill_blocks(w) = (in-flight prefill tokens of w + this request's uncached tokens) / block_size
    decode_blocks(w)  = active blocks of w + this request's new blocks

KV tiers: a prefix run a worker holds partly in host memory or on disk (G2/G3) counts
as cached, each such block charged ``tier_weights`` of its prefill as prefill tokens.

A LoRA adapter's request charges the workers that do not hold it the adapter's load
time, as prefill tokens (``adapter_load_tokens``; :func:`~kvmesh.router.cost.with_adapter_load`).

Temperature 0 → minimum cost, ties broken by fewest cached blocks, then at random;
temperature > 0 → softmax sampling over normalised costs. Health routing weights in
(0, 1] scale a worker's chance (weight 0: never chosen unless all are 0). The exact
rules (effective cost ``(cost + 1) / weight`` at temperature 0, normalisation by the largest
cost, ``weight × exp(−ĉ / T)`` when sampling) are in :mod:`kvmesh.router.cost`.

Lifecycle (one caller at a time; the async glue is :mod:`kvmesh.router.service`)::

    core.add_worker(w) / core.remove_worker(w)      the candidate set follows discovery
    core.apply_event(event)                         each KV event of a worker, in order
    core.apply_batch(w, first_id, events)           or a batch of them (consecutive ids), up to a gap
    core.load_dump(w, hashes, last_event_id)        repair after a "gap"
    d = core.route(request_id, token_ids, now)      pick a worker, book the request's load
    core.first_token(request_id, now)               its prefill tokens leave the worker
    core.finished(request_id, now)                  its blocks leave the worker

``route`` also drops load entries untouched for ``load_ttl_s`` (a lost ``finished``
must not inflate a worker forever). Times are seconds on any monotonic clock.

In ``kv`` mode ``apply_event`` runs each event through an
:class:`~kvmesh.router.indexer.EventSequencer` (``"apply"`` / ``"stale"`` / ``"gap"``)
and applies it to the :class:`~kvmesh.router.indexer.KvIndexer` only on ``"apply"``.
Events of a worker not (yet) added are indexed too, but only added workers are
candidates. In ``kv-approx`` mode KV events are not used: ``apply_event`` ignores them
(``"stale"``, nothing to repair) and ``load_dump`` is a no-op; each decision records
the request's blocks on the chosen worker instead, for ``approx_ttl_s``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvmesh.errors import NoWorkers
from kvmesh.kv.events import KvEventView
from kvmesh.protocol import KvEvent
from kvmesh.router.approx import ApproxIndexer
from kvmesh.router.cost import (
    CandidateScore,
    CostInputs,
    check_knobs,
    new_blocks,
    score_all,
    select,
    select_greedy,
    uncached_tokens,
    with_adapter_load,
)
from kvmesh.kv.hashing import block_hashes as hash_blocks
from kvmesh.kv.tiers import DEFAULT_TIER_WEIGHTS, check_tier_weights
from kvmesh.router.indexer import DEFAULT_MAX_BLOCKS_PER_WORKER, EventSequencer, KvIndexer
from kvmesh.router.load import ActiveLoad

__all__ = ["MODES", "CandidateScore", "Decision", "KvRouterCore", "RouterSettings"]

# above this many workers, temperature-0 decisions skip building a score per worker
_FAST_PATH_WORKERS = 32

MODES = ("kv", "kv-approx")


@dataclass(frozen=True)
class RouterSettings:
    block_size: int
    mode: str = "kv"  # "kv" | "kv-approx"
    overlap_weight: float = 1.0
    temperature: float = 0.0
    seed: int | None = None
    load_ttl_s: float = 300.0  # an in-flight entry older than this is dropped (lost finish)
    approx_ttl_s: float = 120.0
    approx_max_blocks: int = 1_000_000
    max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER  # the KV index's cap (see router/indexer.py)
    adapter_load_tokens: float = 0.0  # a LoRA adapter's load on a worker lacking it, in prefill tokens (cost.py)
    tier_weights: tuple[float, float] = DEFAULT_TIER_WEIGHTS  # price of a G2, G3 hit, a fraction of its prefill (kv/tiers.py)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.mode not in MODES:
            raise ValueError(f"router mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_knobs(self.overlap_weight, self.temperature)
        check_tier_weights(self.tier_weights)
        if not (math.isfinite(self.adapter_load_tokens) and self.adapter_load_tokens >= 0):
            raise ValueError(f"adapter_load_tokens must be a finite number >= 0, got {self.adapter_load_tokens!r}")
        for name in ("load_ttl_s", "approx_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.approx_max_blocks <= 0:
            raise ValueError(f"approx_max_blocks must be > 0, got {self.approx_max_blocks!r}")


@dataclass(frozen=True)
class Decision:
    worker_id: int
    overlap_blocks: int
    candidates: list[CandidateScore] = field(default_factory=list)
    tiers: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # worker → leading blocks in G1, G2, G3 (only with lower-tier blocks)


class KvRouterCore:
    """Routing decisions over a set of workers; see the module docstring."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self._workers: dict[int, None] = {}  # insertion-ordered set: candidate order is stable
        self._rng = random.Random(settings.seed)
        self._load = ActiveLoad()
        self._sequencer = EventSequencer()
        self._indexer: KvIndexer | None = None
        self._approx: ApproxIndexer | None = None
        if settings.mode == "kv":
            self._indexer = KvIndexer(self.settings.max_blocks_per_worker)
        else:
            self._approx = ApproxIndexer(settings.approx_ttl_s, settings.approx_max_blocks)

    # ------------------------------------------------------------------ views

    @property
    def workers(self) -> list[int]:
        return list(self._workers)

    @property
    def load(self) -> ActiveLoad:
        """The booked load (read-only use: mutate it through this class)."""
        return self._load

    @property
    def indexer(self) -> KvIndexer | None:
        """The event-fed indexer (``kv`` mode), else None."""
        return self._indexer

    # ------------------------------------------------------------------ workers and events

    def add_worker(self, worker_id: int) -> None:
        self._workers[worker_id] = None

    def remove_worker(self, worker_id: int) -> None:
        """Forget the worker: its candidacy, its blocks, its event ids and its load."""
        self._workers.pop(worker_id, None)
        self._load.remove_worker(worker_id)
        self._sequencer.forget(worker_id)
        if self._indexer is not None:
            self._indexer.remove_worker(worker_id)
        if self._approx is not None:
            self._approx.remove_worker(worker_id)

    def apply_event(self, event: KvEvent) -> Literal["apply", "stale", "gap"]:
        """Apply one worker's KV event; returns ``"apply"``, ``"stale"`` or ``"gap"``
        (on a gap the event is not applied; repair with ``load_dump``/``replay``)."""
        return self.apply_one(event.worker_id, event.event_id, event.data)

    def apply_one(self, worker_id: int, event_id: int, data: KvEventView) -> Literal["apply", "stale", "gap"]:
        """``apply_event`` of the worker's event ``event_id`` carrying ``data``."""
        if self._indexer is None:
            return "stale"
        verdict = self._sequencer.accept(worker_id, event_id)
        if verdict == "apply":
            self._indexer.apply(worker_id, data)
        return verdict

    def apply_batch(self, worker_id: int, first_event_id: int, events: Sequence[KvEventView]) -> tuple[int, int]:
        """Apply ``events[i]`` as the worker's event ``first_event_id + i``, in order, as
        ``apply_event`` each would, up to the first gap. Returns ``(applied, stop)``:
        how many were applied (stale ones are skipped) and the index of the event after
        a gap, not applied (``len(events)`` when there was none); the caller repairs and
        then applies ``events[stop:]``. The common case (the batch follows the last
        applied id, or is the first seen of the worker) is one sequencer update and one
        ``KvIndexer.apply_many``."""
        n = len(events)
        if self._indexer is None:
            return 0, n
        seq = self._sequencer
        last = seq.last_event_id(worker_id)
        if n and (last is None or first_event_id == last + 1):  # the first seen is applied, whatever its id
            seq.reset(worker_id, first_event_id + n - 1)
            self._indexer.apply_many(worker_id, events)
            return n, n
        applied = 0
        for i, data in enumerate(events):
            verdict = seq.accept(worker_id, first_event_id + i)
            if verdict == "gap":
                return applied, i
            if verdict == "apply":
                self._indexer.apply(worker_id, data)
                applied += 1
        return applied, n

    def last_event_id(self, worker_id: int) -> int | None:
        """The id of the worker's last applied event (None: none yet, or forgotten)."""
        return self._sequencer.last_event_id(worker_id)

    def load_dump(self, worker_id: int, block_hashes: Sequence[int], last_event_id: int) -> None:
        """Replace the worker's blocks with a full dump taken after event ``last_event_id``."""
        if self._indexer is None:
            return
        self._indexer.load_dump(worker_id, block_hashes)
        self._sequencer.reset(worker_id, last_event_id)

    # ------------------------------------------------------------------ requests

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        now: float,
        weights: Mapping[int, float] | None = None,
        overlap_weight: float | None = None,
        temperature: float | None = None,
        block_hashes: Sequence[int] | None = None,
        matches: Mapping[int, int] | None = None,
        salt: int | None = None,
        holders: Collection[int] | None = None,
    ) -> Decision:
        """Pick a worker and book the request's load on it (until first token / finish).

        ``weights`` maps worker id → health weight (missing: 1.0); ``overlap_weight`` and
        ``temperature`` override the settings for this request; ``block_hashes`` (the
        chained hashes of the prompt's full blocks) skips hashing when the caller has them;
        ``matches`` (``{worker: leading blocks held}``, from an index elsewhere: a sharded
        one) replaces this core's own lookup; ``salt`` (:func:`kvmesh.kv.hashing.hash_salt`
        of the request's adapter and cache namespace) starts the prompt's hash chain.
        ``holders`` (a LoRA adapter's request: the workers holding it) charges every
        other worker the settings' ``adapter_load_tokens`` more prefill
        (:func:`kvmesh.router.cost.with_adapter_load`).
        Raises :class:`~kvmesh.errors.NoWorkers` when no worker was added.
        """
        if not self._workers:
            raise NoWorkers("the KV router has no workers")
        s = self.settings
        ow = s.overlap_weight if overlap_weight is None else overlap_weight
        temp = s.temperature if temperature is None else temperature
        if overlap_weight is not None or temperature is not None:  # (the settings' own were checked)
            check_knobs(ow, temp)
        self._load.expire(now, s.load_ttl_s)
        hashes = hash_blocks(token_ids, s.block_size, salt) if block_hashes is None else block_hashes
        load = self._load
        found = self._matches(hashes, now) if matches is None else dict(matches)
        prefill: Mapping[int, float] = load.prefill_by_worker
        if holders is not None:
            prefill = with_adapter_load(prefill, self._workers, holders, s.adapter_load_tokens)
        tier_runs = self._tier_runs(hashes) if matches is None else {}
        if tier_runs:  # blocks in host/disk tiers: priced (kv/tiers.py)
            found, prefill = self._price_tiers(tier_runs, prefill)
        inputs = CostInputs(found, len(token_ids), prefill, load.blocks_by_worker, s.block_size, ow)
        if temp == 0 and len(self._workers) > _FAST_PATH_WORKERS:
            chosen, candidates = select_greedy(self._workers, inputs, weights, self._rng)
        else:
            candidates = score_all(self._workers, inputs, weights)
            chosen = select(candidates, temp, self._rng)
        w, overlap, n = chosen.worker_id, chosen.overlap_blocks, len(token_ids)
        bs = s.block_size
        self._load.add(request_id, w, uncached_tokens(n, overlap, bs), new_blocks(n, overlap, bs), now)
        if self._approx is not None and hashes:
            self._approx.record(w, hashes, now)
        return Decision(w, overlap, candidates, tier_runs)

    def first_token(self, request_id: str, now: float) -> None:
        self._load.first_token(request_id, now)

    def finished(self, request_id: str, now: float) -> None:
        self._load.finished(request_id)

    # ------------------------------------------------------------------ steps of route

    def _tier_runs(self, hashes: Sequence[int]) -> dict[int, tuple[int, int, int]]:
        """``{worker: (g1, g2, g3)}`` leading blocks by tier, when any worker has blocks
        in a lower tier (else empty: the G1 path alone)."""
        index = self._indexer
        if index is None or not hashes or not index.has_lower_tiers:
            return {}
        return index.find_tier_matches(hashes)

    def _price_tiers(
        self, runs: Mapping[int, tuple[int, int, int]], prefill: Mapping[int, float]
    ) -> tuple[dict[int, int], dict[int, float]]:
        """A run held in any tier counts as cached; its G2/G3 blocks cost their price
        (``tier_weights``: a fraction of prefilling them) as prefill tokens."""
        (w2, w3), bs = self.settings.tier_weights, self.settings.block_size
        found = {w: sum(r) for w, r in runs.items()}
        priced = dict(prefill)
        for w, (_, n2, n3) in runs.items():
            if n2 or n3:
                priced[w] = priced.get(w, 0) + (w2 * n2 + w3 * n3) * bs
        return found, priced

    def _matches(self, hashes: Sequence[int], now: float) -> dict[int, int]:
        if not hashes:
            return {}
        if self._approx is not None:
            return self._approx.find_matches(hashes, now)
        return self._indexer.find_matches(hashes) if self._indexer is not None else {}
