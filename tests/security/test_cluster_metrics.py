"""The metrics port of a worker (and of ``kvmesh planner``) under attack: real
``kvmesh worker --static --metrics-port 0`` processes, raw sockets.

* 200 idle connections: the port was prometheus_client's threaded server, one thread
  (and one descriptor) per connection for as long as the client liked; now the worker
  keeps at most a few connections, closes the rest at once and adds no thread;
* a silent connection and a head that never ends are closed (head timeout);
* with a cluster secret, /metrics asks for the fleet's metrics token;
* the port is bound to loopback unless ``--metrics-host`` says otherwise, whatever
  ``--host`` is (the advertised ``metrics_address`` follows what is bound);
* the planner's metrics port likewise; the real Prometheus scrapes a worker with the
  scrape config in deploy/prometheus.

Conditions are waited on; nothing asserts a duration.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvmesh.runtime.auth import ClusterSecret
from tests.helpers import KvmeshProcess, free_port

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
SECRET = "kvmesh-tests: the metrics port's cluster secret"
TOKEN = ClusterSecret(SECRET.encode()).derive("metrics-token").hex()  # what `kvmesh metrics-token` prints
NO_SECRET = {"KVMESH_CLUSTER_SECRET": "", "KVMESH_CLUSTER_SECRET_FILE": ""}
FLOOD = 200
CAP_AT_MOST = 64  # the server's cap is 32; the test allows some slack, far below the flood


def _wait(predicate: Callable[[], object], timeout: float, what: Callable[[], str] | str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(what() if callable(what) else what)
        time.sleep(0.05)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for {pid}")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@contextlib.contextmanager
def _worker(tmp_path: Path, *args: str, env: dict[str, str]) -> Iterator[tuple[KvmeshProcess, dict[str, object]]]:
    proc = KvmeshProcess(tmp_path, "worker", "--static", "--speedup", "1e9", "--metrics-port", "0", *args, env=env)
    try:
        yield proc, proc.wait_ready(60)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def open_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KvmeshProcess, dict[str, object]]]:
    """A worker without a cluster secret, its request plane on 127.0.0.2 (``--host``)."""
    with _worker(tmp_path_factory.mktemp("open"), "--host", "127.0.0.2", env=NO_SECRET) as started:
        yield started


def _closed(sock: socket.socket) -> bool:
    """The server closed it (EOF or reset); False while it is open and silent."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False


def _request(address: str, raw: bytes) -> bytes:
    """``raw`` sent on a new connection; everything the server answers until it closes."""
    with socket.create_connection(_split(address), timeout=30) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_idle_connections_cost_no_thread_and_those_past_the_cap_are_closed_at_once(open_worker):
    proc, card = open_worker
    pid, address = card["pid"], card["metrics_address"]
    before = _threads(pid)
    socks = []
    try:
        for _ in range(FLOOD):
            sock = socket.create_connection(_split(address), timeout=30)
            sock.setblocking(False)
            socks.append(sock)
        closed: set[int] = set()

        def refused() -> bool:  # every connection past the first CAP_AT_MOST made
            closed.update(i for i, s in enumerate(socks) if i not in closed and _closed(s))
            return closed >= set(range(CAP_AT_MOST, FLOOD))

        _wait(refused, 30, lambda: f"{len(closed)} of {FLOOD} idle connections closed; the worker's threads went "
                                   f"from {before} to {_threads(pid)}")  # fmt: skip
        assert _threads(pid) - before < 10, f"the worker's threads went from {before} to {_threads(pid)}"
        # closed at the cap, not by a timeout: the first ones accepted are still open
        # (connections are accepted in the order they were made; timeouts would close those first)
        assert len(closed) < FLOOD, "every connection was closed: by a timeout, none at the cap"
        # the ones it kept are idle: closed at the head timeout
        _wait(lambda: refused() and len(closed) == FLOOD, 60, lambda: f"{FLOOD - len(closed)} idle connections open")
    finally:
        for sock in socks:
            sock.close()
    assert b"200 OK" in _request(address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # it still serves
    assert proc.proc.poll() is None


def test_a_silent_connection_and_a_head_that_never_ends_are_closed(open_worker):
    _, card = open_worker
    host, port = _split(card["metrics_address"])
    silent = socket.create_connection((host, port), timeout=30)
    slow = socket.create_connection((host, port), timeout=30)
    try:
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        for sock in (silent, slow):
            sock.setblocking(False)
        _wait(lambda: _closed(silent), 60, "a connection that sends nothing was kept open")
        _wait(lambda: _closed(slow), 60, "a request head that never ends was kept open")
    finally:
        silent.close()
        slow.close()


def test_bad_requests_get_a_clear_4xx_and_one_answer_per_connection(open_worker):
    _, card = open_worker
    address = card["metrics_address"]
    post = _request(address, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert post.startswith(b"HTTP/1.1 405") and b"Allow: GET, HEAD" in post and b"only GET /metrics" in post, post
    other = _request(address, b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n")
    assert other.startswith(b"HTTP/1.1 404") and b"only /metrics" in other, other
    garbage = _request(address, b"HELLO\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400") and b"GET /metrics HTTP/1.1" in garbage, garbage
    huge = _request(address, b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n")
    assert huge.startswith(b"HTTP/1.1 431"), huge[:200]
    two = _request(address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 2)  # pipelined: one answer, then closed
    assert two.count(b"HTTP/1.1 200 OK") == 1 and b"Connection: close" in two
    head = _request(address, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n"), head[-200:]


def test_the_metrics_port_is_bound_to_loopback_unless_metrics_host_says_otherwise(open_worker, tmp_path):
    _, card = open_worker
    assert card["address"].startswith("127.0.0.2:")  # --host: the request plane
    host, port = _split(card["metrics_address"])
    assert host == "127.0.0.1", f"the metrics port followed --host: {card['metrics_address']}"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=10).close()
    with _worker(tmp_path, "--host", "127.0.0.2", "--metrics-host", "127.0.0.3", env=NO_SECRET) as (_, other):
        host, port = _split(other["metrics_address"])
        assert host == "127.0.0.3"
        assert httpx.get(f"http://127.0.0.3:{port}/metrics", timeout=30).status_code == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()


def test_with_a_secret_the_metrics_need_the_fleets_token(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    with _worker(tmp_path, "--cluster-secret-file", str(secret_file), env=NO_SECRET) as (_, card):
        url = f"http://{card['metrics_address']}/metrics"
        bare = httpx.get(url, timeout=30)
        assert bare.status_code == 401, f"answered {bare.status_code} without the token"
        assert "kvmesh metrics-token" in bare.text and bare.headers["www-authenticate"].startswith("Bearer")
        for wrong in ("Bearer " + TOKEN[:-1] + "0", "Bearer " + SECRET, "Basic " + TOKEN, TOKEN):
            assert httpx.get(url, headers={"Authorization": wrong}, timeout=30).status_code == 401, wrong
        good = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert good.status_code == 200 and "kvmesh_worker_running_requests" in good.text
    printed = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli.main", "metrics-token", "--cluster-secret-file", str(secret_file)],
        capture_output=True, text=True, timeout=60, env={**_env(), **NO_SECRET},
    )  # fmt: skip
    assert (printed.returncode, printed.stdout.strip()) == (0, TOKEN), printed.stderr
    missing = subprocess.run([sys.executable, "-m", "kvmesh.cli.main", "metrics-token"], capture_output=True,
                             text=True, timeout=60, env={**_env(), **NO_SECRET})  # fmt: skip
    assert missing.returncode == 2 and "no cluster secret" in missing.stderr


def _env() -> dict[str, str]:
    return dict(os.environ)


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


def test_the_planners_metrics_port_is_loopback_and_asks_for_the_token(tmp_path):
    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "disc"),
           "KVMESH_NAMESPACE": "metricsplanner", "KVMESH_CLUSTER_SECRET": SECRET, "KVMESH_HOST": "127.0.0.2"}  # fmt: skip
    port = free_port()
    planner = KvmeshProcess(tmp_path, "planner", "--planner-metrics-port", str(port), env=env)
    try:

        def listening() -> bool:  # on either address (BASE bound --host), or the planner failed
            return _connects("127.0.0.1", port) or _connects("127.0.0.2", port) or planner.proc.poll() is not None

        _wait(listening, 60, lambda: f"the planner's metrics port:\n{planner.log()}")
        assert planner.proc.poll() is None, planner.log()
        assert not _connects("127.0.0.2", port), "the planner's metrics port followed --host"
        url = f"http://127.0.0.1:{port}/metrics"
        assert httpx.get(url, timeout=30).status_code == 401
        good = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert good.status_code == 200 and "kvmesh_planner_" in good.text
    finally:
        planner.stop()


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not installed (.ci/run installs the Debian package prometheus)"
    return path


def test_prometheus_scrapes_a_worker_with_the_token_from_the_shipped_config(tmp_path):
    """deploy/prometheus/kvmesh-scrape.yml's worker job, its target and token file
    pointed at a real worker: up; the same job without the token: down (401)."""
    shipped = yaml.safe_load((REPO / "deploy/prometheus/kvmesh-scrape.yml").read_text())
    k8s = yaml.safe_load((REPO / "deploy/prometheus/kvmesh-scrape-kubernetes.yml").read_text())
    assert all("credentials_file" in job["authorization"] for job in k8s["scrape_configs"])
    job = next(j for j in shipped["scrape_configs"] if "authorization" in j)
    secret_file, token_file = tmp_path / "secret", tmp_path / "kvmesh-metrics-token"
    secret_file.write_text(SECRET)
    token_file.write_text(TOKEN + "\n")
    with _worker(tmp_path, "--cluster-secret-file", str(secret_file), env=NO_SECRET) as (_, card):
        job["authorization"]["credentials_file"] = str(token_file)
        job["static_configs"] = [{"targets": [card["metrics_address"]]}]
        bare = {k: v for k, v in job.items() if k != "authorization"} | {"job_name": "no-token"}
        config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [job, bare]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        checked = subprocess.run([_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
        port = free_port()
        with open(tmp_path / "prometheus.log", "wb") as log:
            prom = subprocess.Popen(
                [_tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            health: dict[str, tuple[str, str]] = {}

            def scraped() -> bool:
                try:
                    targets = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json()["data"]
                except (httpx.HTTPError, ValueError, KeyError):
                    return False
                for t in targets["activeTargets"]:
                    health[t["labels"]["job"]] = (t["health"], t["lastError"])
                return all(h != "unknown" for h, _ in health.values()) and len(health) == 2

            _wait(scraped, 60, lambda: f"Prometheus' targets: {health}")
            assert health[job["job_name"]] == ("up", ""), health
            assert health["no-token"][0] == "down" and "401" in health["no-token"][1], health
        finally:
            prom.terminate()
            prom.wait(15)


def test_the_advertised_address_is_the_bound_one_or_the_hosts_for_every_interface():
    from kvmesh.observability.metrics_server import advertised_address

    assert advertised_address("127.0.0.1", "10.0.0.5", 9100) == "127.0.0.1:9100"
    assert advertised_address("0.0.0.0", "10.0.0.5", 9100) == "10.0.0.5:9100"
    assert advertised_address("::", "fd00::5", 9100) == "[fd00::5]:9100"
