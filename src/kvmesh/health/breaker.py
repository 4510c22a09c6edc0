"""A circuit breaker per worker: closed → open → half-open → closed.

::

    CLOSED ──failure_threshold consecutive failures──▶ OPEN
      ▲                                                 │ recovery_timeout_s after
      │ trial succeeds                                  ▼ the last failure
      └──────────────────────────────────────────── HALF_OPEN ──trial fails──▶ OPEN

* **closed**: every call is allowed; a success resets the failure count.
* **open**: nothing is allowed until ``recovery_timeout_s`` has passed since the last
  failure; a failure while open (a straggler) restarts that wait.
* **half-open**: at most ``half_open_max_calls`` trial calls are let through (a
  canary, normally). One success closes the breaker, one failure reopens it. A trial
  that never reports back (the worker hangs) does not wedge the breaker: after
  another ``recovery_timeout_s`` a new trial window opens.

The breaker is pure: every method takes the clock (``now``, seconds, any monotonic
origin) as an argument. Callers feed it canary results and real request failures.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["BreakerConfig", "BreakerState", "CircuitBreaker"]


class BreakerState(enum.IntEnum):
    """The value is what the ``kvmesh_circuit_breaker_state`` gauge exports."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Defaults from the design: open after 3 consecutive failures, try again after
    60 s, with one trial call."""

    failure_threshold: int = 3
    recovery_timeout_s: float = 60.0
    half_open_max_calls: int = 1

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if not (math.isfinite(self.recovery_timeout_s) and self.recovery_timeout_s >= 0):
            raise ValueError(f"recovery_timeout_s must be a finite number >= 0, got {self.recovery_timeout_s}")
        if self.half_open_max_calls < 1:
            raise ValueError(f"half_open_max_calls must be >= 1, got {self.half_open_max_calls}")


class CircuitBreaker:
    """See the module docstring. Not thread-safe; one owner calls it."""

    __slots__ = ("config", "_state", "_failures", "_opened_at", "_trials", "_trial_window_at")

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config if config is not None else BreakerConfig()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trials = 0
        self._trial_window_at = 0.0

    @property
    def state(self) -> BreakerState:
        """The stored state; OPEN becomes HALF_OPEN only inside :meth:`allow`."""
        return self._state

    @property
    def failure_count(self) -> int:
        """Consecutive failures seen while closed."""
        return self._failures

    def allow(self, now: float) -> bool:
        """May a call go to the worker now? Counts half-open trials (mutates)."""
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            if now - self._opened_at < self.config.recovery_timeout_s:
                return False
            self._state = BreakerState.HALF_OPEN
            self._open_trial_window(now)
        elif self._trials >= self.config.half_open_max_calls:
            # NOTE: a trial that never answered must not keep the breaker half-open forever.
            if now - self._trial_window_at < self.config.recovery_timeout_s:
                return False
            self._open_trial_window(now)
        self._trials += 1
        return True

    def record_success(self, now: float) -> None:
        """A call succeeded. Closes a half-open breaker; ignored while open (stale)."""
        del now  # part of the uniform signature; a success needs no timestamp
        if self._state is BreakerState.OPEN:
            return
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trials = 0

    def record_failure(self, now: float) -> None:
        """A call failed: count it (closed), reopen (half-open) or restart the wait (open)."""
        if self._state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures < self.config.failure_threshold:
                return
        self.trip(now)

    def trip(self, now: float) -> None:
        """Open at once, whatever the count (a fatal error, a dead process)."""
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._trials = 0

    def retry_after(self, now: float) -> float:
        """Seconds until an open breaker lets a trial through (0 when not open)."""
        if self._state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self.config.recovery_timeout_s - now)

    def _open_trial_window(self, now: float) -> None:
        self._trials = 0
        self._trial_window_at = now

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self._state.name}, failures={self._failures})"
