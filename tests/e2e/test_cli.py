"""`kvmesh run` as a process: startup errors are one clear line, a crashed worker
takes down only itself and is replaced, and workers exit with their parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import free_port, kvmesh_run

pytestmark = pytest.mark.processes


def _run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli.main", *args], capture_output=True, text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two checks
        return False


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_bad_model_folder_is_one_line_and_exit_1(tmp_path):
    r = _run_cli("run", "--model-path", str(tmp_path / "nope"), "--http-port", str(free_port()))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0], r.stderr


def test_port_taken_is_one_line_and_exit_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run_cli("run", "--http-port", str(port))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "in use" in lines[0], r.stderr


def test_bad_option_value_is_one_line_and_exit_2():
    r = _run_cli("run", "--workers", "0")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["kvmesh run: --workers must be at least 1, got 0"]


def test_python_dash_m_kvmesh_is_the_kvmesh_command():
    r = subprocess.run([sys.executable, "-m", "kvmesh", "run", "--workers", "0"], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stderr.strip()) == (2, "kvmesh run: --workers must be at least 1, got 0")


def _complete(url: str) -> int:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 4, "ignore_eos": True},
        timeout=10,
    )
    return r.status_code


def test_worker_crash_spares_the_others_and_is_replaced(tmp_path):
    with kvmesh_run(tmp_path, workers=2) as server:
        pids = server.worker_pids()
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        _wait(lambda: not _alive(pids[0]), 30)
        assert _alive(pids[1])
        # every request still succeeds while the replacement starts
        assert all(_complete(server.url) == 200 for _ in range(20))
        _wait(lambda: httpx.get(server.url + "/health").json()["models"]["kvmesh-tiny"] == 2, 60)
        new = set(server.worker_pids())
        assert pids[1] in new and pids[0] not in new and len(new) == 2


def test_workers_exit_with_the_parent(tmp_path):
    with kvmesh_run(tmp_path, workers=2) as server:
        pids = server.worker_pids()
        assert len(pids) == 2 and all(_alive(p) for p in pids), pids  # else "none alive" below proves nothing
        server.proc.send_signal(signal.SIGKILL)  # no chance to clean up
        server.proc.wait(30)
        _wait(lambda: not any(_alive(p) for p in pids), 30)


def test_sigterm_stops_frontend_and_workers(tmp_path):
    with kvmesh_run(tmp_path, workers=2) as server:
        pids = server.worker_pids()
        assert len(pids) == 2 and all(_alive(p) for p in pids), pids  # else "none alive" below proves nothing
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        _wait(lambda: not any(_alive(p) for p in pids), 30)
