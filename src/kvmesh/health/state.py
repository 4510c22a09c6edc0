"""Worker health: check results in, a status and a routing weight out.

The state machine (one per worker)::

    HEALTHY ──1 failure──▶ SUSPICIOUS ──3 consecutive failures──▶ UNHEALTHY ──▶ DRAINING ──▶ DEAD
       │                                                               ▲
       └──── a wrong answer (corruption: wrong tokens, logits out of range) ┘
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

Telling load from failure (:class:`FleetLatency`, :class:`LoadSample`): a canary's
latency alone says little about a busy worker, whose steps carry other requests'
prefills and a fuller KV cache. When the monitor passes a :class:`LatencyContext`,
a canary is judged on its *compute* part (first token to last: the time spent
queueing for a batch slot is measured apart, as ``wait_s``) against what the
worker's load predicts (:meth:`LoadSample.multiplier`) times its *peers'*
load-normalised latency at the same moment (median of their fresh samples); with
no fresh peer sample, against its own load-normalised baseline; a spike counts only
when ``latency_confirm_rounds`` (2) consecutive checks agree. Fleet-wide slowness
moves the reference with it, so it evicts no one (degradation and shedding handle
it). Latency alone never takes more than ``max_latency_ejection_share`` (a third,
rounded down) of the fleet out of routing: beyond that a slow worker stays
SUSPICIOUS (half weight). So in a fleet of 2 latency alone only ever marks a worker
SUSPICIOUS; 3-5 workers: at most one is removed; 6-8: two. Hangs (timeouts),
errors and corruption are not limited.

Everything here is pure: no I/O, no asyncio, the clock (``now``, seconds) is an argument.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
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
    "LoadSample",
    "LatencyContext",
    "FleetLatency",
    "latency_ejection_allowed",
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
    """One health check's outcome. ``latency_s`` is how long the check took;
    ``compute_s`` the part judged for speed (a canary's first token to its last;
    ``None``: all of it); ``wait_s`` the time to the first token (queueing and the
    canary's own prefill), reported apart."""

    kind: CheckKind
    latency_s: float = 0.0
    detail: str = ""
    compute_s: float | None = None
    wait_s: float = 0.0

    @property
    def judged_s(self) -> float:
        """The latency a spike is judged on."""
        return self.latency_s if self.compute_s is None else self.compute_s

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
    * ``max_latency_ejection_share`` (1/3): latency alone takes at most
      ``floor(share × live workers)`` out of routing at once (0 in a fleet of 2).
    * ``load_tokens_unit`` (256) and ``kv_load_weight`` (5): the load model of
      :meth:`LoadSample.multiplier` (kvmesh's choice, fitted loosely to the mocker's
      vLLM timing model; generous on purpose: peers are the sharper reference).
    * ``peer_window_s`` (``None``: 2 × ``check_interval_s``, at least 1 s): how recent a
      peer's sample must be to count as "the same moment".
    * ``latency_spike_min_s`` (0.010): a spike must also exceed the expectation by this
      much (timer noise on a busy host at sub-millisecond latencies is not a spike).
    * ``latency_confirm_rounds`` (2): judged against load and peers, a spike counts as a
      failure only once this many consecutive checks spiked (a worker busy with a
      burst of CPU work for one round is not failing).
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
    max_latency_ejection_share: float = 1.0 / 3.0
    load_tokens_unit: float = 256.0
    kv_load_weight: float = 5.0
    peer_window_s: float | None = None
    latency_spike_min_s: float = 0.010
    latency_confirm_rounds: int = 2

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
        if not (0.0 <= self.max_latency_ejection_share <= 1.0):
            raise ValueError(f"max_latency_ejection_share must be within [0, 1], got {self.max_latency_ejection_share}")
        if not (math.isfinite(self.load_tokens_unit) and self.load_tokens_unit > 0):
            raise ValueError(f"load_tokens_unit must be a positive finite number, got {self.load_tokens_unit}")
        if not (math.isfinite(self.kv_load_weight) and self.kv_load_weight >= 0):
            raise ValueError(f"kv_load_weight must be a finite number >= 0, got {self.kv_load_weight}")
        if self.peer_window_s is not None and not (math.isfinite(self.peer_window_s) and self.peer_window_s > 0):
            raise ValueError(f"peer_window_s must be a positive finite number, got {self.peer_window_s}")
        if self.latency_confirm_rounds < 1:
            raise ValueError(f"latency_confirm_rounds must be >= 1, got {self.latency_confirm_rounds}")
        if not (math.isfinite(self.latency_spike_min_s) and self.latency_spike_min_s >= 0):
            raise ValueError(f"latency_spike_min_s must be a finite number >= 0, got {self.latency_spike_min_s}")

    @property
    def peer_window(self) -> float:
        """Seconds a peer's sample stays comparable."""
        if self.peer_window_s is not None:
            return self.peer_window_s
        return max(1.0, 2.0 * self.check_interval_s)

    def latency_ejection_budget(self, live_workers: int) -> int:
        """How many workers latency alone may keep out of routing at once."""
        return math.floor(self.max_latency_ejection_share * max(0, live_workers) + 1e-9)

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

    # ------------------------------------------------------------------ inputs

    def on_check(self, result: CheckResult, now: float, *, may_eject: bool = True) -> Transition | None:
        """A health check finished with ``result``. ``may_eject`` False: this failure
        may not take the worker out of routing (the fleet's latency-ejection budget is
        spent), so it stops at SUSPICIOUS."""
        if result.ok:
            return self._on_pass(now)
        if self._status is HealthStatus.UNHEALTHY:
            return self._on_failed_recovery(result, now)
        if result.corruption and self._status in (HealthStatus.HEALTHY, HealthStatus.SUSPICIOUS):
            # NOTE: wrong answers are never load: out of routing at once. Needing three
            # in a row let a worker that fails one check in two (subtly wrong logits)
            # serve corrupt output for 20 minutes at p99 (issue 34's simulated day).
            self._successes = 0
            self._failures = max(self._failures + 1, self.config.unhealthy_after_failures)
            return self._move(HealthStatus.UNHEALTHY, f"check: {result.kind.value}", now)
        return self._on_failure(f"check: {result.kind.value}", now, may_eject=may_eject)

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

    def _on_failure(self, reason: str, now: float, *, may_eject: bool = True) -> Transition | None:
        status = self._status
        if status not in (HealthStatus.HEALTHY, HealthStatus.SUSPICIOUS):
            return None
        self._successes = 0
        self._failures += 1
        cfg = self.config
        if not may_eject:
            self._failures = min(self._failures, cfg.unhealthy_after_failures - 1)
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

    __slots__ = (
        "worker_id", "config", "machine", "breaker", "baseline", "_last_check_at", "out_for_latency", "_spikes",
    )  # fmt: skip

    def __init__(self, worker_id: int, config: HealthConfig | None = None) -> None:
        self.worker_id = worker_id
        self.config = cfg = config if config is not None else HealthConfig()
        self.machine = HealthStateMachine(cfg, worker_id)
        self.breaker = CircuitBreaker(cfg.breaker)
        self.baseline = EmaBaseline(cfg.baseline_alpha)
        self._last_check_at: float | None = None
        # taken out of routing by a latency spike (counts against the fleet's budget)
        self.out_for_latency = False
        self._spikes = 0  # consecutive spiking checks judged in context

    @property
    def status(self) -> HealthStatus:
        return self.machine.status

    @property
    def weight(self) -> float:
        if self.breaker.state is not BreakerState.CLOSED:
            return 0.0
        return self.machine.weight

    @property
    def spike_streak(self) -> int:
        """Consecutive checks (judged in context) that spiked, not yet reset by a pass."""
        return self._spikes

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

    def record_check(
        self, result: CheckResult, now: float, context: LatencyContext | None = None
    ) -> Transition | None:
        """Feed a check's outcome. Without ``context`` a spike is judged against the
        worker's own EMA baseline; with one (the monitor's view of load and peers),
        against ``context.expected_s``, and the baseline learns load-normalised samples."""
        scale = 1.0 if context is None else context.multiplier
        result = self.classify_latency(result, context)
        latency_fail = result.kind is CheckKind.LATENCY_SPIKE
        if context is not None:
            self._spikes = self._spikes + 1 if latency_fail else 0
            if latency_fail and self._spikes < self.config.latency_confirm_rounds:
                return None  # not confirmed yet: neither a pass nor a failure
        may_eject = context is None or context.may_eject or not latency_fail
        if result.ok:
            self.breaker.record_success(now)
        elif may_eject:
            self.breaker.record_failure(now)
        transition = self.machine.on_check(result, now, may_eject=may_eject)
        # NOTE: only latencies measured while HEALTHY move the baseline, so a degraded
        # worker cannot drag its own baseline up and hide the spike.
        if result.ok and self.machine.status is HealthStatus.HEALTHY:
            self.baseline.update(result.judged_s / scale)
        self._note_ejection(transition, latency_fail)
        return transition

    def _note_ejection(self, transition: Transition | None, latency_fail: bool) -> None:
        if transition is None:
            return
        if transition.dst is HealthStatus.UNHEALTHY:
            self.out_for_latency = latency_fail
        elif transition.dst is HealthStatus.HEALTHY:
            self.out_for_latency = False

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
            self.out_for_latency = False
        return transition

    def classify_latency(self, result: CheckResult, context: LatencyContext | None = None) -> CheckResult:
        """``result``, or a ``latency_spike`` in its place when a passing check was too
        slow for ``context`` (or, without one, for the worker's own baseline). The
        context's ``relax`` (2 at degradation levels 3-4) widens the spike threshold."""
        if not result.ok:
            return result
        factor = self.config.latency_spike_factor * (1.0 if context is None else max(1.0, context.relax))
        if context is None:
            if self.baseline.is_spike(result.latency_s, factor):
                detail = f"latency {result.latency_s:.4f}s > {factor}x baseline"
                return CheckResult(CheckKind.LATENCY_SPIKE, result.latency_s, detail, result.compute_s, result.wait_s)
            return result
        expected = context.expected_s
        judged = result.judged_s
        if expected is not None and judged > factor * expected + self.config.latency_spike_min_s:
            detail = f"compute {judged:.4f}s > {factor}x {expected:.4f}s expected ({context.source})"
            return CheckResult(CheckKind.LATENCY_SPIKE, result.latency_s, detail, result.compute_s, result.wait_s)
        return result

    def __repr__(self) -> str:
        return (
            f"HealthTracker(worker_id={self.worker_id}, status={self.status.name}, breaker={self.breaker.state.name})"
        )


@dataclass(frozen=True, slots=True)
class LoadSample:
    """A worker's load around a check (from its load reports): running and waiting
    requests, KV use (0..1) and tokens per forward pass."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    batch_tokens: float = 0.0

    def multiplier(self, config: HealthConfig) -> float:
        """How much slower than idle this load makes a step, by a deliberately simple
        model: ``1 + batch_tokens / load_tokens_unit + kv_load_weight × kv_usage``. A
        pass carrying other requests' prefills costs more; so does attending over a
        fuller KV cache. Peers' samples pass through the same model, so its error
        mostly cancels out when a worker is compared with its peers."""
        kv = min(1.0, max(0.0, self.kv_usage))
        return 1.0 + max(0.0, self.batch_tokens) / config.load_tokens_unit + config.kv_load_weight * kv

    @staticmethod
    def heavier(a: LoadSample | None, b: LoadSample | None) -> LoadSample | None:
        """The heavier of two samples (before and after a check), field by field."""
        if a is None or b is None:
            return a or b
        return LoadSample(
            max(a.running, b.running), max(a.waiting, b.waiting), max(a.kv_usage, b.kv_usage),
            max(a.batch_tokens, b.batch_tokens),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class LatencyContext:
    """What a check's latency is judged against: ``expected_s`` (the compute time the
    worker's load and its peers predict; ``None``: no reference yet), ``multiplier``
    (the load's, to normalise the baseline), ``may_eject`` (the fleet's latency-ejection
    budget allows taking this worker out), ``source`` (for the log line), ``relax``
    (the degradation level's latency multiplier: ×2 at levels 3-4 widens the spike
    threshold as the level relaxes the latency SLOs)."""

    expected_s: float | None
    multiplier: float = 1.0
    may_eject: bool = True
    source: str = ""
    relax: float = 1.0


class FleetLatency:
    """Every worker's latest load-normalised canary latency, to compare a worker with
    its peers at the same moment. Pure: the monitor feeds it and asks it."""

    __slots__ = ("config", "_samples")

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config if config is not None else HealthConfig()
        self._samples: dict[int, tuple[float, float]] = {}  # worker -> (normalised s, at)

    def record(self, worker_id: int, judged_s: float, load: LoadSample | None, now: float) -> None:
        """A check of ``worker_id`` passed or spiked (not a timeout / wrong answer)."""
        scale = 1.0 if load is None else load.multiplier(self.config)
        self._samples[worker_id] = (judged_s / scale, now)

    def forget(self, worker_id: int) -> None:
        self._samples.pop(worker_id, None)

    def speed(self, worker_id: int, baseline_s: float | None, now: float) -> float:
        """How fast ``worker_id`` runs now against its own load-normalised baseline, in
        (0, 1] (1: as fast as ever, or unknown). Fleet-wide slowness lowers every
        worker's speed alike: graceful degradation reads it as lost capacity."""
        sample = self._samples.get(worker_id)
        if sample is None or baseline_s is None or baseline_s <= 0 or now - sample[1] > self.config.peer_window:
            return 1.0
        return min(1.0, max(0.05, baseline_s / sample[0])) if sample[0] > 0 else 1.0

    def peer_reference(self, worker_id: int, now: float) -> float | None:
        """Median of the other workers' fresh normalised latencies (``None``: none)."""
        window = self.config.peer_window
        fresh = sorted(v for w, (v, at) in self._samples.items() if w != worker_id and now - at <= window)
        if not fresh:
            return None
        mid = len(fresh) // 2
        return fresh[mid] if len(fresh) % 2 else (fresh[mid - 1] + fresh[mid]) / 2.0

    def context(
        self, worker_id: int, load: LoadSample | None, baseline_s: float | None, now: float, *, may_eject: bool
    ) -> LatencyContext:
        """The reference for ``worker_id``'s next check: its peers' median, else its own
        (load-normalised) baseline, scaled up by its current load."""
        scale = 1.0 if load is None else load.multiplier(self.config)
        peers = self.peer_reference(worker_id, now)
        if peers is not None:
            return LatencyContext(peers * scale, scale, may_eject, f"peers x load {scale:.2f}")
        if baseline_s is not None and baseline_s > 0:
            return LatencyContext(baseline_s * scale, scale, may_eject, f"own baseline x load {scale:.2f}")
        return LatencyContext(None, scale, may_eject, "no reference")


def latency_ejection_allowed(trackers: Iterable[HealthTracker], worker_id: int, config: HealthConfig) -> bool:
    """Whether latency alone may take ``worker_id`` out of routing now: fewer than
    ``config.latency_ejection_budget(live)`` other live (not DEAD) workers are out
    (UNHEALTHY, or DRAINING after failed recoveries) because of latency."""
    live = [t for t in trackers if t.status is not HealthStatus.DEAD]
    out = sum(1 for t in live if t.out_for_latency and t.worker_id != worker_id)
    return out < config.latency_ejection_budget(len(live))
