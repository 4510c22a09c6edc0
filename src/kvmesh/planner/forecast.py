"""Load forecasts for the planner: pure, no I/O, no clock (one observation per round).

The planner sizes the fleet for the load it will carry when a worker it starts now is
ready, not for the last window. Each round it feeds a :class:`LoadForecaster` the
round's arrivals (a rate) and their mean prompt and output lengths (the mix); the
forecaster answers with :class:`LoadForecast` for the next rounds.

Methods, one per series, chosen by name (``METHODS``):

* ``last``: the last value (what the planner did before forecasting; the baseline);
* ``holt``: Holt's linear smoothing, a level and a trend, each an exponentially
  weighted average (``alpha``, ``beta``); the trend is damped (``phi``) so a forecast
  several rounds ahead does not run away on a short burst;
* ``kalman``: a local-linear-trend Kalman filter (state: level and trend) whose
  measurement variance follows the level, as a Poisson count's does, so its gain
  adapts to the load (noisier relative to a busy series' level when the series is
  quiet). Two small matrices, written out (no dependency).

:func:`forecast_errors` scores a method on a series (the errors of its forecasts
``steps`` ahead against what came). Measured on the replay traces (2 s rounds),
``kalman`` forecasts the rate best (e.g. conversation trace at speed 2.5: 0.36 WAPE one
round ahead against 0.41 ``holt`` and 0.51 ``last``) and ``holt`` the mix (0.34 against
0.38 and 0.47: a mean of heavy-tailed lengths is not Poisson-like), hence the defaults
of :class:`LoadForecaster`. The Kalman filter's process noise (``q_level`` 0.02,
``q_trend`` 0.006 of the series' size a round) is what the traces' loads change by, not
what their counts' Poisson noise does: with 0.05 and 0.02 of the level its trend followed
that noise, and five rounds ahead (a worker's start) it forecast a steady 120 arrivals a
round with a 13 % spread, more than the count's own 9 % (now 7.6 %), sizing the fleet for
noise. WAPE five rounds ahead, before → now: conversation (speed 2.5) 0.43 → 0.37, day at
10x (``synth --day --day-rates 6:60``) 0.14 → 0.11, shifting 0.27 → 0.25, a Poisson sine
swinging 19x in 50 rounds 0.17 → 0.15 (three ahead); the day compressed into 200 s
0.173 → 0.180. Scaled by the level alone (not the slow mean) the smaller noise could not
turn at a sine's trough (0.20 there, worse than the last value's 0.185).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "METHODS", "Forecaster", "LastValue", "Holt", "Kalman", "LoadForecast", "LoadForecaster", "ForecastError",
    "make_forecaster", "forecast_errors",
]  # fmt: skip


class Forecaster(Protocol):
    def update(self, value: float) -> None:
        """Take the next observation of the series."""
        ...

    def forecast(self, steps: int) -> float:
        """The series ``steps`` (>= 1) observations ahead (never negative); 0.0 before any."""
        ...


class LastValue:
    """The last observation, whatever the horizon."""

    def __init__(self) -> None:
        self._last = 0.0

    def update(self, value: float) -> None:
        self._last = value

    def forecast(self, steps: int) -> float:
        return max(0.0, self._last)


class Holt:
    """Holt's linear (double) exponential smoothing with a damped trend."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.2, phi: float = 0.9) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1 and 0 < phi <= 1):
            raise ValueError(f"Holt needs 0 < alpha <= 1, 0 <= beta <= 1, 0 < phi <= 1; got {alpha}, {beta}, {phi}")
        self.alpha, self.beta, self.phi = alpha, beta, phi
        self._level: float | None = None
        self._trend = 0.0

    def update(self, value: float) -> None:
        if self._level is None:
            self._level = value
            return
        prior = self._level + self.phi * self._trend
        level = self.alpha * value + (1 - self.alpha) * prior
        self._trend = self.beta * (level - self._level) + (1 - self.beta) * self.phi * self._trend
        self._level = level

    def forecast(self, steps: int) -> float:
        if self._level is None:
            return 0.0
        damp = sum(self.phi**k for k in range(1, steps + 1))
        return max(0.0, self._level + damp * self._trend)


class Kalman:
    """A local-linear-trend Kalman filter: ``level' = level + trend + w1``, ``trend' =
    trend + w2``, observed ``value = level + v``. The process noise is relative to the
    series' size (``q_level``, ``q_trend``: standard deviations per step as fractions of
    the larger of the level and the series' slow mean, an exponential average with
    weight ``slow`` a step: a load's swings scale with its typical size, so at a
    trough the filter still turns with the curve); the measurement variance is ``r`` ×
    max(level, ``floor``) (Poisson-like)."""

    def __init__(
        self, q_level: float = 0.02, q_trend: float = 0.006, r: float = 1.0, floor: float = 1.0, slow: float = 0.01
    ) -> None:
        if min(q_level, q_trend) < 0 or r <= 0 or floor <= 0 or not 0 < slow <= 1:
            raise ValueError("Kalman needs q_level, q_trend >= 0, r, floor > 0 and 0 < slow <= 1")
        self.q_level, self.q_trend, self.r, self.floor, self.slow = q_level, q_trend, r, floor, slow
        self._x: tuple[float, float] | None = None  # level, trend
        self._p = (1.0, 0.0, 0.0, 1.0)  # covariance, row-major 2x2
        self._typical = 0.0  # the series' slow mean (the process noise's scale)

    def update(self, value: float) -> None:
        if self._x is None:
            scale = max(abs(value), self.floor)
            self._x = (value, 0.0)
            self._p = (self.r * scale, 0.0, 0.0, (self.q_trend * scale) ** 2 + self.r * scale / 4)
            self._typical = abs(value)
            return
        level, trend = self._x
        p00, p01, p10, p11 = self._p
        self._typical += self.slow * (abs(value) - self._typical)
        # predict: x = F x, P = F P F' + Q with F = [[1, 1], [0, 1]]
        scale = max(abs(level), self.floor, self._typical)
        xl, xt = level + trend, trend
        a00 = p00 + p01 + p10 + p11 + (self.q_level * scale) ** 2
        a01, a10 = p01 + p11, p10 + p11
        a11 = p11 + (self.q_trend * scale) ** 2
        # update with H = [1, 0]
        s = a00 + self.r * max(abs(xl), self.floor)
        k0, k1 = a00 / s, a10 / s
        innovation = value - xl
        self._x = (xl + k0 * innovation, xt + k1 * innovation)
        self._p = ((1 - k0) * a00, (1 - k0) * a01, a10 - k1 * a00, a11 - k1 * a01)

    def forecast(self, steps: int) -> float:
        if self._x is None:
            return 0.0
        return max(0.0, self._x[0] + steps * self._x[1])


METHODS: dict[str, Callable[[], Forecaster]] = {"last": LastValue, "holt": Holt, "kalman": Kalman}


def make_forecaster(method: str) -> Forecaster:
    try:
        return METHODS[method]()
    except KeyError:
        raise ValueError(f"unknown forecast method {method!r} (choose from {', '.join(METHODS)})") from None


@dataclass(frozen=True, slots=True)
class LoadForecast:
    """The load expected over the next rounds: the arrival rate (the highest of the
    rounds forecast: the fleet must carry the peak) and the mean prompt and output
    lengths of the requests."""

    rate_rps: float = 0.0
    input_tokens: float = 0.0
    output_tokens: float = 0.0


class LoadForecaster:
    """Three series per round: the arrivals (``rate_method``, on the round's count: the
    Kalman filter's noise model is a count's) and the mean prompt / output lengths
    (``mix_method``; a round without arrivals leaves the mix as it was)."""

    def __init__(self, rate_method: str = "kalman", mix_method: str = "holt") -> None:
        self.rate_method, self.mix_method = rate_method, mix_method
        self._rate = make_forecaster(rate_method)
        self._input = make_forecaster(mix_method)
        self._output = make_forecaster(mix_method)
        self.rounds = 0
        self._interval_s = 1.0
        self._last_mix = (0.0, 0.0)  # the last round's mean prompt and output lengths

    def observe(self, arrived: int, interval_s: float, input_tokens: int, output_tokens: int) -> None:
        """One round: ``arrived`` requests in ``interval_s`` seconds, with these token totals."""
        if interval_s <= 0 or arrived < 0:
            raise ValueError("a round has a positive length and a non-negative arrival count")
        self._rate.update(float(arrived))
        self._interval_s = interval_s
        if arrived:
            self._last_mix = (input_tokens / arrived, output_tokens / arrived)
            self._input.update(self._last_mix[0])
            self._output.update(self._last_mix[1])
        self.rounds += 1

    def predict(self, steps: int) -> LoadForecast:
        """The next ``steps`` (>= 1) rounds: the peak rate among them, the mix at the last,
        but never shorter requests than the last round's (a trend of falling lengths is
        not extrapolated below what arrives now: at a shift from long prompts to short
        ones it reached 0 tokens, sizing the fleet for requests that cost nothing)."""
        steps = max(1, steps)
        rate = max(self._rate.forecast(k) for k in range(1, steps + 1)) / self._interval_s
        n_in, n_out = self._last_mix
        return LoadForecast(rate, max(self._input.forecast(steps), n_in), max(self._output.forecast(steps), n_out))


@dataclass(frozen=True, slots=True)
class ForecastError:
    """``wape``: Σ|forecast − actual| ÷ Σ actual; ``rmse``: root mean square error;
    ``under``: the share of forecasts below what came (a fleet sized on them is short)."""

    method: str
    steps: int
    wape: float
    rmse: float
    under: float


def forecast_errors(series: Sequence[float], method: str, steps: int = 1, warmup: int = 3) -> ForecastError:
    """Feed ``series`` to a fresh ``method`` forecaster; score its ``steps``-ahead forecasts
    made after ``warmup`` observations against the values that came."""
    f = make_forecaster(method)
    errors: list[float] = []
    actual_sum = 0.0
    under = 0
    for i, value in enumerate(series):
        f.update(value)
        j = i + steps
        if i + 1 >= warmup and j < len(series):
            predicted = f.forecast(steps)
            errors.append(predicted - series[j])
            actual_sum += abs(series[j])
            under += predicted < series[j]
    if not errors:
        raise ValueError(f"the series is too short to score {steps}-step forecasts after {warmup} observations")
    wape = sum(abs(e) for e in errors) / actual_sum if actual_sum > 0 else math.inf
    rmse = math.sqrt(sum(e * e for e in errors) / len(errors))
    return ForecastError(method, steps, wape, rmse, under / len(errors))
