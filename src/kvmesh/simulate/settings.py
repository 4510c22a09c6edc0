"""``kvmesh simulate``'s settings, each declared once (:mod:`kvmesh.settings`). Light:
the CLI adds these flags without importing the simulation. Settings the live system
has (the canary interval and timeout, the SLOs) reuse its declarations."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config import FrontendConfig
from kvmesh.settings import at_least, declared, non_negative, positive, setting

__all__ = ["SimulateSettings"]

_FLEET = "the fleet"
_LOAD = "the load"
_FAULTS = "fault rates (defaults: the fault-tolerance seed's where it gives them)"
_OUT = "output"


@dataclass(frozen=True)
class SimulateSettings:
    workers: int = setting(10_000, "serving groups (tensor-parallel instances)", check=at_least(1), group=_FLEET)
    tp: int = setting(8, "GPUs per group: one GPU failure takes its group down", check=at_least(1), group=_FLEET)
    hours: float = setting(24.0, "simulated hours", check=positive, group=_FLEET)
    seed: int = setting(0, "the same seed and inputs give the same report", group=_FLEET)
    hot_spares: int | None = setting(None, "hot spares the planner keeps (default 0.5 %% of --workers, at least 2)", group=_FLEET)
    rack_size: int = setting(16, "groups per rack (a partition cuts one rack)", check=at_least(1), group=_FLEET)
    request_plane: str = setting("tcp", "the request plane (nats: requests wait out a NATS restart)", choices=("tcp", "nats"), group=_FLEET)
    canary_interval_s: float = declared(FrontendConfig, "canary_interval_s", group=_FLEET)
    canary_timeout_s: float = declared(FrontendConfig, "canary_timeout_s", group=_FLEET)
    slo_ttft_ms: float = declared(FrontendConfig, "slo_ttft_ms", group=_LOAD)
    slo_tpot_ms: float = declared(FrontendConfig, "slo_tpot_ms", group=_LOAD)
    peak_utilisation: float = setting(0.6, "peak demand over the fleet's capacity", check=positive, group=_LOAD)
    trough_ratio: float = setting(10.0, "peak over trough of the daily load curve", check=at_least(1), group=_LOAD)
    prompt_tokens: int = setting(2048, "prompt tokens per request", check=at_least(1), group=_LOAD)
    output_tokens: int = setting(256, "output tokens per request", check=at_least(1), group=_LOAD)
    failure_scale: float = setting(1.0, "multiplies every fault rate", check=non_negative, group=_FAULTS)
    gpu_failure_rate: float = setting(0.03, "GPU failures per GPU-year (whole group down)", check=non_negative, group=_FAULTS)
    sdc_rate: float = setting(365 / 115, "silent data corruptions per GPU-year (one per 115 days)", check=non_negative, group=_FAULTS)
    hang_rate: float = setting(0.01, "hangs per GPU-year", check=non_negative, group=_FAULTS)
    slow_rate: float = setting(0.02, "slow-downs (thermal, NVLink) per GPU-year, 30 min at 1/3 speed", check=non_negative, group=_FAULTS)
    partition_rate: float = setting(0.5, "rack partitions per rack-year, 5 min each", check=non_negative, group=_FAULTS)
    etcd_outages_per_day: float = setting(1.0, "etcd outages per day, 2 min each", check=non_negative, group=_FAULTS)
    nats_restarts_per_day: float = setting(1.0, "NATS restarts per day, 20 s each", check=non_negative, group=_FAULTS)
    json: str | None = setting(None, "write the report's figures as JSON (lost requests under 'lost')", metavar="OUT", group=_OUT)
    plot: str | None = setting(None, "plot the day (SLO attainment, capacity lost by hour) to a PNG (needs matplotlib)", metavar="OUT.png", group=_OUT)
