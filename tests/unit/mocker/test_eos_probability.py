"""``--eos-probability``: the CLI (run, worker, replay) to the mocker's options. By
default the mocker generates the requested length; a configured probability is what
ends a stream early."""

from __future__ import annotations

import pickle

import pytest

from kvmesh.cli.main import _worker_config, build_parser, main
from kvmesh.cli.replay import _config as replay_config
from kvmesh.engines.settings import MockerSettings
from kvmesh.worker.main import build_engine


def _worker_options(*argv: str):  # type: ignore[no-untyped-def]
    ns = build_parser().parse_args(["run", *argv])
    cfg = _worker_config(ns)
    engine, _ = build_engine(cfg)
    return cfg, engine.options


def test_default_is_zero_everywhere() -> None:
    cfg, options = _worker_options()
    assert isinstance(cfg.engine_options, MockerSettings)
    assert cfg.engine_options.eos_probability == 0.0 and options.eos_rate == 0.0
    ns = build_parser().parse_args(["replay", "trace.jsonl"])
    assert replay_config(ns).mocker.eos_rate == 0.0


def test_a_probability_flows_from_run_to_the_worker_process_and_engine() -> None:
    cfg, options = _worker_options("--eos-probability", "0.25")
    assert options.eos_rate == 0.25
    # `kvmesh run` hands its workers this object (forked, or pickled on a replacement's stdin)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    ns = build_parser().parse_args(["worker", "--static", "--eos-probability", "0.25"])
    assert build_engine(_worker_config(ns))[0].options.eos_rate == 0.25
    ns = build_parser().parse_args(["replay", "trace.jsonl", "--eos-probability", "0.5"])
    assert replay_config(ns).mocker.eos_rate == 0.5


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_out_of_range_is_a_clear_error(bad: float, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--eos-probability"):
        MockerSettings(eos_probability=bad)
    assert main(["run", "--eos-probability", str(bad)]) == 2
    assert "--eos-probability (or KVMESH_MOCKER_EOS_PROBABILITY) must be within [0, 1]" in capsys.readouterr().err
