"""nats-server SIGKILLed and restarted under streamed load, with the NATS request plane
and the JetStream prefill queue in use: `kvmesh frontend`, two decode workers and a
prefill worker, the openai client. No request fails, and every text equals the
undisturbed run's (the mocker is deterministic), whether its request was in flight at
the cut, sent while the plane was down (it waits for the plane and is sent again), or
its prefill job was lost with the server (the decode worker prefills locally). Every
prompt is new, so every long one goes through the JetStream queue."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

import openai
import pytest

from tests.e2e.test_distributed import _runtime_env
from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(240)]

MAX_TOKENS = 16
CONCURRENCY = 8


def _prompt(i: int) -> list[int]:
    n = 500 if i % 2 else 40  # long ones go to the prefill worker (threshold 300)
    return [(k * 7 + i * 31) % 1500 + 20 for k in range(n)]


class Stream:
    def __init__(self, url: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=90)

    async def text(self, i: int) -> str:
        stream = await self.client.completions.create(
            model="kvmesh-tiny", prompt=_prompt(i), max_tokens=MAX_TOKENS, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join([c.choices[0].text async for c in stream if c.choices])


async def test_nats_restart_mid_load_loses_nothing(tmp_path, etcd, nats):
    env = dict(_runtime_env(etcd, nats, request_plane="nats"), KVMESH_NAMESPACE="outage")
    port = free_port()
    procs = [KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), "--canary-interval", "0", env=env)]
    common = (
        "--speedup", "5", "--max-local-prefill-length", "300", "--remote-prefill-timeout", "3", "--grace", "15",
        "--metrics-port", "0",
    )  # fmt: skip
    for mode in ("decode", "decode", "prefill"):
        procs.append(KvmeshProcess(tmp_path, "worker", "--mode", mode, *common, env=env))
    try:
        cards = [p.wait_ready() for p in procs[1:]]
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=procs[0].proc)
        client = Stream(url)
        await client.text(10_000)  # warm-up
        sent, failures, results = 0, [], []
        longest = 0.0
        stop = asyncio.Event()

        async def loop(worker: int) -> None:
            nonlocal sent, longest
            i = worker
            while not stop.is_set() and sent < 600:
                sent += 1
                started = time.monotonic()
                try:
                    results.append((i, await client.text(i)))  # every prompt new: no prefix hits
                except Exception as exc:  # noqa: BLE001 - collected and asserted on
                    failures.append(repr(exc))
                longest = max(longest, time.monotonic() - started)
                i += CONCURRENCY

        loops = [asyncio.ensure_future(loop(w)) for w in range(CONCURRENCY)]
        for _ in range(2):  # twice: which process reconnects first varies
            mark = len(results)
            while len(results) < mark + 20:
                await asyncio.sleep(0.05)
            nats.kill()
            await asyncio.sleep(4)
            nats.start()  # same port, same JetStream store
        after = len(results)
        deadline = time.monotonic() + 60
        while len(results) < after + 30 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 120)
        print(f"sent {sent}, completed {len(results)}, failed {len(failures)}, longest stall {longest:.1f} s")
        assert failures == [], failures[:3]
        assert len(results) >= after + 30, "load did not resume after the restart"
        expected = await _undisturbed(client, [i for i, _ in results])
        await client.client.close()
        differ = [i for i, text in results if text != expected[i]]
        assert differ == [], f"{len(differ)} texts differ from the undisturbed run's"
        assert all(p.proc.poll() is None for p in procs), "a process died with the NATS restart"
        counters = _disagg_counters([c["metrics_address"] for c in cards[:2]])
        print("decode workers:", counters)
        assert counters["remote_prefills"] > 0, "the JetStream prefill queue was not used"
    finally:
        for p in reversed(procs):
            p.stop()


def _disagg_counters(addresses: list[str]) -> dict[str, float]:
    """The decode workers' remote prefills and fallbacks to local ones, summed."""
    totals = {"remote_prefills": 0.0, "remote_fallbacks": 0.0, "local_prefills": 0.0}
    for address in addresses:
        text = httpx.get(f"http://{address}/metrics").text
        for name in totals:
            found = re.search(rf"^kvmesh_disagg_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            totals[name] += float(found.group(1)) if found else 0.0
    return totals


async def _undisturbed(client: Stream, prompts: list[int]) -> dict[int, str]:
    """Each prompt's text from a run with nothing broken (8 at a time)."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> tuple[int, str]:
        async with gate:
            return i, await client.text(i)

    return dict(await asyncio.gather(*(one(i) for i in prompts)))
