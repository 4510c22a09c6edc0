"""``kvmesh replay TRACE --arms ...``: deployment arms (aggregated, disaggregated
splits, the planner) on the virtual clock, judged by goodput under SLOs
(:mod:`kvmesh.replay.arms`, :mod:`kvmesh.replay.goodput`).

Exit status as ``kvmesh replay``: 0 done, 1 the trace or an output file could not be
read/written, 2 a bad option value.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from kvmesh.cli.replay_output import PROG, fail, read_trace, write_json

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvmesh.replay.arms import Arm, DisaggModel, PlannerSettings
    from kvmesh.replay.goodput import ArmResult, Slo
    from kvmesh.replay.runner import ReplayConfig
    from kvmesh.replay.trace import TraceRequest

    _Setup = tuple[ReplayConfig, DisaggModel, PlannerSettings, Slo]

__all__ = ["run_arms"]


def run_arms(ns: argparse.Namespace, base: ReplayConfig) -> int:
    """``base``: the replay's config (workers, speed, mocker options) from ``kvmesh replay``'s flags."""
    from kvmesh.replay.arms import parse_arms

    try:
        setup = _setup(ns, base)
        arms = parse_arms(ns.arms, base.workers)
    except ValueError as exc:
        return fail(str(exc), 2)
    trace = read_trace(ns)
    if isinstance(trace, int):
        return trace
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0 / base.speed
    print(
        f"replaying {len(trace)} requests ({span_s:.1f} s of arrivals at speed {base.speed:g}) on {base.workers} mocker "
        f"workers, virtual clock, router {ns.router}, arms {', '.join(a.name for a in arms)}"
    )
    results = []
    for arm in arms:
        started = time.perf_counter()
        try:
            result = _one(arm, trace, ns, setup)
        except ValueError as exc:
            return fail(str(exc), 2)
        results.append(result)
        print(f"  {arm.name}: replayed in {time.perf_counter() - started:.1f} s wall")
        for line in result.decisions:
            print(f"    planner: {line}")
    return _output(ns, results, setup[3], f"{len(trace)} requests, {base.workers} workers")


def _setup(ns: argparse.Namespace, config: ReplayConfig) -> _Setup:
    from kvmesh.planner.core import PlannerConfig
    from kvmesh.protocol import DisaggThresholds
    from kvmesh.replay.arms import DisaggModel, PlannerSettings
    from kvmesh.replay.goodput import Slo

    mocker = replace(config.mocker, kv_bytes_per_token=ns.kv_bytes_per_token, kv_bandwidth=ns.kv_bandwidth)
    thresholds = DisaggThresholds(ns.max_local_prefill_length, ns.max_prefill_queue_size, ns.max_prefill_queue_tokens)
    model = DisaggModel(thresholds, pipeline=not ns.no_pipeline)
    slo = Slo(ns.slo_ttft_ms, ns.slo_itl_ms)
    planner_cfg = PlannerConfig(
        slo_ttft_ms=slo.ttft_ms, slo_itl_ms=slo.itl_ms, hold_rounds=ns.planner_hold_rounds, cooldown_s=ns.planner_cooldown_s
    )
    planner = PlannerSettings(ns.planner_interval_s, ns.planner_window_s, planner_cfg)
    return replace(config, mocker=mocker), model, planner, slo


def _one(arm: Arm, trace: Sequence[TraceRequest], ns: argparse.Namespace, setup: _Setup) -> ArmResult:
    from kvmesh.replay.arms import default_router, run_arm
    from kvmesh.replay.goodput import arrival_window_s, summarize_arm
    from kvmesh.replay.runner import fit_context
    from kvmesh.replay.trace import TokenSynth, arrivals

    config, model, planner, slo = setup
    options = fit_context(config.mocker, trace)
    stream = arrivals(trace, TokenSynth(options.vocab_size), config.speed)
    run = run_arm(arm, stream, options, config.workers, default_router(ns.router, options, config.seed), model, planner)
    window = arrival_window_s([r.arrival_ms for r in run.records])
    return summarize_arm(arm.name, run.records, slo, window, run.counters, run.decisions, run.resources)


def _output(ns: argparse.Namespace, results: Sequence[ArmResult], slo: Slo, title: str) -> int:
    from kvmesh.replay.goodput import format_arms
    from kvmesh.replay.plot import MATPLOTLIB_HINT, have_matplotlib, plot_arms

    print(format_arms(results, slo))
    status = write_json(ns.json, results)
    if status is not None:
        return status
    if ns.plot is not None:
        if not have_matplotlib():
            print(f"{PROG}: {MATPLOTLIB_HINT} (skipping the plot)", file=sys.stderr)
            return 0
        try:
            plot_arms(results, ns.plot, slo, title=title)
        except OSError as exc:
            return fail(f"cannot write {ns.plot}: {exc.strerror or exc}", 1)
        print(f"TTFT and ITL CDFs per arm written to {ns.plot}")
    return 0
