"""``kvmesh replay TRACE --arms ...``: deployment arms (aggregated, disaggregated
splits, the planner) on the virtual clock, judged by goodput under SLOs
(:mod:`kvmesh.replay.arms`, :mod:`kvmesh.replay.goodput`).

Exit status as ``kvmesh replay``: 0 done, 1 the trace or an output file could not be
read/written, 2 a bad option value.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from kvmesh.cli.replay_output import PROG, fail, read_trace, write_json

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvmesh.replay.arms import Arm, DisaggModel, PlannerSettings
    from kvmesh.replay.goodput import ArmResult, Slo
    from kvmesh.replay.runner import ReplayConfig
    from kvmesh.replay.trace import TraceRequest

    _Setup = tuple[ReplayConfig, DisaggModel, PlannerSettings, Slo]

__all__ = ["run_arms", "run_profile"]


def run_arms(trace_path: str, base: ReplayConfig) -> int:
    """``base``: the replay's config (arms, workers, speed, SLOs, planner, mocker options)
    from ``kvmesh replay``'s flags."""
    from kvmesh.replay.arms import parse_arms
    from kvmesh.replay.tier_arms import is_tier_arms

    if is_tier_arms(base.arms):
        return _run_tier_arms(trace_path, base)
    try:
        setup = _setup(base)
        arms = parse_arms(base.arms, base.workers)
    except ValueError as exc:
        return fail(str(exc), 2)
    trace = read_trace(trace_path, base)
    if isinstance(trace, int):
        return trace
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0 / base.speed
    print(
        f"replaying {len(trace)} requests ({span_s:.1f} s of arrivals at speed {base.speed:g}) on {base.workers} mocker "
        f"workers, virtual clock, router {base.router}, arms {', '.join(a.name for a in arms)}"
    )
    results = []
    for arm in arms:
        started = time.perf_counter()
        try:
            result = _one(arm, trace, setup)
        except ValueError as exc:
            return fail(str(exc), 2)
        results.append(result)
        print(f"  {arm.name}: replayed in {time.perf_counter() - started:.1f} s wall")
        for line in result.decisions:
            print(f"    planner: {line}")
    return _output(base, results, setup[3], f"{len(trace)} requests, {base.workers} workers")


def _run_tier_arms(trace_path: str, base: ReplayConfig) -> int:
    """``--arms g1,g1+g2,g1+g2+g3``: KV tiers (:mod:`kvmesh.replay.tier_arms`)."""
    from kvmesh.replay.goodput import Slo
    from kvmesh.replay.runner import fit_context
    from kvmesh.replay.tier_arms import format_tier_arms, parse_tier_arms, run_tier_arm, tier_router
    from kvmesh.replay.trace import TokenSynth, arrivals

    try:
        arms, slo = parse_tier_arms(base.arms, base.mocker), Slo(base.slo_ttft_ms, base.slo_tpot_ms)
    except ValueError as exc:
        return fail(str(exc), 2)
    trace = read_trace(trace_path, base)
    if isinstance(trace, int):
        return trace
    options = fit_context(base.mocker, trace)
    print(f"replaying {len(trace)} requests on {base.workers} mocker workers of {options.num_blocks} blocks, virtual clock")
    results = []
    for arm in arms:
        stream = arrivals(trace, TokenSynth(options.vocab_size), base.speed)
        router = tier_router(base.router, arm.options(options), base.seed)
        try:
            results.append(run_tier_arm(arm, stream, options, base.workers, router, slo))
        except ValueError as exc:  # a peer arm under a router that does not decide by KV
            return fail(str(exc), 2)
    print(format_tier_arms(results))
    status = write_json(base.json, results)
    return 0 if status is None else status


def run_profile(trace_path: str, base: ReplayConfig) -> int:
    """``--profile-capacity OUT.json``: measure the workers' capacity profile for the
    trace's mixes (:mod:`kvmesh.replay.capacity`) and write it."""
    from kvmesh.planner.profile import dump_profile
    from kvmesh.replay.capacity import measure_profile, trace_mixes, trace_reuse

    assert base.profile_capacity is not None
    try:
        _, model, _, slo = _setup(base)
    except ValueError as exc:
        return fail(str(exc), 2)
    trace = read_trace(trace_path, base)
    if isinstance(trace, int):
        return trace
    inputs, outputs = trace_mixes(trace)
    reuse = trace_reuse(trace)
    print(f"measuring one worker's capacity at the SLOs for prompts {inputs} x outputs {outputs} tokens (virtual clock;"
          f" the trace's prefix sharing: {reuse.describe()})")  # fmt: skip
    try:
        profile = measure_profile(inputs, outputs, base.mocker, slo, model, router=base.router, seed=base.seed,
                                  progress=print, tolerance=base.profile_tolerance, reuse=reuse)  # fmt: skip
    except ValueError as exc:
        return fail(str(exc), 2)
    if any(p.infeasible for p in profile.points):
        print("some mixes meet the SLOs at no rate (0 req/s in the profile, the reason in `infeasible`): the planner"
              " sizes them with the role's least capacity; loosen --slo-ttft-ms/--slo-tpot-ms to serve them")  # fmt: skip
    try:
        dump_profile(profile, base.profile_capacity)
    except OSError as exc:
        return fail(f"cannot write {base.profile_capacity}: {exc.strerror or exc}", 1)
    print(f"capacity profile written to {base.profile_capacity}")
    return 0


def _setup(c: ReplayConfig) -> _Setup:
    """The arms' models from the config (its KV transfer: the mocker's --kv-bytes-per-token
    and --kv-bandwidth; the planner's SLOs: the goodput's, as the live planner's are the frontend's)."""
    from kvmesh.planner.core import PlannerConfig
    from kvmesh.planner.profile import load_profile
    from kvmesh.protocol import DisaggThresholds
    from kvmesh.replay.arms import DisaggModel, PlannerSettings
    from kvmesh.replay.goodput import Slo

    thresholds = DisaggThresholds(c.max_local_prefill_length, c.max_prefill_queue_size, c.max_prefill_queue_tokens)
    model = DisaggModel(thresholds, pipeline=not c.no_pipeline)
    slo = Slo(c.slo_ttft_ms, c.slo_tpot_ms)
    profile = load_profile(c.capacity_profile) if c.capacity_profile else None
    planner_cfg = PlannerConfig(
        slo_ttft_ms=slo.ttft_ms, slo_itl_ms=slo.itl_ms, hold_rounds=c.planner_hold_rounds, cooldown_s=c.planner_cooldown_s,
        profile=profile, headroom=c.planner_headroom,
    )
    lowest = c.min_workers if c.min_workers is not None else 1
    if lowest > c.workers:
        raise ValueError(f"--min-workers ({lowest}) must be at most --workers ({c.workers}, the planner's maximum)")
    planner = PlannerSettings(c.planner_interval_s, c.planner_window_s, planner_cfg, lowest, c.planner_start_s)
    return c, model, planner, slo


def _one(arm: Arm, trace: Sequence[TraceRequest], setup: _Setup) -> ArmResult:
    from kvmesh.replay.arms import default_router, run_arm
    from kvmesh.replay.goodput import arrival_window_s, summarize_arm
    from kvmesh.replay.runner import fit_context
    from kvmesh.replay.trace import TokenSynth, arrivals

    config, model, planner, slo = setup
    options = fit_context(config.mocker, trace)
    stream = arrivals(trace, TokenSynth(options.vocab_size), config.speed)
    run = run_arm(arm, stream, options, config.workers, default_router(config.router, options, config.seed), model, planner)
    window = arrival_window_s([r.arrival_ms for r in run.records])
    return summarize_arm(
        arm.name, run.records, slo, window, run.counters, run.decisions, run.resources, run.worker_seconds, run.timeline
    )


def _output(c: ReplayConfig, results: Sequence[ArmResult], slo: Slo, title: str) -> int:
    from kvmesh.replay.goodput import format_arms
    from kvmesh.replay.plot import MATPLOTLIB_HINT, have_matplotlib, plot_arms

    print(format_arms(results, slo))
    status = write_json(c.json, results)
    if status is not None:
        return status
    if c.plot is not None:
        if not have_matplotlib():
            print(f"{PROG}: {MATPLOTLIB_HINT} (skipping the plot)", file=sys.stderr)
            return 0
        try:
            plot_arms(results, c.plot, slo, title=title)
        except OSError as exc:
            return fail(f"cannot write {c.plot}: {exc.strerror or exc}", 1)
        print(f"TTFT and ITL CDFs per arm written to {c.plot}")
    return 0
