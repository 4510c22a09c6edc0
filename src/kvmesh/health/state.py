"""Worker health: check results in, a status and a routing weight out.

The state machine (one per worker)::

    HEALTHY ──1 failure──▶ SUSPICIOUS ──3 consecutive failures──▶ UNHEALTHY ──▶ DRAINING ──▶ DEAD
       ▲                       │                                      │            │
       ├──── check passes ─────┘                                      │            │
       ├──── recovery trial passes (breaker half-open) ───────────────┘            │
       └──── worker recovered (restarted, replaced) ───────────────────────────────┘

========== ============== ===============================================================
status     routing weight meaning
========== ============== ===============================================================
HEALTHY    1.0            serves normally; its canary latency feeds the EMA baseline
SUSPICIOUS 0.5            failed a check; keeps serving at half weight until a pass
UNHEALTHY  0.0            no new requests; in-flight ones drain; recovery is tried
DRAINING   0.0            given up on: finishing in-flight requests before it goes away
DEAD       0.0            the process is gone (terminal: a restarted worker is a new one)
========== ============== ===============================================================

Inputs are :class:`CheckResult` values (canary outcomes) and events: a real stream
failing, the process dying, a drain being requested, the worker having recovered.
Every input returns the :class:`Transition` it caused, or ``None``, so the caller can
log it and update ``kvmesh_worker_status``.

:class:`HealthTracker` is the per-worker bundle the wiring step holds: the state
machine, a :class:`~kvmesh.health.breaker.CircuitBreaker` (which gates canaries while
a worker is out of the pool) and the EMA latency baseline that defines a latency spike.

Everything here is pure: no I/O, no asyncio, the clock (``now``, seconds) is an argument.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvmesh.errors import MIGRATABLE, KvmeshError
from kvmesh.health.breaker import BreakerConfig, BreakerState, CircuitBreaker

__all__ = [
    "HealthStatus",
    "CheckKind",
    "CheckResult",
    "CORRUPTION_KINDS",
    "HealthConfig",
    "Transition",
    "EmaBaseline",
    "HealthStateMachine",
    "HealthTracker",
]


class HealthStatus(enum.IntEnum):
    """The value is what the ``kvmesh_worker_status`` gauge exports."""

    HEALTHY = 0
    SUSPICIOUS = 1
    UNHEALTHY = 2
    DRAINING = 3
    DEAD = 4


class CheckKind(enum.StrEnum):
    """Outcome of one health check; the value is the ``result`` metric label."""

    OK = "ok"
    TIMEOUT = "timeout"
    WRONG_TOKENS = "wrong_tokens"
    LOGIT_OUT_OF_RANGE = "logit_out_of_range"
    LATENCY_SPIKE = "latency_spike"
    ERROR = "error"  # the canary request itself failed (connection refused, engine error)


# Check outcomes that mean the worker computes wrong results (silent data corruption).
CORRUPTION_KINDS = frozenset({CheckKind.WRONG_TOKENS, CheckKind.LOGIT_OUT_OF_RANGE})


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One health check's outcome. ``latency_s`` is how long the check took."""

    kind: CheckKind
    latency_s: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind is CheckKind.OK

    @property
    def corruption(self) -> bool:
        """True for outcomes that indicate silent data corruption."""
        return self.kind in CORRUPTION_KINDS


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Thresholds of the health machine; defaults from the design unless noted.

    * ``suspicious_after_failures`` (1) and ``unhealthy_after_failures`` (3):
      consecutive failed checks to reach SUSPICIOUS / UNHEALTHY.
    * ``recover_after_successes`` (1): consecutive passes that bring a SUSPICIOUS or
      UNHEALTHY worker back to HEALTHY.
    * ``drain_after_failed_recoveries`` (3, kvmesh's choice): failed checks while
      UNHEALTHY (each one a half-open trial of the breaker) before giving up: DRAINING.
    * ``latency_spike_factor`` (3.0) × the EMA baseline (``baseline_alpha`` 0.1) is a spike.
    * ``suspicious_weight`` (0.5): routing weight of a SUSPICIOUS worker.
    * ``check_interval_s`` (30) and ``canary_max_retries`` (2): for the checker loop.
    """

    suspicious_after_failures: int = 1
    unhealthy_after_failures: int = 3
    recover_after_successes: int = 1
    drain_after_failed_recoveries: int = 3
    latency_spike_factor: float = 3.0
    baseline_alpha: float = 0.1
    suspicious_weight: float = 0.5
    check_interval_s: float = 30.0
    canary_max_retries: int = 2
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        for name in ("suspicious_after_failures", "recover_after_successes", "drain_after_failed_recoveries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.unhealthy_after_failures < self.suspicious_after_failures:
            raise ValueError("unhealthy_after_failures must be >= suspicious_after_failures")
        if not (math.isfinite(self.latency_spike_factor) and self.latency_spike_factor > 1.0):
            raise ValueError(f"latency_spike_factor must be a finite number > 1, got {self.latency_spike_factor}")
        if not (0.0 < self.baseline_alpha <= 1.0):
            raise ValueError(f"baseline_alpha must be within (0, 1], got {self.baseline_alpha}")
        if not (0.0 < self.suspicious_weight <= 1.0):
            raise ValueError(f"suspicious_weight must be within (0, 1], got {self.suspicious_weight}")
        if not (math.isfinite(self.check_interval_s) and self.check_interval_s > 0):
            raise ValueError(f"check_interval_s must be a positive finite number, got {self.check_interval_s}")
        if self.canary_max_retries < 0:
            raise ValueError(f"canary_max_retries must be >= 0, got {self.canary_max_retries}")

    def weight(self, status: HealthStatus) -> float:
        """Routing weight of a worker in ``status`` (the router's ``weights`` value)."""
        if status is HealthStatus.HEALTHY:
            return 1.0
        if status is HealthStatus.SUSPICIOUS:
            return self.suspicious_weight
        return 0.0


@dataclass(frozen=True, slots=True)
class Transition:
    """A status change, for logs and metrics."""

    worker_id: int
    src: HealthStatus
    dst: HealthStatus
    at: float
    reason: str


class EmaBaseline:
    """Exponential moving average of healthy check latencies (seconds).

    The first sample sets the baseline; later ones move it by ``alpha``. No baseline
    (``value is None``) means no spike can be detected yet.
    """

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float = 0.1) -> None:
        if not (0.0 < alpha <= 1.0):
            raise ValueError(f"alpha must be within (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def update(self, latency_s: float) -> None:
        if self.value is None:
            self.value = latency_s
        else:
            self.value += self.alpha * (latency_s - self.value)

    def is_spike(self, latency_s: float, factor: float) -> bool:
        base = self.value
        return base is not None and base > 0 and latency_s > factor * base


class HealthStateMachine:
    """The status of one worker; see the module docstring for the diagram."""

    __slots__ = ("config", "worker_id", "_status", "_failures", "_successes", "_failed_recoveries")

    def __init__(self, config: HealthConfig | None = None, worker_id: int = 0) -> None:
        self.config = config if config is not None else HealthConfig()
        self.worker_id = worker_id
        self._status = HealthStatus.HEALTHY
        self._failures = 0
        self._successes = 0
        self._failed_recoveries = 0

    @property
    def status(self) -> HealthStatus:
        return self._status

    @property
    def weight(self) -> float:
        return self.config.weight(self._status)

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def consecutive_successes(self) -> int:
        return self._successes

    # ------------------------------------------------------------------ inputs

    def on_check(self, result: CheckResult, now: float) -> Transition | None:
        """A health check finished with ``result``."""
        if result.ok:
            return self._on_pass(now)
        if self._status is HealthStatus.UNHEALTHY:
            return self._on_failed_recovery(result, now)
        return self._on_failure(f"check: {result.kind.value}", now)

    def on_stream_failure(self, now: float, *, fatal: bool = False) -> Transition | None:
        """A real request failed because of the worker. ``fatal``: the engine died
        (e.g. :class:`~kvmesh.errors.EngineShutdown`), so skip straight to UNHEALTHY."""
        if fatal and self._status in (HealthStatus.HEALTHY, HealthStatus.SUSPICIOUS):
            self._failures = max(self._failures + 1, self.config.unhealthy_after_failures)
            self._successes = 0
            return self._move(HealthStatus.UNHEALTHY, "stream: fatal engine error", now)
        if self._status is HealthStatus.UNHEALTHY:
            return None  # in-flight stragglers failing; not a recovery attempt
        return self._on_failure("stream: failure", now)

    def on_process_death(self, now: float) -> Transition | None:
        """The worker's process (or lease) is gone."""
        return self._move(HealthStatus.DEAD, "process died", now)

    def begin_drain(self, now: float, reason: str = "drain requested") -> Transition | None:
        """Take the worker out for good (operator request, shutdown, given up on)."""
        if self._status is HealthStatus.DEAD:
            return None
        return self._move(HealthStatus.DRAINING, reason, now)

    def on_recovered(self, now: float) -> Transition | None:
        """The worker was repaired (restarted, hot spare swapped in) and passed a check."""
        if self._status is HealthStatus.DEAD:
            return None
        self._reset_counts()
        return self._move(HealthStatus.HEALTHY, "recovered", now)

    # ------------------------------------------------------------------ steps

    def _on_pass(self, now: float) -> Transition | None:
        self._failures = 0
        self._successes += 1
        status = self._status
        if status not in (HealthStatus.SUSPICIOUS, HealthStatus.UNHEALTHY):
            return None  # HEALTHY stays; DRAINING / DEAD need an explicit recovery
        if self._successes < self.config.recover_after_successes:
            return None
        self._reset_counts()
        return self._move(HealthStatus.HEALTHY, "check passed", now)

    def _on_failure(self, reason: str, now: float) -> Transition | None:
        status = self._status
        if status not in (HealthStatus.HEALTHY, HealthStatus.SUSPICIOUS):
            return None
        self._successes = 0
        self._failures += 1
        cfg = self.config
        if self._failures >= cfg.unhealthy_after_failures:
            return self._move(HealthStatus.UNHEALTHY, reason, now)
        if self._failures >= cfg.suspicious_after_failures and status is HealthStatus.HEALTHY:
            return self._move(HealthStatus.SUSPICIOUS, reason, now)
        return None

    def _on_failed_recovery(self, result: CheckResult, now: float) -> Transition | None:
        self._successes = 0
        self._failures += 1
        self._failed_recoveries += 1
        if self._failed_recoveries < self.config.drain_after_failed_recoveries:
            return None
        return self._move(HealthStatus.DRAINING, f"recovery failed: {result.kind.value}", now)

    def _reset_counts(self) -> None:
        self._failures = 0
        self._successes = 0
        self._failed_recoveries = 0

    def _move(self, dst: HealthStatus, reason: str, now: float) -> Transition | None:
        src = self._status
        if src is dst or src is HealthStatus.DEAD:
            return None
        self._status = dst
        return Transition(self.worker_id, src, dst, now, reason)

    def __repr__(self) -> str:
        return f"HealthStateMachine(worker_id={self.worker_id}, status={self._status.name})"


class HealthTracker:
    """Everything the health service keeps about one worker.

    Lifecycle (the caller is one control loop, never concurrent with itself):

    1. ``begin_check(now)``: is a canary due and allowed? (interval elapsed, status
       not DRAINING/DEAD, breaker allows it; counts a half-open trial). If True, send one.
    2. ``record_check(result, now)``: feed its outcome (spike detection against the
       baseline happens here too, so a plain ``ok`` with a slow latency still counts).
    3. ``record_stream_error(error, now)`` / ``record_request_success(now)``: real
       traffic; only errors in :data:`kvmesh.errors.MIGRATABLE` blame the worker.
    4. ``record_process_death`` / ``begin_drain`` / ``record_recovered``: events.

    ``weight`` is 0 whenever the breaker is not closed, whatever the status.
    """

    __slots__ = ("worker_id", "config", "machine", "breaker", "baseline", "_last_check_at")

    def __init__(self, worker_id: int, config: HealthConfig | None = None) -> None:
        self.worker_id = worker_id
        self.config = cfg = config if config is not None else HealthConfig()
        self.machine = HealthStateMachine(cfg, worker_id)
        self.breaker = CircuitBreaker(cfg.breaker)
        self.baseline = EmaBaseline(cfg.baseline_alpha)
        self._last_check_at: float | None = None

    @property
    def status(self) -> HealthStatus:
        return self.machine.status

    @property
    def weight(self) -> float:
        if self.breaker.state is not BreakerState.CLOSED:
            return 0.0
        return self.machine.weight

    @property
    def baseline_s(self) -> float | None:
        """The EMA latency baseline (seconds), ``None`` before the first healthy check."""
        return self.baseline.value

    def begin_check(self, now: float) -> bool:
        """True when a canary should be sent now (mutates: records the check start)."""
        if self.machine.status in (HealthStatus.DRAINING, HealthStatus.DEAD):
            return False
        last = self._last_check_at
        if last is not None and now - last < self.config.check_interval_s:
            return False
        if not self.breaker.allow(now):
            return False
        self._last_check_at = now
        return True

    def record_check(self, result: CheckResult, now: float) -> Transition | None:
        result = self._classify_latency(result)
        if result.ok:
            self.breaker.record_success(now)
        else:
            self.breaker.record_failure(now)
        transition = self.machine.on_check(result, now)
        # NOTE: only latencies measured while HEALTHY move the baseline, so a degraded
        # worker cannot drag its own baseline up and hide the spike.
        if result.ok and self.machine.status is HealthStatus.HEALTHY:
            self.baseline.update(result.latency_s)
        return transition

    def record_stream_error(self, error: BaseException, now: float) -> Transition | None:
        """A real request on this worker ended with ``error``."""
        if not isinstance(error, MIGRATABLE):
            return None  # the request's own fault (bad input, cancelled): not the worker's
        fatal = isinstance(error, KvmeshError) and error.fatal
        if fatal:
            self.breaker.trip(now)
        else:
            self.breaker.record_failure(now)
        return self.machine.on_stream_failure(now, fatal=fatal)

    def record_request_success(self, now: float) -> None:
        """A real request completed: resets the breaker's failure count while closed."""
        if self.breaker.state is BreakerState.CLOSED:
            self.breaker.record_success(now)

    def record_process_death(self, now: float) -> Transition | None:
        self.breaker.trip(now)
        return self.machine.on_process_death(now)

    def begin_drain(self, now: float, reason: str = "drain requested") -> Transition | None:
        return self.machine.begin_drain(now, reason)

    def record_recovered(self, now: float) -> Transition | None:
        """The worker was repaired: closed breaker, fresh baseline, HEALTHY."""
        transition = self.machine.on_recovered(now)
        if transition is not None:
            self.breaker = CircuitBreaker(self.config.breaker)
            self.baseline = EmaBaseline(self.config.baseline_alpha)
        return transition

    def _classify_latency(self, result: CheckResult) -> CheckResult:
        if result.ok and self.baseline.is_spike(result.latency_s, self.config.latency_spike_factor):
            detail = f"latency {result.latency_s:.4f}s > {self.config.latency_spike_factor}x baseline"
            return CheckResult(CheckKind.LATENCY_SPIKE, result.latency_s, detail)
        return result

    def __repr__(self) -> str:
        return (
            f"HealthTracker(worker_id={self.worker_id}, status={self.status.name}, breaker={self.breaker.state.name})"
        )
