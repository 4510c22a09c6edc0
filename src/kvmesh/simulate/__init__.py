"""``kvmesh simulate``: a day of an internet-scale fleet on the virtual clock (issue 34).

:mod:`.faults` draws what goes wrong (the seed's rates); :mod:`.fleet` runs the day with
the live policy objects (health, migration, router selection, degradation, planner);
:mod:`.report` turns it into the table and the JSON; :mod:`.settings` declares the flags.
Names are re-exported on first use (the CLI parser imports only the settings)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.simulate.fleet import Outcome, SimConfig
    from kvmesh.simulate.settings import SimulateSettings

__all__ = ["config_from", "simulate", "summary", "render"]


def config_from(s: SimulateSettings) -> SimConfig:
    from kvmesh.simulate.faults import FaultRates
    from kvmesh.simulate.fleet import SimConfig

    rates = FaultRates(gpu_failure=s.gpu_failure_rate, sdc=s.sdc_rate, hang=s.hang_rate, slow=s.slow_rate,
                       partition=s.partition_rate, etcd_outage_per_day=s.etcd_outages_per_day,
                       nats_restart_per_day=s.nats_restarts_per_day)  # fmt: skip
    return SimConfig(
        workers=s.workers, tp=s.tp, hours=s.hours, seed=s.seed, failure_scale=s.failure_scale, rates=rates,
        peak_utilisation=s.peak_utilisation, trough_ratio=s.trough_ratio, prompt_tokens=s.prompt_tokens,
        output_tokens=s.output_tokens, hot_spares=s.hot_spares, canary_interval_s=s.canary_interval_s,
        canary_timeout_s=s.canary_timeout_s, rack_size=s.rack_size, slo_ttft_ms=s.slo_ttft_ms, slo_tpot_ms=s.slo_tpot_ms,
        request_plane=s.request_plane,
    )  # fmt: skip


def simulate(config: SimConfig) -> Outcome:
    from kvmesh.simulate.fleet import FleetSim

    return FleetSim(config).run()


def __getattr__(name: str) -> Any:
    if name in ("summary", "render"):
        from kvmesh.simulate import report

        return getattr(report, name)
    raise AttributeError(name)
