"""The README's test command on a machine whose Python carries pytest plugins we do not use.

A fresh machine's system Python ships pytest-benchmark, whose start-up warning (it turns
itself off under xdist) our ``filterwarnings = error`` made an INTERNALERROR before a
single test ran. ``addopts`` therefore disables plugin autoloading and names the plugins
the suite uses. This test installs a hostile plugin the way a package would (an entry
point in a ``.dist-info`` on ``sys.path``) and runs a collection with the project's own
configuration, as ``python -m pytest`` does: it must pass, and neither that plugin nor
pytest-benchmark may load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

_PLUGIN = '''
import warnings

def pytest_configure(config):
    warnings.warn(UserWarning("hostile plugin loaded: a start-up warning"))
'''


def _install_hostile_plugin(site: Path) -> None:
    (site / "hostile_plugin.py").write_text(_PLUGIN)
    info = site / "hostile_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nhostile = hostile_plugin\n")
    (info / "RECORD").write_text("")


def test_unknown_plugins_cannot_break_the_run(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install_hostile_plugin(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    env.pop("PYTEST_XDIST_WORKER", None)  # a fresh top-level run, not one of this run's workers
    # the project's configuration as the README runs it (-n 2 included): only the path is ours
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/unit/test_frame_writer.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "hostile plugin loaded" not in out
    assert "tests collected" in out or "test collected" in out, out[-2000:]


def test_the_hostile_plugin_is_found_when_autoload_is_on(tmp_path: Path) -> None:
    """The attack of the test above is real: with autoloading on, pytest does load it."""
    site = tmp_path / "site"
    site.mkdir()
    _install_hostile_plugin(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("PYTEST_ADDOPTS", None)
    code = (
        "from importlib.metadata import entry_points;"
        "print(sorted(e.name for e in entry_points(group='pytest11')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "'hostile'" in proc.stdout, proc.stdout + proc.stderr
