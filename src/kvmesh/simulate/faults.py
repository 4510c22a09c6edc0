"""What goes wrong in a simulated fleet, and when: fault rates and the schedule drawn
from them (pure; the random generator is passed in).

Defaults are the fault-tolerance seed's numbers where it gives them:

* GPU failure: 3 % per GPU per year (the seed's 2-5 %, its worked example's 3 %); one
  GPU takes its whole tensor-parallel group down, so a group of ``tp`` GPUs fails
  ``tp`` times as often;
* silent data corruption: one event per GPU every 115 days (the seed's uncaught
  1e-15 per FLOP at a 70B model's rate: "across 1,000 GPUs, one SDC event every 2.7
  hours"). The simulation treats an event as a GPU that computes wrong from then on
  until it is replaced (the worst case: a one-off flip would touch one request and no
  canary could see it), half of them visibly wrong tokens, half subtly wrong logits;
* the seed gives no rates for hangs, thermal slow-downs, rack partitions or control
  plane outages; ours (below) are stated guesses, on the command line.

``--failure-scale K`` multiplies every rate.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, fields

__all__ = ["FaultKind", "FaultRates", "Fault", "draw_schedule", "HOURS_PER_YEAR"]

HOURS_PER_YEAR = 8760.0


class FaultKind(enum.StrEnum):
    CRASH = "crash"  # the group is gone (Xid, ECC uncorrectable): its streams fail at once
    HANG = "hang"  # alive but answers nothing (NCCL or driver hang)
    SLOW = "slow"  # thermal / power throttling, an NVLink lane down: slower steps
    SDC_TOKENS = "sdc_tokens"  # silent corruption that changes greedy tokens
    SDC_LOGITS = "sdc_logits"  # silent corruption that moves log-probabilities, rarely tokens
    PARTITION = "partition"  # a rack unreachable for a while
    ETCD_OUTAGE = "etcd_outage"  # discovery down: nothing can register
    NATS_RESTART = "nats_restart"  # event and request plane down for a while


@dataclass(frozen=True, slots=True)
class FaultRates:
    """Rates per GPU-year (GPU kinds), per rack-year (partitions) or per day (control
    plane), with how long the transient ones last."""

    gpu_failure: float = 0.03
    sdc: float = 365.0 / 115.0
    sdc_subtle_share: float = 0.5  # of SDC events, the subtle (logits) kind
    hang: float = 0.01
    slow: float = 0.02
    slow_factor: float = 3.0  # a slow group's steps take this many times longer
    slow_minutes: float = 30.0
    partition: float = 0.5  # per rack-year
    partition_minutes: float = 5.0
    etcd_outage_per_day: float = 1.0
    etcd_outage_minutes: float = 2.0
    nats_restart_per_day: float = 1.0
    nats_restart_seconds: float = 20.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"fault rate {f.name} must be a finite number >= 0, got {value}")
        if not 0 <= self.sdc_subtle_share <= 1 or self.slow_factor < 1:
            raise ValueError("sdc_subtle_share must be within [0, 1] and slow_factor >= 1")


@dataclass(frozen=True, slots=True, order=True)
class Fault:
    """One fault: at ``at_s``, on ``worker`` (a rack's first worker for a partition;
    -1 for the control plane), lasting ``duration_s`` (0: until the group is replaced)."""

    at_s: float
    kind: FaultKind
    worker: int = -1
    duration_s: float = 0.0


def _poisson_times(rng: random.Random, rate_per_s: float, horizon_s: float) -> list[float]:
    out: list[float] = []
    if rate_per_s <= 0:
        return out
    t = rng.expovariate(rate_per_s)
    while t < horizon_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def draw_schedule(
    rng: random.Random, rates: FaultRates, *, workers: int, tp: int, hours: float, scale: float = 1.0,
    rack_size: int = 16,
) -> list[Fault]:  # fmt: skip
    """Every fault of a ``hours``-long day of ``workers`` groups of ``tp`` GPUs, in time
    order. Fleet-wide Poisson processes; each GPU fault lands on a uniformly drawn group."""
    horizon = hours * 3600.0
    per_gpu_s = workers * tp * scale / (HOURS_PER_YEAR * 3600.0)
    faults: list[Fault] = []

    def on_workers(kind: FaultKind, rate: float, duration_s: float = 0.0) -> None:
        for t in _poisson_times(rng, rate * per_gpu_s, horizon):
            faults.append(Fault(t, kind, rng.randrange(workers), duration_s))

    on_workers(FaultKind.CRASH, rates.gpu_failure)
    on_workers(FaultKind.HANG, rates.hang)
    on_workers(FaultKind.SLOW, rates.slow, rates.slow_minutes * 60)
    for t in _poisson_times(rng, rates.sdc * per_gpu_s, horizon):
        kind = FaultKind.SDC_LOGITS if rng.random() < rates.sdc_subtle_share else FaultKind.SDC_TOKENS
        faults.append(Fault(t, kind, rng.randrange(workers)))
    racks = max(1, workers // rack_size)
    rack_rate = racks * rates.partition * scale / (HOURS_PER_YEAR * 3600.0)
    for t in _poisson_times(rng, rack_rate, horizon):
        faults.append(Fault(t, FaultKind.PARTITION, rng.randrange(racks) * rack_size, rates.partition_minutes * 60))
    per_day = scale / 86400.0
    for t in _poisson_times(rng, rates.etcd_outage_per_day * per_day, horizon):
        faults.append(Fault(t, FaultKind.ETCD_OUTAGE, -1, rates.etcd_outage_minutes * 60))
    for t in _poisson_times(rng, rates.nats_restart_per_day * per_day, horizon):
        faults.append(Fault(t, FaultKind.NATS_RESTART, -1, rates.nats_restart_seconds))
    faults.sort()
    return faults
