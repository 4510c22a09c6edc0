"""A three-process fleet (`kvmesh frontend`, two `kvmesh worker`) on real etcd and
nats-server with a cluster secret, through the openai client: a worker given the
wrong secret is refused (and the frontend says why) while the other serves, and a
rogue that writes a worker record straight into etcd is skipped."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import msgspec
import openai
import pytest

from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.runtime.discovery import make_discovery
from kvmesh.runtime.distributed import instance_key
from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(180)]


def _until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not met in time"
        time.sleep(0.1)


def _routed(url: str) -> dict[int, float]:
    text = httpx.get(url + "/metrics").text
    pattern = r'kvmesh_router_decisions_total\{model="kvmesh-tiny",worker="([0-9a-f]+)"\} ([0-9.e+]+)'
    return {int(w, 16): float(v) for w, v in re.findall(pattern, text)}


@pytest.mark.parametrize("request_plane", ["nats", "tcp"])
def test_a_fleet_with_a_secret_serves_and_refuses_the_worker_with_the_wrong_one(tmp_path, etcd, nats, request_plane):
    good, bad = tmp_path / "secret", tmp_path / "wrong-secret"
    good.write_text("the fleet's secret: 0123456789abcdef\n")
    bad.write_text("another fleet's secret: fedcba9876543210\n")
    good.chmod(0o600)
    bad.chmod(0o600)
    env = {
        "KVMESH_DISCOVERY": "etcd",
        "KVMESH_ETCD_ENDPOINTS": etcd.endpoint,
        "KVMESH_NATS_URL": nats.url,
        "KVMESH_REQUEST_PLANE": request_plane,
        "KVMESH_EVENT_PLANE": "zmq",
        "KVMESH_HOST": "127.0.0.1",
        "KVMESH_NAMESPACE": "sec",
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[KvmeshProcess] = []
    try:
        frontend = KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), "--cluster-secret-file", str(good),
                                 "--log-level", "info", env=env)  # fmt: skip
        procs.append(frontend)
        worker = KvmeshProcess(tmp_path, "worker", "--speedup", "5", "--cluster-secret-file", str(good), env=env)
        procs.append(worker)
        ready = worker.wait_ready()
        lease = ready["lease_id"]
        wrong = KvmeshProcess(tmp_path, "worker", "--speedup", "5", "--cluster-secret-file", str(bad), env=env)
        procs.append(wrong)
        wrong_lease = wrong.wait_ready()["lease_id"]
        wait_healthy(url)
        _until(lambda: f"{wrong_lease:x}: not signed with this fleet's cluster secret" in frontend.log(),
               what="the frontend's log line about the wrong secret")  # fmt: skip
        asyncio.run(_rogue_registers_a_worker(etcd.endpoint, lease))
        if ready.get("address"):  # tcp plane: the rogue dials the worker itself
            asyncio.run(_rogue_calls_the_worker(ready["address"]))
            _until(lambda: "refusing connection" in worker.log(), what="the worker's log line about the rogue")
        _until(lambda: "generate-5ec: not signed with this fleet's cluster secret" in frontend.log(),
               what="the rogue's record skipped")  # fmt: skip

        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        for i in range(6):
            stream = client.chat.completions.create(
                model="kvmesh-tiny", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=12, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text
        assert httpx.get(url + "/health").json()["models"]["kvmesh-tiny"] == 1
        routed = _routed(url)
        assert set(routed) == {lease} and routed[lease] == 6
        assert "Traceback" not in frontend.log()
    finally:
        for proc in reversed(procs):
            proc.stop()


async def _rogue_calls_the_worker(address: str) -> None:
    """No secret: generate and fault injection straight at the worker are refused."""
    from kvmesh.errors import KvmeshError
    from kvmesh.protocol import PreprocessedRequest, StopConditions
    from kvmesh.runtime.context import Context
    from kvmesh.runtime.names import FAULT, GENERATE
    from kvmesh.runtime.tcp_client import TcpClient

    rogue = TcpClient(address, connect_timeout=5, secret=None)
    request = PreprocessedRequest(request_id="rogue", model="kvmesh-tiny", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=4))
    try:
        for endpoint, payload in ((FAULT, msgspec.msgpack.encode("crash")), (GENERATE, msgspec.msgpack.encode(request))):
            with pytest.raises(KvmeshError):
                async for _ in rogue.stream(endpoint, payload, Context("rogue")):
                    pass
    finally:
        await rogue.close()


async def _rogue_registers_a_worker(endpoint: str, real_lease: int) -> None:
    """No secret: a record in etcd in the name of a new worker that points at the real
    worker's address (or anywhere else)."""
    disc = make_discovery("etcd", etcd_endpoints=[endpoint])
    await disc.connect()
    try:
        info = InstanceInfo(0x5EC, "127.0.0.1:1", EngineConfig("x", "kvmesh-tiny", 2048, 16, 1024, 8, 2048))
        await disc.put(instance_key("sec", "backend", "generate", 0x5EC), msgspec.json.encode(info))
    finally:
        await disc.close()


def test_kvmesh_run_protects_its_own_fleet_with_a_random_secret(tmp_path):
    """No secret given: `kvmesh run` makes one for its processes. It serves the openai
    client while its workers refuse a caller without that secret."""
    import os
    import subprocess
    import sys

    from tests.helpers import RUN_SECRET, stop_process

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_CLUSTER_SECRET")}
    env["PYTHONUNBUFFERED"] = "1"
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli.main", "run", "--http-port", str(port), "--workers", "1",
                                 "--speedup", "1e9", "--log-level", "info", "--admin"], stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc=proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        out = client.completions.create(model="kvmesh-tiny", prompt="def f(x):", max_tokens=8, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
        address = httpx.get(url + "/admin/workers").json()["workers"][0]["address"]
        for secret in (None, RUN_SECRET):  # neither no secret nor a guessed one
            asyncio.run(_refused(address, secret))
        _until(lambda: log_path.read_text(errors="replace").count("refusing connection") >= 2, what="the workers' log lines")
        out = client.completions.create(model="kvmesh-tiny", prompt="still serving", max_tokens=4, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
    finally:
        stop_process(proc)


async def _refused(address: str, secret: str | None) -> None:
    from kvmesh.errors import CannotConnect
    from kvmesh.runtime.auth import ClusterSecret
    from kvmesh.runtime.context import Context
    from kvmesh.runtime.names import INFO
    from kvmesh.runtime.tcp_client import TcpClient

    client = TcpClient(address, connect_timeout=5, secret=ClusterSecret(secret.encode()) if secret else None)
    try:
        with pytest.raises(CannotConnect):
            async for _ in client.stream(INFO, b"\xc0", Context("rogue")):
                pass
    finally:
        await client.close()
