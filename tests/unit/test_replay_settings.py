"""`kvmesh replay`'s flags are declared once: those the live system has are its
declarations (same help, same default, shown the same in --help), so a replay runs
with the live defaults unless told otherwise; the replay's own are declared in
replay/settings.py."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvmesh.cli.main import build_parser
from kvmesh.cli.replay import _config
from kvmesh.cli.replay_arms import _setup
from kvmesh.config import FrontendConfig, PlannerConfig, WorkerConfig
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.settings import MockerSettings
from kvmesh.replay.settings import ReplaySettings, live
from kvmesh.settings import settings_of

# flag -> (the live class that declares it, its field)
SHARED = {
    "--slo-ttft-ms": (FrontendConfig, "slo_ttft_ms"),
    "--slo-tpot-ms": (FrontendConfig, "slo_tpot_ms"),
    "--max-local-prefill-length": (WorkerConfig, "max_local_prefill_length"),
    "--max-prefill-queue-size": (WorkerConfig, "max_prefill_queue_size"),
    "--max-prefill-queue-tokens": (WorkerConfig, "max_prefill_queue_tokens"),
    "--planner-interval": (PlannerConfig, "planner_interval_s"),
    "--planner-hold-rounds": (PlannerConfig, "planner_hold_rounds"),
    "--planner-cooldown": (PlannerConfig, "planner_cooldown_s"),
    "--kv-bytes-per-token": (MockerSettings, "kv_bytes_per_token"),
    "--kv-bandwidth": (MockerSettings, "kv_bandwidth"),
    "--speedup": (MockerSettings, "speedup"),
    "--num-blocks": (MockerSettings, "num_blocks"),
    "--max-num-seqs": (MockerSettings, "max_num_seqs"),
    "--max-num-batched-tokens": (MockerSettings, "max_num_batched_tokens"),
    "--eos-probability": (MockerSettings, "eos_probability"),
    "--long-prefill-token-threshold": (MockerSettings, "long_prefill_token_threshold"),
}


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


def _default(cls: type, name: str) -> object:
    return next(f.default for f, _ in settings_of(cls) if f.name == name)


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_a_shared_flag_shows_the_live_default_in_replay_help(flag: str) -> None:
    cls, name = SHARED[flag]
    replay, run = _actions(_sub("replay")), _actions(_sub("run"))
    assert f"(default {_default(cls, name)}" in replay[flag].help
    # the same declaration: kvmesh run shows the very same help for it
    assert replay[flag].help == run[flag].help


def test_replay_help_prints_the_live_defaults() -> None:
    text = _sub("replay").format_help()
    for flag, (cls, name) in SHARED.items():
        said = " ".join(text.split(f"\n  {flag} ", 1)[1].split("\n  --", 1)[0].split())  # its help, unwrapped
        assert f"default {_default(cls, name)}" in said, f"{flag}: {said!r}"


def test_a_replay_without_flags_runs_with_the_live_defaults() -> None:
    config = _config(_sub("replay").parse_args(["trace.jsonl"]))
    for flag, (cls, name) in SHARED.items():
        option = {"eos_probability": "eos_rate"}.get(name, name)  # MockerOptions' name for it
        have = getattr(config.mocker, option) if cls is MockerSettings else getattr(config, name)
        assert have == _default(cls, name), flag
    assert (config.planner_cooldown_s, config.mocker.kv_bytes_per_token) == (30.0, 4096)  # were 10 and 65,536
    assert config.mocker.kv_bytes_per_token == MockerOptions().kv_bytes_per_token
    _, model, planner, slo = _setup(config)
    assert planner.config.cooldown_s == PlannerConfig().planner_cooldown_s and planner.interval_s == 2.0
    assert model.thresholds.max_local_prefill_length == WorkerConfig().max_local_prefill_length
    assert (slo.ttft_ms, slo.itl_ms) == (FrontendConfig.slo_ttft_ms, FrontendConfig.slo_tpot_ms)


def test_flags_still_override_and_the_replay_keeps_its_own_block_size() -> None:
    ns = _sub("replay").parse_args(["t", "--planner-cooldown", "10", "--kv-bytes-per-token", "65536", "--block-size", "64"])
    config = _config(ns)
    assert (config.planner_cooldown_s, config.mocker.kv_bytes_per_token, config.mocker.block_size) == (10.0, 65536, 64)
    assert _config(_sub("replay").parse_args(["t"])).mocker.block_size == 512  # the trace's blocks, not a worker's 16


def test_live_reuses_a_declaration_and_refuses_a_name_that_is_not_one() -> None:
    replay = {f.name: meta for f, meta in settings_of(ReplaySettings)}
    planner = {f.name: meta for f, meta in settings_of(PlannerConfig)}
    assert dataclasses.replace(replay["planner_cooldown_s"], group="") == dataclasses.replace(
        planner["planner_cooldown_s"], group=""
    )
    with pytest.raises(KeyError, match="declares no setting 'nope'"):
        live(PlannerConfig, "nope")
