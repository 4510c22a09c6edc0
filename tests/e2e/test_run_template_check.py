"""``kvmesh run`` checks the models' chat templates in a forked process (issue 36: jinja2
off the frontend's way to its first completion): a template that does not compile
still stops the start with one line and exit 1, and no serving line; a good one is
compiled by the frontend's first chat request."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.preprocess.model import bundled_model_path


@pytest.mark.timeout(90)
def test_broken_chat_template_stops_kvmesh_run(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(bundled_model_path(), folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}", encoding="utf-8")
    cmd = [sys.executable, "-m", "kvmesh.cli.main", "run", "--model-path", str(folder), "--http-host", "127.0.0.1",
           "--http-port", "0", "--speedup", "1e9"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"kvmesh run: the chat template of {folder} does not compile"), lines
    assert "serving" not in out.stdout
