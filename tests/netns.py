"""Three hosts on one machine: network namespaces joined by a bridge.

::

    ns {tag}-a  10.213.N.1 ─veth─┐
    ns {tag}-b  10.213.N.2 ─veth─┼─ bridge in ns {tag}-sw
    ns {tag}-c  10.213.N.3 ─veth─┘

The bridge lives in a namespace of its own too, so nothing is added to the machine's
own network: the addresses (a private test range, N picked per run) exist only inside
these namespaces and no route leads out of them. Names carry a per-run tag
(``kvm`` + pid), so runs side by side do not collide. :meth:`Hosts.cut` takes a
host's link down at the bridge (its processes live on, unreachable, as behind a
pulled cable); :meth:`Hosts.restore` brings it back. Everything started with
:meth:`Hosts.spawn` is stopped by PID and every namespace deleted on close, also
after a failure.

Needs root and ``ip netns`` (iproute2); :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Hosts", "unavailable", "HOSTS"]

HOSTS = ("a", "b", "c")


def unavailable() -> str | None:
    """Why three namespaces cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"kvmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        for what in (("veth", "peer", "name", "p1"), ("bridge",)):
            link = subprocess.run(["ip", "-n", probe, "link", "add", "p0", "type", *what], capture_output=True, text=True)
            if link.returncode != 0:
                return f"cannot make a {what[0]} link in a namespace: {link.stderr.strip()}"
            subprocess.run(["ip", "-n", probe, "link", "del", "p0"], capture_output=True)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Three namespaces a, b, c on one bridge; use as a context manager."""

    def __init__(self, workdir: Path, subnet: int | None = None) -> None:
        self.workdir = workdir
        self.tag = f"kvm{os.getpid() % 100000}"
        # 10.213.20.0/24 .. 10.213.219.0/24: spread runs of different pids apart
        self.subnet = subnet if subnet is not None else 20 + os.getpid() % 200
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"10.213.{self.subnet}.{HOSTS.index(host) + 1}"

    def _switch_port(self, host: str) -> str:
        return f"{self.tag}{host}s"

    # ------------------------------------------------------------------ build / tear down
    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        sw = self.ns("sw")
        for name in (sw, *(self.ns(h) for h in HOSTS)):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for host in HOSTS:
            port, inner = self._switch_port(host), f"{self.tag}{host}h"
            # both ends made inside the switch namespace, one end then moved to the host
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", inner)
            _ip("-n", sw, "link", "set", inner, "netns", self.ns(host))
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", self.ns(host), "link", "set", inner, "name", "eth0")
            _ip("-n", self.ns(host), "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", self.ns(host), "link", "set", "eth0", "up")

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    # ------------------------------------------------------------------ faults
    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the bridge: no packet in or out, no RST, no FIN."""
        _ip("-n", self.ns("sw"), "link", "set", self._switch_port(host), "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.ns("sw"), "link", "set", self._switch_port(host), "up")

    # ------------------------------------------------------------------ processes
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def spawn(self, host: str, argv: Sequence[str], log_name: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
        """Start ``argv`` in ``host``'s namespace, output to ``workdir/log_name``."""
        log = open(self.workdir / log_name, "ab")
        try:
            proc = subprocess.Popen(
                self.command(host, argv), stdout=kw.pop("stdout", log), stderr=subprocess.STDOUT,
                env=dict(os.environ, **(env or {})), **kw,
            )  # fmt: skip
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout: float = 30.0) -> str:
        """Run ``argv`` in ``host``'s namespace to completion; its stdout."""
        out = subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {host}: {out.stderr.strip()}")
        return out.stdout

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    @staticmethod
    def wait_port(host_addr: str, port: int, proc: subprocess.Popen[bytes], hosts: Hosts, host: str, timeout: float = 30.0) -> None:
        """Wait until ``host_addr:port`` accepts connections, probed from inside ``host``."""
        deadline = time.monotonic() + timeout
        probe = ["python3", "-c", f"import socket; socket.create_connection(('{host_addr}', {port}), 1).close()"]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before {host_addr}:{port} opened")
            if subprocess.run(hosts.command(host, probe), capture_output=True).returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{host_addr}:{port} not open within {timeout} s")
