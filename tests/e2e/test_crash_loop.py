"""A worker that cannot start: `kvmesh run` backs off, then gives up with the worker's
own error on one line and exit 1, instead of replacing dying workers forever while
/health stays 503 (issue 18). The engine fails in its factory (the mocker's
``--fault start``), as a misconfigured vLLM does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh.worker.supervisor import Supervisor
from kvmesh.config import WorkerConfig
from tests.helpers import free_port

pytestmark = pytest.mark.processes

FAILED = "RuntimeError: mocker fault 'start': the engine refuses to start"


@pytest.mark.timeout(180)
def test_run_gives_up_on_a_crash_loop_with_the_engines_error():
    port = free_port()
    argv = ["run", "--fault", "start", "--workers", "2", "--max-failed-starts", "3", "--http-port", str(port)]
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli.main", *argv], capture_output=True, text=True, timeout=150)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    # two forked workers fail, then a replacement started with exec (config on stdin)
    assert last == f"kvmesh run: 3 worker starts in a row failed; the last: {FAILED}", r.stderr


async def _noop(*_: object) -> None:
    return None


async def test_backoff_doubles_per_failed_start_is_capped_and_resets_when_a_worker_gets_ready():
    sup = Supervisor(WorkerConfig(), 1, _noop, _noop, backoff_s=0.5, max_backoff_s=3.0, max_failed_starts=6)
    delays = []
    for _ in range(5):
        assert sup._count_start(False, "boom")
        delays.append(sup._delay())
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert sup._count_start(True, "") and sup._delay() == 0.5 and not sup.failed.is_set()
    for _ in range(5):
        sup._count_start(False, "boom")
    assert not sup._count_start(False, "ValueError: no memory") and sup.failed.is_set()
    assert sup.error == "6 worker starts in a row failed; the last: ValueError: no memory"
