"""Graceful degradation: how much of the SLO target the healthy fleet can carry, and
what to give up when it cannot.

Capacity model (per worker, from its :class:`~kvmesh.protocol.LoadReport`)::

    concurrency  = min(max_batch_size, total_blocks // ceil(avg_seq_len / block_size))
    request_time = slo_ttft + avg_output_tokens × slo_tpot           (seconds, at the SLO)
    capacity_rps = concurrency / request_time × routing weight        (Little's law)

    ratio = Σ capacity_rps / target_rps       (target: the throughput SLO, or a demand)

Levels (thresholds on ``ratio`` from the design) and their actions:

===== ======== ================ =========== ============= ==========
level ratio    batch multiplier shed        latency SLO × accept new
===== ======== ================ =========== ============= ==========
0     ≥ 1.0    1.0              —           1.0           yes
1     ≥ 0.75   0.75             —           1.0           yes
2     ≥ 0.50   0.75             best_effort 1.0           yes
3     ≥ 0.25   0.50             best_effort 2.0           yes
4     < 0.25   0.50             best_effort 2.0           no (drain)
===== ======== ================ =========== ============= ==========

Hysteresis: a worse level applies at once; a better one only once the ratio has
cleared the better level's threshold by ``hysteresis`` for ``recover_hold_s``
(so one good sample does not flap the fleet between levels).

:func:`admit` turns a level into a per-request decision for the tiers ``premium``,
``standard``, ``best_effort``. Everything here is pure; the clock is an argument.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvmesh.protocol import LoadReport

__all__ = [
    "DegradationLevel",
    "Priority",
    "parse_priority",
    "DegradationActions",
    "ACTIONS",
    "CapacityConfig",
    "CapacityModel",
    "level_for_ratio",
    "LevelChange",
    "DegradationController",
    "Decision",
    "admit",
]


class DegradationLevel(enum.IntEnum):
    """The value is what the ``kvmesh_degradation_level`` gauge exports."""

    NONE = 0
    REDUCE_BATCH = 1
    SHED_BEST_EFFORT = 2
    RELAX_LATENCY = 3
    REJECT_NEW = 4


class Priority(enum.IntEnum):
    """Request tiers, highest first (a lower value is more important)."""

    PREMIUM = 0
    STANDARD = 1
    BEST_EFFORT = 2


_PRIORITY_NAMES = {"premium": Priority.PREMIUM, "standard": Priority.STANDARD, "best_effort": Priority.BEST_EFFORT}


def parse_priority(value: str | None) -> Priority:
    """A request's tier from its routing hint; ``None`` is ``standard``."""
    if value is None:
        return Priority.STANDARD
    try:
        return _PRIORITY_NAMES[value]
    except KeyError:
        raise ValueError(f"unknown priority {value!r}; expected one of {sorted(_PRIORITY_NAMES)}") from None


@dataclass(frozen=True, slots=True)
class DegradationActions:
    """What the router / frontend should do at one level."""

    batch_multiplier: float
    shed: frozenset[Priority]
    latency_multiplier: float
    accept_new: bool


_SHED_BE = frozenset({Priority.BEST_EFFORT})

ACTIONS: Mapping[DegradationLevel, DegradationActions] = {
    DegradationLevel.NONE: DegradationActions(1.0, frozenset(), 1.0, True),
    DegradationLevel.REDUCE_BATCH: DegradationActions(0.75, frozenset(), 1.0, True),
    DegradationLevel.SHED_BEST_EFFORT: DegradationActions(0.75, _SHED_BE, 1.0, True),
    DegradationLevel.RELAX_LATENCY: DegradationActions(0.5, _SHED_BE, 2.0, True),
    DegradationLevel.REJECT_NEW: DegradationActions(0.5, _SHED_BE, 2.0, False),
}


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    """SLOs and workload shape; defaults from the design unless noted.

    ``avg_output_tokens`` (256), ``block_size`` (16), ``hysteresis`` (0.05) and
    ``recover_hold_s`` (30 s, one check interval) are kvmesh's choices.
    ``thresholds``: lowest ratio of levels 0, 1, 2, 3 (below the last: level 4).
    """

    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 30.0
    slo_throughput_rps: float = 100.0
    max_batch_size: int = 256
    avg_seq_len: int = 2048
    avg_output_tokens: int = 256
    block_size: int = 16
    thresholds: tuple[float, float, float, float] = (1.0, 0.75, 0.5, 0.25)
    hysteresis: float = 0.05
    recover_hold_s: float = 30.0
    retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("slo_ttft_ms", "slo_tpot_ms", "slo_throughput_rps"):
            _check_positive(name, getattr(self, name))
        for name in ("max_batch_size", "avg_seq_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.avg_output_tokens < 0:
            raise ValueError(f"avg_output_tokens must be >= 0, got {self.avg_output_tokens}")
        t = self.thresholds
        if len(t) != 4 or not all(math.isfinite(x) for x in t) or list(t) != sorted(t, reverse=True) or t[-1] < 0:
            raise ValueError(f"thresholds must be four finite decreasing numbers >= 0, got {t!r}")
        for name in ("hysteresis", "recover_hold_s", "retry_after_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.avg_seq_len // self.block_size)

    @property
    def request_time_s(self) -> float:
        """How long one average request occupies a slot when it just meets the SLOs."""
        return (self.slo_ttft_ms + self.avg_output_tokens * self.slo_tpot_ms) / 1000.0


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value}")


class CapacityModel:
    """Requests per second a set of workers sustains within the SLOs."""

    __slots__ = ("config",)

    def __init__(self, config: CapacityConfig | None = None) -> None:
        self.config = config if config is not None else CapacityConfig()

    def worker_rps(self, report: LoadReport) -> float:
        cfg = self.config
        concurrency = min(cfg.max_batch_size, report.total_blocks // cfg.blocks_per_seq)
        return concurrency / cfg.request_time_s

    def capacity_rps(self, reports: Iterable[LoadReport], weights: Mapping[int, float] | None = None) -> float:
        """Sum over ``reports`` (the healthy workers'), each scaled by its routing weight
        (1 when missing: a SUSPICIOUS worker at 0.5 counts for half)."""
        total = 0.0
        for report in reports:
            weight = 1.0 if weights is None else weights.get(report.worker_id, 1.0)
            total += self.worker_rps(report) * weight
        return total

    def ratio(
        self, reports: Iterable[LoadReport], weights: Mapping[int, float] | None = None, demand_rps: float | None = None
    ) -> float:
        """Capacity over the target (``demand_rps`` when given, else the throughput SLO)."""
        target = self.config.slo_throughput_rps if demand_rps is None else demand_rps
        capacity = self.capacity_rps(reports, weights)
        if target <= 0:
            return math.inf
        return capacity / target


def level_for_ratio(
    ratio: float, thresholds: tuple[float, float, float, float] = (1.0, 0.75, 0.5, 0.25)
) -> DegradationLevel:
    """The level a capacity ratio calls for, without hysteresis."""
    for level, lowest in enumerate(thresholds):
        if ratio >= lowest:
            return DegradationLevel(level)
    return DegradationLevel.REJECT_NEW


@dataclass(frozen=True, slots=True)
class LevelChange:
    src: DegradationLevel
    dst: DegradationLevel
    at: float
    ratio: float


class DegradationController:
    """The fleet's degradation level with hysteresis; called every evaluation period
    by one owner (the planner / health loop)."""

    __slots__ = ("model", "_level", "_better_since", "_ratio")

    def __init__(self, config: CapacityConfig | None = None) -> None:
        self.model = CapacityModel(config)
        self._level = DegradationLevel.NONE
        self._better_since: float | None = None
        self._ratio = math.inf

    @property
    def config(self) -> CapacityConfig:
        return self.model.config

    @property
    def level(self) -> DegradationLevel:
        return self._level

    @property
    def actions(self) -> DegradationActions:
        return ACTIONS[self._level]

    @property
    def last_ratio(self) -> float:
        return self._ratio

    def evaluate(
        self,
        reports: Iterable[LoadReport],
        now: float,
        *,
        weights: Mapping[int, float] | None = None,
        demand_rps: float | None = None,
    ) -> LevelChange | None:
        """Recompute from the healthy workers' latest load reports."""
        return self.update(self.model.ratio(reports, weights, demand_rps), now)

    def update(self, ratio: float, now: float) -> LevelChange | None:
        """Move to the level ``ratio`` calls for, subject to hysteresis."""
        self._ratio = ratio
        cfg = self.config
        wanted = level_for_ratio(ratio, cfg.thresholds)
        if wanted > self._level:
            self._better_since = None
            return self._set(wanted, now, ratio)
        # NOTE: improving needs clearing the better level's threshold by `hysteresis`.
        better = level_for_ratio(ratio - cfg.hysteresis, cfg.thresholds)
        if better >= self._level:
            self._better_since = None
            return None
        if self._better_since is None:
            self._better_since = now
        if now - self._better_since < cfg.recover_hold_s:
            return None
        self._better_since = None
        return self._set(better, now, ratio)

    def _set(self, level: DegradationLevel, now: float, ratio: float) -> LevelChange:
        change = LevelChange(self._level, level, now, ratio)
        self._level = level
        return change


@dataclass(frozen=True, slots=True)
class Decision:
    """Admission verdict; ``retry_after_s`` is set when rejected (``Retry-After``)."""

    allowed: bool
    retry_after_s: float | None = None


_ALLOW = Decision(True)


def admit(priority: Priority | str | None, level: DegradationLevel | int, *, retry_after_s: float = 30.0) -> Decision:
    """May a new request of tier ``priority`` start at degradation ``level``?

    Level 0–1 admit everything; 2–3 shed ``best_effort``; 4 rejects every new request
    (in-flight ones finish). Rejections carry the design's 30 s retry hint.
    """
    tier = priority if isinstance(priority, Priority) else parse_priority(priority)
    actions = ACTIONS[DegradationLevel(level)]
    if actions.accept_new and tier not in actions.shed:
        return _ALLOW
    return Decision(False, retry_after_s)
