"""``kvmesh simulate``: a day of a large fleet on the virtual clock, decided by
kvmesh's live policy objects (:mod:`kvmesh.simulate`); prints the report.

Exit status: 0 done, 1 an output file could not be written, 2 a bad option value."""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["add_simulate_args", "run_simulate"]


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    from kvmesh.settings import add_flags
    from kvmesh.simulate.settings import SimulateSettings

    add_flags(p, SimulateSettings)


def run_simulate(ns: argparse.Namespace) -> int:
    from kvmesh.settings import resolve
    from kvmesh.simulate import config_from, render, simulate, summary
    from kvmesh.simulate.settings import SimulateSettings

    try:
        settings = resolve(SimulateSettings, ns)
        config = config_from(settings)
    except ValueError as exc:
        print(f"kvmesh simulate: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    outcome = simulate(config)
    report = summary(config, outcome, time.perf_counter() - start)
    print(render(report))
    try:
        if settings.json:
            with open(settings.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        if settings.plot:
            from kvmesh.simulate.plot import plot_day

            plot_day(report, settings.plot)
    except (OSError, ImportError) as exc:
        print(f"kvmesh simulate: cannot write the output: {exc}", file=sys.stderr)
        return 1
    return 0
