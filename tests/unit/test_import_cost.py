"""Heavy modules are paid for on first use (issue 36): the frontend does not import the
grammar engine until a request carries an output constraint, and building the CLI's
parser (every ``kvmesh`` command, the ``kvmesh run`` process before it forks) does not
import the replay's mocker."""

from __future__ import annotations

import subprocess
import sys

import pytest

_HEAVY = ("numpy", "llguidance", "kvmesh.preprocess.guided", "kvmesh.engines.mocker")


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {_HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.timeout(150)
def test_frontend_app_imports_no_grammar_engine() -> None:
    assert _loaded_after("import kvmesh.frontend.app") == []


@pytest.mark.timeout(150)
def test_cli_parser_imports_no_engine() -> None:
    assert _loaded_after("from kvmesh.cli.main import build_parser\nbuild_parser()") == []


@pytest.mark.timeout(150)
def test_replay_names_still_import_from_the_package() -> None:
    assert "kvmesh.engines.mocker" in _loaded_after("from kvmesh.replay import replay, POLICIES, TraceError")
