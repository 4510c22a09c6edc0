"""Disaggregated serving with real etcd and a real nats-server (JetStream prefill queue):
`kvmesh frontend`, decode and prefill `kvmesh worker` processes, the openai client.

Long prompts go to the prefill workers and short ones stay local (the workers' own
counters say so), a full queue forces local prefill, thresholds change at run time
through discovery, prefill workers join and leave under load with no failed request,
and a drained worker hands its in-flight requests (with their KV) to another one;
every stream equals the aggregated run's."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess

import httpx
import msgspec
import openai
import pytest

from tests.e2e.test_distributed import _runtime_env
from tests.helpers import worker_disagg_stats, KvmeshProcess, free_port, wait_healthy
from tests.services import binary

pytestmark = [pytest.mark.processes, pytest.mark.slow]

LONG, SHORT = 700, 60  # prompt tokens; the decode workers' threshold is 300


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 13 + salt * 101) % 1800 + 20 for i in range(n)]


class Fleet:
    def __init__(self, tmp_path, etcd, nats, namespace: str) -> None:
        self.tmp_path = tmp_path
        self.etcd = etcd
        self.env = dict(_runtime_env(etcd, nats), KVMESH_NAMESPACE=namespace)
        self.namespace = namespace
        self.port = free_port()
        self.procs: list[KvmeshProcess] = []
        self._client: openai.AsyncOpenAI | None = None
        self.cards: dict[str, dict] = {}  # READY cards by request-plane address
        self.frontend = self._spawn("frontend", "--http-port", str(self.port), "--canary-interval", "0")

    def _spawn(self, role: str, *args: str) -> KvmeshProcess:
        proc = KvmeshProcess(self.tmp_path, role, *args, env=self.env)
        self.procs.append(proc)
        return proc

    def worker(self, mode: str, *args: str, speedup: str = "20") -> tuple[KvmeshProcess, str]:
        proc = self._spawn(
            "worker", "--mode", mode, "--speedup", speedup, "--max-local-prefill-length", "300", "--grace", "15", *args
        )
        card = proc.wait_ready()
        self.cards[card["address"]] = card
        return proc, card["address"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.AsyncOpenAI:
        if self._client is None:
            self._client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def set_thresholds(self, max_local: int, max_queue: int) -> None:
        value = msgspec.json.encode({"max_local_prefill_length": max_local, "max_prefill_queue_size": max_queue})
        subprocess.run(
            [binary("etcdctl"), "--endpoints", self.etcd.endpoint, "put", f"/disagg/{self.namespace}/thresholds", value],
            check=True, capture_output=True,
        )  # fmt: skip

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


stats = worker_disagg_stats  # the worker counters the tests read


async def until(check, timeout: float, what: str) -> None:
    """Wait for ``await check()`` to be true (a generous deadline, not a measurement)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


def _frontend_workers(url: str) -> int:
    return httpx.get(url + "/health").json()["models"].get("kvmesh-tiny", 0)


async def complete(client: openai.AsyncOpenAI, tokens: list[int], max_tokens: int = 16) -> str:
    stream = await client.completions.create(
        model="kvmesh-tiny", prompt=tokens, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
    )
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length", finish
    return text


@pytest.fixture
async def fleets(tmp_path, etcd, nats):
    made: list[Fleet] = []

    def make(namespace: str) -> Fleet:
        fleet = Fleet(tmp_path, etcd, nats, namespace)
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        await fleet.aclose()
        fleet.close()


async def test_disaggregated_serving_end_to_end(fleets) -> None:
    agg = fleets("agg")
    agg.worker("aggregated")
    dis = fleets("dis")
    _, decode = dis.worker("decode", "--metrics-port", "0")
    prefills = [dis.worker("prefill", speedup="0.5")[1] for _ in range(2)]  # a 700-token prefill: ~55 ms
    wait_healthy(agg.url)
    wait_healthy(dis.url)
    prompts = [prompt(LONG, i) for i in range(4)] + [prompt(SHORT, 10 + i) for i in range(4)]

    # one at a time: long prompts go remote, short ones stay local
    got = [await complete(dis.client(), p) for p in prompts]
    s = await stats(decode)
    assert (s.remote_prefills, s.local_prefills, s.remote_fallbacks) == (4, 4, 0), s
    done = [(await stats(a)).prefill_jobs_done for a in prefills]
    assert sum(done) == 4, done
    assert s.kv_bytes_received > 0 and s.active_blocks == 0
    want = [await complete(agg.client(), p) for p in prompts]
    assert got == want
    metrics = httpx.get(f"http://{dis.cards[decode]['metrics_address']}/metrics").text
    # the worker's own /metrics (labelled by worker and role since the fleet-wide view)
    assert re.search(r'^kvmesh_disagg_remote_prefills_total\{role="decode",worker_id="[0-9a-f]+"\} 4\.0$', metrics, re.M), metrics
    assert re.search(r'^kvmesh_disagg_local_prefills_total\{role="decode",worker_id="[0-9a-f]+"\} 4\.0$', metrics, re.M)

    # queue pressure: 16 long prompts at once, two prefill workers busy ~60 ms a job → the
    # queue reaches its limit of 2 and the decode worker prefills the rest itself
    burst = [prompt(LONG, 100 + i) for i in range(16)]
    before = await stats(decode)
    texts = await asyncio.gather(*(complete(dis.client(), p) for p in burst))
    after = await stats(decode)
    assert after.local_by_queue > before.local_by_queue, after
    assert after.remote_prefills > before.remote_prefills, after
    assert list(texts) == [await complete(agg.client(), p) for p in burst]

    # thresholds change at run time through discovery: nothing is long enough now
    # (the watch delivers it asynchronously: send long prompts until one stays local)
    dis.set_thresholds(5000, 2)
    salt = 500

    async def next_long_prompt_stays_local() -> bool:
        nonlocal salt
        salt += 1
        before = await stats(decode)
        await complete(dis.client(), prompt(LONG, salt))
        after = await stats(decode)
        return after.remote_prefills == before.remote_prefills and after.local_prefills == before.local_prefills + 1

    await until(next_long_prompt_stays_local, 60, "the new thresholds to keep a long prompt local")


async def test_prefill_workers_join_and_leave_under_load(fleets) -> None:
    dis = fleets("xpyd")
    _, decode = dis.worker("decode")
    first, first_addr = dis.worker("prefill")
    wait_healthy(dis.url)
    client = dis.client()
    failures: list[str] = []
    finished = 0
    stop = asyncio.Event()

    async def loop(worker: int) -> None:
        nonlocal finished
        i = 0
        while not stop.is_set() and i < 200:
            i += 1
            try:
                await complete(client, prompt(LONG if i % 2 else SHORT, worker * 1000 + i), max_tokens=8)
                finished += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on
                failures.append(repr(exc))

    async def progress(n: int) -> bool:
        return finished >= n or bool(failures)

    tasks = [asyncio.ensure_future(loop(w)) for w in range(4)]
    await until(lambda: progress(10), 60, "10 requests through the first prefill worker")
    _, second_addr = dis.worker("prefill")  # joins: no registration, it just pulls

    async def second_pulls() -> bool:
        return (await stats(second_addr)).prefill_jobs_done > 0 or bool(failures)

    await until(second_pulls, 60, "the joining prefill worker to take jobs")
    first.signal(signal.SIGTERM)  # leaves: stops pulling, finishes its writes
    await asyncio.to_thread(first.proc.wait, 20)
    left_at = finished
    await until(lambda: progress(left_at + 10), 60, "10 more requests after the first prefill worker left")
    stop.set()
    await asyncio.gather(*tasks)
    assert failures == []
    assert finished > 20
    s = await stats(decode)
    assert s.remote_prefills > 0 and s.remote_fallbacks == 0, s
    assert (await stats(second_addr)).prefill_jobs_done > 0
    assert first.proc.returncode == 0, first.log()
    assert first_addr


async def test_drained_worker_hands_requests_off_with_their_kv(fleets) -> None:
    agg = fleets("ref")
    agg.worker("aggregated", speedup="1e6")
    mig = fleets("mig")
    # 400 tokens at ~24 ms a decode step (speedup 0.25): ~10 s per request, long enough
    # for a second worker to start (slow on a loaded machine) before they end
    source, source_addr = mig.worker("aggregated", "--drain-migrate", speedup="0.25")
    wait_healthy(mig.url)
    wait_healthy(agg.url)
    tokens = [prompt(400, 900 + i) for i in range(3)]
    tasks = [asyncio.ensure_future(complete(mig.client(), t, max_tokens=400)) for t in tokens]
    async def all_three_decoding() -> bool:  # 400 prompt tokens: 25 blocks each
        return (await stats(source_addr)).active_blocks >= 3 * 25

    await until(all_three_decoding, 60, "all three decoding on the only worker")
    target, target_addr = mig.worker("aggregated", speedup="0.25")

    async def frontend_sees_two() -> bool:
        return await asyncio.to_thread(_frontend_workers, mig.url) == 2

    await until(frontend_sees_two, 60, "the frontend to see the new worker")
    assert (await stats(source_addr)).active_blocks >= 3 * 25, "the requests ended before the drain: nothing to migrate"
    source.signal(signal.SIGTERM)
    texts = await asyncio.gather(*tasks)
    assert list(texts) == [await complete(agg.client(), t, max_tokens=400) for t in tokens]
    s = await stats(target_addr)
    assert s.kv_migrations_in == 3 and s.kv_migration_fallbacks == 0, s
    await asyncio.to_thread(source.proc.wait, 20)
    assert source.proc.returncode == 0, source.log()
    assert source_addr
