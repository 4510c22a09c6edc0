"""Distributed mode with real etcd and nats-server: `kvmesh frontend` and `kvmesh worker`
processes, the openai client streaming under load while workers come and go, a worker
is drained with SIGTERM, a lease is revoked with etcdctl, and etcd itself is SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import openai
import pytest

from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.slow]

MAX_TOKENS = 24


def _runtime_env(etcd, nats, request_plane="tcp") -> dict[str, str]:
    return {
        "KVMESH_DISCOVERY": "etcd",
        "KVMESH_ETCD_ENDPOINTS": etcd.endpoint,
        "KVMESH_NATS_URL": nats.url,
        "KVMESH_REQUEST_PLANE": request_plane,
        "KVMESH_EVENT_PLANE": "zmq",
        "KVMESH_HOST": "127.0.0.1",
        "KVMESH_NAMESPACE": "e2e",
    }


class Cluster:
    def __init__(self, tmp_path, etcd, nats, request_plane="tcp", lease_ttl=None):
        self.tmp_path = tmp_path
        self.env = _runtime_env(etcd, nats, request_plane)
        if lease_ttl is not None:
            self.env["KVMESH_LEASE_TTL"] = str(lease_ttl)
        self.port = free_port()
        self.procs: list[KvmeshProcess] = []
        self.frontend = self._spawn("frontend", "--http-port", str(self.port), "--log-level", "info")

    def _spawn(self, role, *args):
        proc = KvmeshProcess(self.tmp_path, role, *args, env=self.env)
        self.procs.append(proc)
        return proc

    def worker(self, speedup="2") -> tuple[KvmeshProcess, int]:
        proc = self._spawn("worker", "--speedup", speedup, "--grace", "20")
        return proc, proc.wait_ready()["lease_id"]

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def routed(self) -> dict[int, float]:
        """Requests routed per worker lease id, from the frontend's /metrics."""
        text = httpx.get(self.url + "/metrics").text
        pattern = r'kvmesh_router_decisions_total\{model="kvmesh-tiny",worker="([0-9a-f]+)"\} ([0-9.e+]+)'
        return {int(w, 16): float(v) for w, v in re.findall(pattern, text)}

    def workers_seen(self) -> int:
        return httpx.get(self.url + "/health").json()["models"].get("kvmesh-tiny", 0)

    def close(self):
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def cluster_factory(tmp_path, etcd, nats):
    made = []

    def make(request_plane="tcp", lease_ttl=None):
        c = Cluster(tmp_path, etcd, nats, request_plane, lease_ttl)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


class Load:
    """Bounded streaming load: `clients` loops, each until `stop` or `max_requests`."""

    def __init__(self, url: str, clients: int = 6, max_requests: int = 5000) -> None:
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        self.clients = clients
        self.max_requests = max_requests
        self.done = 0
        self.failures: list[str] = []
        self.stop = asyncio.Event()

    async def one(self) -> None:
        stream = await self.client.completions.create(
            model="kvmesh-tiny", prompt="def f(x):", max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish, usage, chunks = None, None, 0
        try:
            async for chunk in stream:
                chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
        except Exception as exc:
            raise AssertionError(f"{exc!r} after {chunks} chunks") from exc
        if finish != "length" or usage != MAX_TOKENS:
            raise AssertionError(f"truncated stream: finish={finish} tokens={usage}")

    async def loop(self) -> None:
        while not self.stop.is_set() and self.done + len(self.failures) < self.max_requests:
            try:
                await self.one()
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on
                self.failures.append(repr(exc))

    async def run_while(self, action) -> None:
        loops = [asyncio.ensure_future(self.loop()) for _ in range(self.clients)]
        try:
            await action()
        finally:
            self.stop.set()
            await asyncio.wait_for(asyncio.gather(*loops), 120)
            await self.client.close()


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        await asyncio.sleep(0.1)


async def test_frontend_discovers_workers_and_model_then_streams(cluster_factory):
    cluster = cluster_factory()
    cluster.worker()
    cluster.worker()
    wait_healthy(cluster.url, proc=cluster.frontend.proc)
    await _until(lambda: cluster.workers_seen() == 2, 60, "two workers")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["kvmesh-tiny"]
    stream = client.chat.completions.create(
        model="kvmesh-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text


async def test_workers_join_and_drain_under_load_with_no_failure(cluster_factory):
    cluster = cluster_factory()
    w1, _ = cluster.worker()
    cluster.worker()
    wait_healthy(cluster.url, proc=cluster.frontend.proc)
    await _until(lambda: cluster.workers_seen() == 2, 60, "two workers")
    load = Load(cluster.url)

    async def scenario():
        await _until(lambda: load.done >= 20, 60, "warm load")
        _, lease3 = await asyncio.to_thread(cluster.worker)
        await _until(lambda: cluster.routed().get(lease3, 0) >= 5, 30, "traffic on the third worker")
        w1.signal(signal.SIGTERM)  # drain under load
        await asyncio.to_thread(w1.proc.wait, 40)
        done_after_drain = load.done
        await _until(lambda: load.done >= done_after_drain + 30, 60, "load after the drain")

    await load.run_while(scenario)
    assert w1.proc.returncode == 0, w1.log()
    assert load.failures == []
    assert load.done > 50


async def test_lease_revoked_with_etcdctl_leaves_routing_and_finishes_in_flight(cluster_factory, etcd):
    cluster = cluster_factory()
    w1, lease1 = cluster.worker()
    cluster.worker()
    wait_healthy(cluster.url, proc=cluster.frontend.proc)
    await _until(lambda: cluster.workers_seen() == 2, 60, "two workers")
    load = Load(cluster.url)

    async def scenario():
        await _until(lambda: cluster.routed().get(lease1, 0) >= 5, 60, "traffic on worker 1")
        etcd.etcdctl("lease", "revoke", f"{lease1:x}")
        await _until(lambda: cluster.workers_seen() == 1, 60, "worker 1 out of routing")
        before = cluster.routed().get(lease1, 0)
        await asyncio.to_thread(w1.proc.wait, 40)
        done = load.done
        await _until(lambda: load.done >= done + 30, 60, "load after the revoke")
        assert cluster.routed().get(lease1, 0) == before

    await load.run_while(scenario)
    assert load.failures == []
    assert w1.proc.returncode == 0


async def test_etcd_sigkill_for_5s_fails_nothing_and_discovery_heals(cluster_factory, etcd):
    cluster = cluster_factory()
    cluster.worker()
    w2, _ = cluster.worker()
    wait_healthy(cluster.url, proc=cluster.frontend.proc)
    await _until(lambda: cluster.workers_seen() == 2, 60, "two workers")
    load = Load(cluster.url)

    async def scenario():
        await _until(lambda: load.done >= 20, 60, "warm load")
        etcd.kill()
        done = load.done
        await asyncio.sleep(5)  # the outage's length, not a synchronisation
        await _until(lambda: load.done > done + 10, 60, "requests served while etcd is down")
        assert cluster.workers_seen() == 2
        etcd.start()
        # discovery heals: a new worker is found, a stopped one is removed
        _, lease3 = await asyncio.to_thread(cluster.worker)
        await _until(
            lambda: cluster.routed().get(lease3, 0) >= 3, 30,
            lambda: f"traffic on the new worker {lease3:x}: {cluster.routed()}, {cluster.workers_seen()} seen",
        )  # fmt: skip
        w2.signal(signal.SIGTERM)
        await _until(lambda: cluster.workers_seen() == 2, 30, "the stopped worker removed")

    await load.run_while(scenario)
    assert load.failures == []


LEASE_TTL = 2


async def test_etcd_down_for_3_ttls_fails_nothing_and_the_fleet_stays_whole(cluster_factory, etcd):
    """Losing etcd for longer than the lease TTL is not a revoke: the workers keep
    serving (same processes, same leases), the frontend keeps routing to them, and
    when etcd is back (restarted on the same data dir) discovery reconciles: a worker
    that died during the outage is dropped, a new one is found."""
    cluster = cluster_factory(lease_ttl=LEASE_TTL)
    w1, lease1 = cluster.worker()
    w2, lease2 = cluster.worker()
    w3, _ = cluster.worker()
    wait_healthy(cluster.url, proc=cluster.frontend.proc)
    await _until(lambda: cluster.workers_seen() == 3, 60, "three workers")
    load = Load(cluster.url, max_requests=3000)

    async def scenario():
        await _until(lambda: load.done >= 20, 60, "warm load")
        etcd.kill()
        done = load.done
        w3.proc.kill()  # dies while nobody can tell discovery: its streams migrate
        await asyncio.sleep(3 * LEASE_TTL + 1)  # the outage's length, not a synchronisation
        await _until(lambda: load.done > done + 10, 60, "requests served while etcd is down")
        assert w1.proc.poll() is None and w2.proc.poll() is None, "a worker stopped during the outage"
        etcd.start()
        # the dead worker's lease (extended when etcd restarted) runs out: it is dropped
        await _until(lambda: cluster.workers_seen() == 2, 30, "the dead worker dropped")
        before = cluster.routed()
        await _until(
            lambda: all(cluster.routed().get(w, 0) >= before.get(w, 0) + 5 for w in (lease1, lease2)), 30,
            lambda: f"traffic on both workers after the outage: {cluster.routed()}",
        )  # fmt: skip
        # the live ones kept their leases (etcd extends them when it restarts)
        for lease in (lease1, lease2):
            assert int(json.loads(etcd.etcdctl("lease", "timetolive", f"{lease:x}", "-w", "json"))["ttl"]) > 0
        # and discovery works: a new worker is found
        _, lease4 = await asyncio.to_thread(cluster.worker)
        await _until(lambda: cluster.routed().get(lease4, 0) >= 3, 30, "traffic on a worker started after the outage")
        assert cluster.workers_seen() == 3

    await load.run_while(scenario)
    assert load.failures == []
    assert w1.proc.poll() is None and w2.proc.poll() is None


async def test_sigterm_while_etcd_is_down_drains_and_exits(cluster_factory, etcd):
    cluster = cluster_factory(lease_ttl=LEASE_TTL)
    w1, _ = cluster.worker()
    cluster.worker()
    wait_healthy(cluster.url, proc=cluster.frontend.proc)
    await _until(lambda: cluster.workers_seen() == 2, 60, "two workers")
    load = Load(cluster.url, max_requests=2000)

    async def scenario():
        await _until(lambda: load.done >= 20, 60, "warm load")
        etcd.kill()
        w1.signal(signal.SIGTERM)  # it cannot unregister: it drains and exits all the same
        await asyncio.to_thread(w1.proc.wait, 40)
        done = load.done
        await _until(lambda: load.done >= done + 20, 60, "load on the other worker")
        etcd.start()

    await load.run_while(scenario)
    assert load.failures == []
    assert w1.proc.returncode == 0, w1.log()


async def test_revoked_lease_with_a_short_ttl_drains_and_exits(cluster_factory, etcd):
    cluster = cluster_factory(lease_ttl=LEASE_TTL)
    w1, lease1 = cluster.worker()
    cluster.worker()
    wait_healthy(cluster.url, proc=cluster.frontend.proc)
    await _until(lambda: cluster.workers_seen() == 2, 60, "two workers")
    load = Load(cluster.url, max_requests=2000)

    async def scenario():
        await _until(lambda: cluster.routed().get(lease1, 0) >= 5, 60, "traffic on worker 1")
        etcd.etcdctl("lease", "revoke", f"{lease1:x}")
        await asyncio.to_thread(w1.proc.wait, 40)
        done = load.done
        await _until(lambda: load.done >= done + 20, 60, "load after the revoke")

    await load.run_while(scenario)
    assert load.failures == []
    assert w1.proc.returncode == 0
    assert "revoked; shutting down gracefully" in w1.log()


async def test_nats_request_plane_streams_and_cancels_across_processes(cluster_factory):
    cluster = cluster_factory(request_plane="nats")
    # speedup 0.1: ~57 ms a decode step, so the 1,500-token stream below would run for
    # over a minute by itself; its end within the deadline is the worker stopping it
    worker = cluster._spawn("worker", "--speedup", "0.1", "--grace", "20", "--metrics-port", "0")
    worker_metrics = f"http://{worker.wait_ready()['metrics_address']}/metrics"
    wait_healthy(cluster.url, proc=cluster.frontend.proc)

    def worker_blocks() -> float:  # the worker's own view: KV blocks its engine holds
        text = httpx.get(worker_metrics).text
        return float(re.search(r'^kvmesh_disagg_active_blocks\{role="aggregated",worker_id="[0-9a-f]+"\} ([0-9.e+]+)$', text, re.M).group(1))

    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    resp = await client.completions.create(model="kvmesh-tiny", prompt="x", max_tokens=5, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 5
    # a long stream left early: the worker stops generating (its in-flight gauge returns to 0)
    stream = await client.completions.create(
        model="kvmesh-tiny", prompt="y", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    async for _ in stream:
        break
    await _until(lambda: worker_blocks() > 0, 30, "the long stream holding KV blocks on the worker")
    await stream.close()
    await _until(lambda: worker_blocks() == 0, 30, "the worker to stop the stream and free its blocks")
    await _until(lambda: "kvmesh_frontend_inflight_requests{model=\"kvmesh-tiny\"} 0.0" in httpx.get(cluster.url + "/metrics").text, 30, "in-flight back to 0")
    await client.close()
