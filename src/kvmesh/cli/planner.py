"""``kvmesh planner``: the planner for a distributed fleet (its wiring and fleet:
:mod:`kvmesh.assembly.planner`, :mod:`kvmesh.assembly.discovery_fleet`)."""

from __future__ import annotations

import logging
import sys

from kvmesh.assembly.planner import plan_distributed
from kvmesh.config import PlannerConfig, RuntimeConfig
from kvmesh.planner.profile import load_profile
from kvmesh.worker.child import event_loop_runner

__all__ = ["run_planner"]


def run_planner(settings: PlannerConfig, runtime_cfg: RuntimeConfig, log_level: str = "warning") -> int:
    """``kvmesh planner``: plan a distributed fleet until SIGTERM/SIGINT."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if settings.capacity_profile:  # a bad file is a start error, said in one line
        try:
            load_profile(settings.capacity_profile)
        except ValueError as exc:
            print(f"kvmesh planner: {exc}", file=sys.stderr)
            return 2
    return event_loop_runner()(plan_distributed(settings, runtime_cfg))
