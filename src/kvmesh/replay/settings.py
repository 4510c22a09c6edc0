"""``kvmesh replay``'s settings, each declared once (flag, default, help, check:
:mod:`kvmesh.settings`). Light on purpose: the CLI adds these flags to its parser
without importing the replay machinery (:class:`~kvmesh.replay.runner.ReplayConfig`
adds the mocker workers' options and checks the policy names).

A setting the live system has is not declared again: :func:`live` reuses its
declaration (the planner's cooldown, the disaggregation thresholds, the SLOs), so the
replay's flag, variable, check and default are the live one's. The mocker workers'
flags are :class:`~kvmesh.engines.settings.MockerSettings` itself (the CLI adds them).
Declared here are only the replay's own: what to replay and how (policies, clock,
trace slice, output), the trace's 512-token blocks (live workers: 16), the arms'
router (a KV router, whatever the live default), the planner's window (the live
planner reads the histograms since its last round) and ``--no-pipeline`` (an A/B the
live prefill worker does not offer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.config import ROUTER_MODES, FrontendConfig, PlannerConfig, WorkerConfig
from kvmesh.settings import at_least, check, declared, non_negative, positive, setting, split_commas, within

__all__ = ["CLOCKS", "ReplaySettings", "live"]

CLOCKS = ("virtual", "real")
_ROUTER = "KV router"
_SLICE = "trace slice"
_WORKERS = "mocker workers"
_ARMS = "deployment arms (instead of --policy; the router is --router)"
_OUT = "output"


def live(cls: type, name: str, *, group: str = "") -> Any:
    """The live system's declaration of ``cls.name`` as a field of another settings
    class (:func:`kvmesh.settings.declared`)."""
    return declared(cls, name, group=group)


@dataclass(frozen=True)
class ReplaySettings:
    """What to replay the trace with; ``seed`` drives ``random`` and the KV router's tie-breaking."""

    policies: tuple[str, ...] = setting(
        ("round_robin", "kv"), "comma-separated policies to compare: round_robin, random, kv, kv-approx",
        flag="--policy", parse=split_commas, metavar="LIST",
    )  # fmt: skip
    workers: int = setting(4, "mocker workers", check=at_least(1))
    clock: str = setting("virtual", "virtual (fast, deterministic) or real time", choices=CLOCKS)
    speed: float = setting(1.0, "arrival-time scale: 2 replays the trace twice as fast", check=positive)
    overlap_weight: float = setting(1.0, "weight of prefill blocks in the cost", check=non_negative, group=_ROUTER)
    router_temperature: float = setting(0.0, "0: lowest cost wins; > 0: softmax sampling", check=non_negative, group=_ROUTER)
    seed: int = setting(0, "seed of the random policy and the router's tie-breaking", group=_ROUTER)
    # the trace slice
    limit: int | None = setting(None, "replay at most N requests (the earliest of the window)", group=_SLICE)
    start_ms: float = setting(0.0, "skip requests before this trace timestamp", group=_SLICE)
    duration_ms: float | None = setting(None, "only requests within this long after --start-ms", group=_SLICE)
    # the workers' block size is the trace's (Mooncake hash ids name 512-token blocks), not a live worker's 16
    block_size: int = setting(512, "KV block size in tokens (default 512, the trace's)", check=positive, group=_WORKERS)
    # deployment arms
    arms: str = setting(
        "", "comma-separated: aggregated, disagg:<P>p<D>d (P + D = --workers), planner[:<P>p<D>d]", metavar="LIST",
        group=_ARMS,
    )  # fmt: skip
    router: str = setting("kv", "the router in front of the (decode) workers of every arm", choices=ROUTER_MODES, group=_ARMS)
    slo_ttft_ms: float = live(FrontendConfig, "slo_ttft_ms", group=_ARMS)
    slo_tpot_ms: float = live(FrontendConfig, "slo_tpot_ms", group=_ARMS)  # the arms' mean-ITL SLO
    max_local_prefill_length: int = live(WorkerConfig, "max_local_prefill_length", group=_ARMS)
    max_prefill_queue_size: int = live(WorkerConfig, "max_prefill_queue_size", group=_ARMS)
    max_prefill_queue_tokens: int = live(WorkerConfig, "max_prefill_queue_tokens", group=_ARMS)
    no_pipeline: bool = setting(False, "prefill workers write KV before computing the next job", group=_ARMS)
    planner_interval_s: float = live(PlannerConfig, "planner_interval_s", group=_ARMS)
    planner_window_s: float = setting(10.0, "TTFT/ITL window the planner sees (virtual seconds)", check=positive, group=_ARMS)
    planner_hold_rounds: int = live(PlannerConfig, "planner_hold_rounds", group=_ARMS)
    planner_cooldown_s: float = live(PlannerConfig, "planner_cooldown_s", group=_ARMS)
    capacity_profile: str | None = live(PlannerConfig, "capacity_profile", group=_ARMS)
    planner_headroom: float = live(PlannerConfig, "planner_headroom", group=_ARMS)
    # the planner arm's bounds: --workers its maximum (a fixed arm holds it), this its minimum (default 1)
    min_workers: int | None = live(PlannerConfig, "min_workers", group=_ARMS)
    planner_start_s: float = setting(10.0, "virtual seconds a worker the planner starts takes to serve",
                                     check=non_negative, group=_ARMS)  # fmt: skip
    profile_capacity: str | None = setting(
        None, "measure the workers' capacity profile on the virtual clock (per prompt x output mix of the trace, "
        "at the SLOs) and write it as JSON, instead of replaying", metavar="OUT.json", group=_ARMS,
    )  # fmt: skip
    profile_tolerance: float = setting(
        1.05, "--profile-capacity: bisect each capacity until its bounds are within this ratio (1.05: at most 5 percent low)",
        check=within(1.001, 2.0), group=_ARMS,
    )  # fmt: skip
    # output
    json: str | None = setting(None, "write the per-policy (per-arm) results as a JSON list", metavar="OUT", group=_OUT)
    plot: str | None = setting(
        None, "write a TTFT CDF per policy (with --arms: TTFT and ITL CDFs per arm; needs matplotlib)", metavar="OUT.png",
        group=_OUT,
    )  # fmt: skip
    no_progress: bool = setting(False, "no progress bar", group=_OUT)

    def __post_init__(self) -> None:
        check(self)

