"""Shared test helpers: free ports, a real ``kvmesh run`` process, an in-process stack."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def service_port() -> int:
    """A free port below the ephemeral range, for a server a test kills and starts again
    on the same port. A port from bind(0) is ephemeral: while the server is down, any
    process's bind(0) or outgoing connection may take it (seen: a restarted etcd's port
    answered by another process's server, 1,000 of whose sockets a benchmark had open)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        """PIDs of this server's worker processes (its direct children)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]


def wait_healthy(url: str, timeout: float = 120.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy within {timeout} s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


RUN_SECRET = "kvmesh-tests: the cluster secret of kvmesh_run's fleets"


@contextlib.contextmanager
def kvmesh_run(tmp_path: Path, *args: str, workers: int = 2, speedup: str = "1e9") -> Iterator[ServerProcess]:
    """A real ``kvmesh run`` process on a free loopback port, stopped in ``finally``."""
    port = free_port()
    log_path = tmp_path / f"kvmesh-run-{port}.log"
    cmd = [sys.executable, "-m", "kvmesh.cli.main", "run", "--http-port", str(port)]
    cmd += ["--workers", str(workers), "--speedup", speedup, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # kvmesh run would make a random cluster secret; this known one lets tests call its workers
    env.setdefault("KVMESH_CLUSTER_SECRET", RUN_SECRET)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log_path)
    try:
        wait_healthy(server.url, proc=proc)
        yield server
    finally:
        stop_process(proc)


class InProcessStack:
    """Frontend + one mocker worker in this event loop, over real loopback TCP.

    The worker's engine object is reachable (``.engine``) so a test can look at its
    blocks and aborts directly.
    """

    def __init__(self, speedup: float = 1e9, **mocker: object) -> None:
        from kvmesh.config import FrontendConfig, WorkerConfig
        from kvmesh.engines.settings import MockerSettings

        block_size = int(mocker.pop("block_size", 16))  # type: ignore[call-overload]  # a test passes an int
        options = MockerSettings(speedup=speedup, **mocker)  # type: ignore[arg-type]
        self.worker_config = WorkerConfig(block_size=block_size, engine_options=options)
        # canaries would add requests of their own to the engine these tests count
        self.frontend_config = FrontendConfig(http_port=0, keepalive_s=0.2, canary_interval_s=0)
        self.port = 0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[InProcessStack]:
        from kvmesh.assembly.frontend import GRACEFUL_SHUTDOWN_S
        from kvmesh.frontend.app import Frontend
        from kvmesh.frontend.server import bind_http
        from kvmesh.frontend.serving import make_server
        from kvmesh.protocol import InstanceInfo
        from kvmesh.worker.main import build_engine, fault_injector
        from kvmesh.worker.service import WorkerService

        self.engine, path = build_engine(self.worker_config)
        self.service = WorkerService(self.engine, validate=True, inject_fault=fault_injector(self.worker_config, self.engine))
        config = await self.service.start()
        self.frontend = Frontend(self.frontend_config)
        from kvmesh.runtime.tcp_client import TcpClient

        await self.frontend.registry.attach(InstanceInfo(0, self.service.address, config, path), TcpClient(self.service.address))
        sock = bind_http("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        server = make_server(self.frontend.app)
        server.config.timeout_graceful_shutdown = GRACEFUL_SHUTDOWN_S  # as `kvmesh frontend` bounds it
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            yield self
        finally:
            server.should_exit = True
            await task
            await self.service.shutdown(grace_s=2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class KvmeshProcess:
    """A `kvmesh frontend` or `kvmesh worker` process with its output in a file."""

    def __init__(self, tmp_path: Path, role: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.log_path = tmp_path / f"{role}-{free_port()}.log"
        cmd = [sys.executable, "-m", "kvmesh.cli.main", role, *args]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> dict:
        """The worker's READY card (its discovery value) as a dict."""
        import json

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if line.startswith("KVMESH_READY "):
                    return json.loads(line[len("KVMESH_READY ") :])
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"no READY line within {timeout} s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        stop_process(self.proc)


async def worker_disagg_stats(address: str, secret: str | None = None):  # type: ignore[no-untyped-def]
    """A worker's DisaggStats, from its ``disagg_stats`` endpoint at ``address``
    (``secret``: the fleet's cluster secret, e.g. ``RUN_SECRET`` for kvmesh_run)."""
    import msgspec

    from kvmesh.protocol import DisaggStats
    from kvmesh.runtime.distributed import call
    from kvmesh.runtime.names import DISAGG_STATS
    from kvmesh.runtime.tcp_client import TcpClient

    from kvmesh.runtime.auth import ClusterSecret

    client = TcpClient(address, secret=ClusterSecret(secret.encode()) if secret else None)
    try:
        return await call(client, DISAGG_STATS, decode=msgspec.msgpack.Decoder(DisaggStats).decode)
    finally:
        await client.close()


def migrations_total(url: str) -> float:
    """``kvmesh_migration_total`` over all its labels, from the frontend's /metrics."""
    import re

    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^kvmesh_migration_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


async def streams_cut_mid_way(server: ServerProcess, stream: Callable[[int, list[int]], Awaitable[str]], count: int) -> list[str]:
    """Run ``count`` streams (``stream(i, progress)`` adds 1 to ``progress[i]`` per piece it
    reads), SIGKILL the first worker once every stream is under way (3 pieces each; round
    robin over two workers: two streams on each), and return their texts."""
    progress = [0] * count
    tasks = [asyncio.ensure_future(stream(i, progress)) for i in range(count)]
    while min(progress) < 3:
        assert not any(t.done() for t in tasks), "a stream ended before the kill"
        await asyncio.sleep(0.01)
    os.kill(server.worker_pids()[0], signal.SIGKILL)
    return list(await asyncio.gather(*tasks))
