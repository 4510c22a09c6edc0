"""Real etcd and nats-server for integration tests, on free loopback ports.

The Debian packages (`etcd-server`, `etcd-client`, `nats-server`) are installed by
`.ci/run` before pytest starts; a test that finds one missing fails at once, saying
what to install (nothing is installed from inside a test). Each server runs in its own
temporary directory and is stopped by PID in ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar
from pathlib import Path

from tests.helpers import service_port

_PACKAGES = {"etcd": "etcd-server", "etcdctl": "etcd-client", "nats-server": "nats-server"}
_SBIN = ("/usr/sbin", "/usr/bin", "/usr/local/bin", "/usr/local/sbin")


def binary(name: str) -> str:
    """Path of ``name``; a clear error naming the package when it is missing."""
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))
    if not found:
        raise RuntimeError(
            f"{name} not found: install the Debian package {_PACKAGES[name]} "
            f"(.ci/run does: apt-get install etcd-server etcd-client nats-server)"
        )
    return found


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open within {timeout} s")


def _log_text(workdir: Path) -> str:
    texts = [p.read_text(errors="replace") for p in workdir.glob("*.log")]
    return "\n".join(texts)


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class _Startable(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def log_text(self) -> str: ...


_Server = TypeVar("_Server", bound=_Startable)


class Etcd:
    """One etcd member with a persistent data dir, so it can be killed and restarted."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # not ephemeral: a restart needs the same ports back (see service_port)
        self.client_port = service_port()
        self.peer_port = service_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            binary("etcd"), "--name", "kvmesh-test", "--data-dir", str(self.workdir / "data"),
            "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvmesh-test={peer}",
        ]  # fmt: skip
        log = open(self.workdir / "etcd.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_port(self.client_port, self.proc)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def log_text(self) -> str:
        return _log_text(self.workdir)

    def stop(self) -> None:
        _stop(self.proc)

    def etcdctl(self, *args: str) -> str:
        env = dict(os.environ, ETCDCTL_API="3")
        out = subprocess.run([binary("etcdctl"), "--endpoints", self.endpoint, *args], capture_output=True, text=True, env=env, check=True)
        return out.stdout


class Nats:
    def __init__(self, workdir: Path, jetstream: bool = True) -> None:
        self.workdir = workdir
        self.port = service_port()  # not ephemeral: a restart needs the same port back
        self.jetstream = jetstream
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [binary("nats-server"), "-a", "127.0.0.1", "-p", str(self.port)]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self.workdir / "js")]
        log = open(self.workdir / "nats.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_port(self.port, self.proc)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def log_text(self) -> str:
        return _log_text(self.workdir)

    def stop(self) -> None:
        _stop(self.proc)


def _first_start(make: Callable[[], _Server], attempts: int = 3) -> _Server:
    """Start a new server; when it exits at once because another process took one of
    its free ports meanwhile (many test processes pick ports on a busy machine), try
    again on new ports. A restart of the same server (same ports) never comes here."""
    for attempt in range(attempts):
        server = make()
        try:
            server.start()
            return server
        except RuntimeError:
            server.stop()
            if attempt == attempts - 1 or "address already in use" not in server.log_text():
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def etcd_server() -> Iterator[Etcd]:
    with tempfile.TemporaryDirectory(prefix="kvmesh-etcd-") as d:
        server: Etcd | None = None
        try:
            server = _first_start(lambda: Etcd(Path(tempfile.mkdtemp(dir=d))))
            yield server
        finally:
            if server is not None:
                server.stop()


@contextlib.contextmanager
def nats_server(jetstream: bool = True) -> Iterator[Nats]:
    with tempfile.TemporaryDirectory(prefix="kvmesh-nats-") as d:
        server: Nats | None = None
        try:
            server = _first_start(lambda: Nats(Path(tempfile.mkdtemp(dir=d)), jetstream))
            yield server
        finally:
            if server is not None:
                server.stop()
