"""A distributed command that listens where other machines reach it, without cluster
credentials: anyone who reaches a worker would get free inference past the frontend's
keys and limits, or could throttle it. ``kvmesh frontend|worker|planner`` refuse to bind
anything but loopback without a cluster secret or TLS, unless ``--insecure`` (then a
warning at start and every minute).

The refused and the insecure cases need an address that is not loopback yet bindable
here: the machine's own (``ip -4 addr``); skipped with the reason where it has none."""

from __future__ import annotations

import ipaddress
import logging
import socket
import subprocess
import time

import pytest

from kvmesh.runtime import auth
from tests.helpers import KvmeshProcess

pytestmark = [pytest.mark.timeout(90), pytest.mark.processes]

CREDENTIALS = ("KVMESH_CLUSTER_SECRET", "KVMESH_CLUSTER_SECRET_FILE", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY",
               "KVMESH_TLS_CA", "KVMESH_INSECURE", "KVMESH_HOST")  # fmt: skip
WARNING = "without cluster credentials"


def _own_address() -> str | None:
    """A non-loopback IPv4 address of this machine that a socket can bind."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if "inet" not in fields:
            continue
        addr = fields[fields.index("inet") + 1].split("/")[0]
        if ipaddress.ip_address(addr).is_loopback:
            continue
        with socket.socket() as s:
            try:
                s.bind((addr, 0))
            except OSError:
                continue
        return addr
    return None


ADDRESS = _own_address()
needs_address = pytest.mark.skipif(ADDRESS is None, reason="this machine has no bindable address other than loopback")


@pytest.fixture(autouse=True)
def _no_credentials(monkeypatch):
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)


STARTED = ("KVMESH_READY", "frontend serving", "planner: planning")  # the lines each prints once running


def _exited(proc: KvmeshProcess, timeout: float = 60.0) -> int | str:
    """The exit code, or why it did not exit: it started listening, or still runs."""
    deadline = time.monotonic() + timeout
    try:
        while proc.proc.poll() is None:
            if any(mark in proc.log() for mark in STARTED):
                return "started listening"
            if time.monotonic() > deadline:
                return f"still running after {timeout} s"
            time.sleep(0.05)
        return proc.proc.returncode
    finally:
        proc.stop()


@needs_address
@pytest.mark.parametrize(
    "role, args",
    [
        ("worker", ["--static", "--port", "0", "--host", "{addr}"]),
        ("worker", ["--static", "--port", "0", "--metrics-port", "0", "--metrics-host", "{addr}"]),
        ("frontend", ["--static-workers", "127.0.0.1:9", "--http-port", "0", "--host", "{addr}"]),
        ("planner", ["--host", "{addr}"]),
    ],
    ids=["worker", "worker-metrics", "frontend", "planner"],
)
def test_an_exposed_listener_without_credentials_is_refused_with_one_line(tmp_path, role, args):
    proc = KvmeshProcess(tmp_path, role, *[a.format(addr=ADDRESS) for a in args])
    rc = _exited(proc)
    lines = proc.log().strip().splitlines()
    assert rc == 2, f"kvmesh {role} listening on {ADDRESS} without a secret was not refused (rc {rc}):\n{proc.log()}"
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvmesh {role}: ") and ADDRESS in lines[0]
    for what in ("--cluster-secret-file", "KVMESH_CLUSTER_SECRET_FILE", "--tls-cert", "--insecure"):
        assert what in lines[0]


@needs_address
def test_the_host_from_the_environment_is_checked_too(tmp_path):
    proc = KvmeshProcess(tmp_path, "worker", "--static", "--port", "0", env={"KVMESH_HOST": ADDRESS or ""})
    assert _exited(proc) == 2, proc.log()
    assert "--insecure" in proc.log()


@needs_address
@pytest.mark.parametrize("how", ["flag", "environment"])
def test_insecure_starts_and_warns(tmp_path, how):
    args = ["--static", "--port", "0", "--host", ADDRESS or ""] + (["--insecure"] if how == "flag" else [])
    proc = KvmeshProcess(tmp_path, "worker", *args, env={"KVMESH_INSECURE": "1"} if how == "environment" else {})
    try:
        ready = proc.wait_ready()
        assert ready["address"].startswith(f"{ADDRESS}:")
        assert WARNING in proc.log() and f"--host {ADDRESS}" in proc.log()
    finally:
        proc.stop()


@needs_address
def test_with_a_secret_it_starts_without_a_word(tmp_path):
    proc = KvmeshProcess(tmp_path, "worker", "--static", "--port", "0", "--host", ADDRESS or "",
                         env={"KVMESH_CLUSTER_SECRET": "exposure-test secret of 32 bytes"})  # fmt: skip
    try:
        assert proc.wait_ready()["address"].startswith(f"{ADDRESS}:")
        assert WARNING not in proc.log() and "insecure" not in proc.log()
    finally:
        proc.stop()


def test_loopback_needs_nothing(tmp_path):
    proc = KvmeshProcess(tmp_path, "worker", "--static", "--port", "0", "--host", "127.0.0.1")
    try:
        proc.wait_ready()
        assert WARNING not in proc.log()
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("", False), ("192.0.2.7", False), ("10.1.2.3", False)],
)  # fmt: skip
def test_what_counts_as_loopback(host, loopback):
    assert auth.is_loopback(host) is loopback


def test_every_address_is_refused_without_credentials():
    with pytest.raises(ValueError, match=r"--host 0\.0\.0\.0 is reachable from other machines"):
        auth.check_exposure({"--host": "0.0.0.0"}, insecure=False)
    with pytest.raises(ValueError, match=r"\(every address\)"):
        auth.check_exposure({"--host": "127.0.0.1", "--metrics-host": ""}, insecure=False)
    assert auth.check_exposure({"--host": "0.0.0.0"}, insecure=True) == ["--host 0.0.0.0"]
    assert auth.check_exposure({"--host": "127.0.0.1"}, insecure=False) == []


def test_the_insecure_warning_repeats(caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.auth")
    stop = auth.warn_insecure("--host 0.0.0.0", interval_s=0.05)
    try:
        deadline = time.monotonic() + 30
        while sum(WARNING in r.getMessage() for r in caplog.records) < 3:
            assert time.monotonic() < deadline, "the warning was not repeated"
            time.sleep(0.02)
    finally:
        stop.set()
