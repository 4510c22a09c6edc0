"""A worker that cannot start: `kvmesh run` backs off, then gives up with the worker's
own error on one line and exit 1, instead of replacing dying workers forever while
/health stays 503 (issue 18). The engine fails in its factory (the mocker's
``--fault start``), as a misconfigured vLLM does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvmesh.worker.supervisor import Supervisor
from kvmesh.config import WorkerConfig
from tests.helpers import free_port, kvmesh_run

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


async def test_backoff_doubles_per_failed_start_is_capped_and_resets_when_a_worker_gets_ready():
    sup = Supervisor(WorkerConfig(), 1, backoff_s=0.5, max_backoff_s=3.0, max_failed_starts=6)
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


def test_a_config_file_reaches_the_frontend_and_the_forked_and_replacement_workers(tmp_path):
    """`--config`: an edge limit (frontend) and an engine setting (workers: the forked
    ones and a replacement started with exec, which reads its config object on stdin)."""
    path = tmp_path / "kvmesh.toml"
    path.write_text("[edge]\nmax-headers = 12\n[mocker]\neos-probability = 1.0\n")
    body = {"model": "kvmesh-tiny", "prompt": "hello", "max_tokens": 40}

    def completion_tokens(url: str) -> int | None:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        return int(r.json()["usage"]["completion_tokens"]) if r.status_code == 200 else None

    with kvmesh_run(tmp_path, "--config", str(path), workers=1) as server:
        headers = {f"x-h{i}": "1" for i in range(20)}
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 431
        first = completion_tokens(server.url)
        assert first is not None and first < 40  # EOS at every position after the first
        (pid,) = server.worker_pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while server.worker_pids() in ([], [pid]):  # the replacement: exec'd, config on stdin
            assert time.monotonic() < deadline, "no replacement worker"
            time.sleep(0.05)
        again = None
        while again is None:
            assert time.monotonic() < deadline, "the replacement never served"
            again = completion_tokens(server.url)
            time.sleep(0.05)
        assert again < 40
