"""`kvmesh run --config`'s `[[models]]` tables (kvmesh.cli.models): each model's worker
settings from its table over the file's top level, flags over both; `workers` per model
(default: --workers); names distinct; bad tables refused with the table and key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.cli.main import RUN_CLASSES, _file, _model_fleets, build_parser
from kvmesh.engines.settings import MockerSettings

TOML = """\
speedup = 50.0
block-size = 32

[[models]]
name = "alpha"
workers = 3
speedup = 7.0

[[models]]
name = "beta"
engine = "mocker"
"""


def _fleets(tmp_path: Path, text: str, *flags: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "run.toml"
    path.write_text(text)
    ns = build_parser().parse_args(["run", "--config", str(path), *flags])
    return _model_fleets(ns, _file(ns, *RUN_CLASSES), 2)


def test_a_table_over_the_top_level_and_flags_over_both(tmp_path: Path) -> None:
    alpha, beta = _fleets(tmp_path, TOML)
    assert (alpha.worker.served_model_name, alpha.workers, alpha.worker.block_size) == ("alpha", 3, 32)
    assert (beta.worker.served_model_name, beta.workers, beta.worker.block_size) == ("beta", 2, 32)
    assert isinstance(alpha.worker.engine_options, MockerSettings) and isinstance(beta.worker.engine_options, MockerSettings)
    assert (alpha.worker.engine_options.speedup, beta.worker.engine_options.speedup) == (7.0, 50.0)
    alpha, beta = _fleets(tmp_path, TOML, "--speedup", "9")  # a flag applies to every model
    assert alpha.worker.engine_options.speedup == beta.worker.engine_options.speedup == 9.0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "text, message",
    [
        ("models = [1, 2]\n", "array of tables"),
        ('[[models]]\nname = "a"\nspeed = 3\n', "#1: no such model setting: speed"),
        ('[[models]]\nname = "a"\n[[models]]\nname = "a"\n', "two models are named 'a'"),
        ('[[models]]\nname = "a"\n[[models]]\nworkers = 0\n', "#2: workers must be an integer >= 1"),
        ('[[models]]\nname = 5\n', "name must be a string"),
        ('[[models]]\nmode = "prefill"\n', "aggregated"),
        ('[[models]]\nblock-size = 0\n', "--block-size"),
    ],
)
def test_bad_tables_say_which_and_what(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _fleets(tmp_path, text)
