"""One replay run: the same trace slice against a fresh fleet for each policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord
from kvmesh.replay.policies import POLICIES, make_policy
from kvmesh.replay.report import PolicyResult, summarize
from kvmesh.replay.settings import CLOCKS, ReplaySettings
from kvmesh.replay.sim import fleet_options, simulate
from kvmesh.replay.trace import TokenSynth, TraceRequest, arrivals

__all__ = ["CLOCKS", "ReplayConfig", "fit_context", "replay", "replay_policy"]

def _default_mocker() -> MockerOptions:
    return MockerOptions(block_size=512)


@dataclass(frozen=True)
class ReplayConfig(ReplaySettings):
    """What ``kvmesh replay`` runs: its settings, and ``mocker``, every worker's options
    (its ``worker_id`` is replaced by 0 .. n-1 and ``context_length`` raised to fit the
    trace)."""

    mocker: MockerOptions = field(default_factory=_default_mocker)

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("--policy needs at least one policy")
        for p in self.policies:
            if p not in POLICIES:
                raise ValueError(f"unknown policy {p!r} (choose from {', '.join(POLICIES)})")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policy names a policy twice: {','.join(self.policies)}")
        super().__post_init__()


def fit_context(options: MockerOptions, trace: Sequence[TraceRequest]) -> MockerOptions:
    need = max(r.input_length + r.output_length for r in trace) + 1
    return options if options.context_length >= need else replace(options, context_length=need)


def replay_policy(
    policy_name: str,
    trace: Sequence[TraceRequest],
    config: ReplayConfig,
    on_done: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Replay ``trace`` under one policy on a fresh fleet; returns the records."""
    options = fit_context(config.mocker, trace)
    policy = make_policy(
        policy_name,
        config.workers,
        block_size=options.block_size,
        overlap_weight=config.overlap_weight,
        temperature=config.router_temperature,
        seed=config.seed,
    )
    stream = arrivals(trace, TokenSynth(options.vocab_size), config.speed)
    fleet = fleet_options(options, config.workers)
    if config.clock == "real":
        from kvmesh.replay.realtime import simulate_real

        return asyncio.run(simulate_real(stream, policy, fleet, on_done))
    return simulate(stream, policy, fleet, on_done)


def replay(trace: Sequence[TraceRequest], config: ReplayConfig) -> list[PolicyResult]:
    """Every policy of ``config`` in turn, summarized."""
    return [summarize(name, replay_policy(name, trace, config)) for name in config.policies]
