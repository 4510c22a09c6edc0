"""The planner scales a real fleet: ``kvmesh run --planner --workers 1 --min-workers 1
--max-workers 4`` (mocker workers slow enough that a burst of streams saturates one
worker: two sequences per batch, TTFT SLO 400 ms). A load ramp from the official
openai client (async, a bounded number of streams): a light phase (one stream, the
fleet stays at 1), a heavy phase (twelve streams: requests queue, TTFT passes the SLO,
the planner starts worker processes that join routing once READY), a light phase again
(two streams: the planner drains and stops workers under that traffic, down to the
minimum) and the end of the load. Every stream must
end whole (0 failed requests, none cut: a scale-down drains first). Conditions are
waited on, never times; the fleet's size over time is printed from the samples."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import openai
import pytest

from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

MAX_TOKENS = 12
ARGS = (
    "--planner", "--min-workers", "1", "--max-workers", "4", "--planner-interval", "0.25",
    "--planner-cooldown", "0.5", "--planner-hold-rounds", "2", "--slo-ttft-ms", "400", "--slo-tpot-ms", "1000",
    "--max-num-seqs", "2", "--canary-interval", "0", "--admin",
)  # fmt: skip


def _serving(url: str) -> int:
    """Workers the frontend routes to (the planner publishes a started one once READY)."""
    return len(httpx.get(url + "/admin/workers", timeout=10).json()["workers"])


def _decisions(url: str, action: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(rf'kvmesh_planner_decisions_total\{{action="{action}",role="aggregated"\}} ([0-9.e+]+)', text)
    return sum(float(v) for v in found)


class Sizes:
    """The fleet's size sampled in a thread: (seconds since start, serving workers)."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self.stop = url, [(0.0, _serving(url))], threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                n = _serving(self.url)
            except httpx.HTTPError:
                continue
            if n != self.samples[-1][1]:
                self.samples.append((round(time.monotonic() - self.t0, 1), n))

    @property
    def now(self) -> int:
        return self.samples[-1][1]

    def changes(self) -> str:
        return " ".join(f"{t}s:{n}" for t, n in self.samples)


class Ramp:
    """``streams`` concurrent streaming completions (the official async client) on
    an event loop in a thread; ``set(n)`` changes the concurrency. Bounded: at most
    ``budget`` requests in all. Every failure and every cut stream is kept."""

    def __init__(self, url: str, budget: int = 4000) -> None:
        self.url, self.budget = url, budget
        self.want, self.done, self.started = 0, 0, 0
        self.failures: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.tasks: list[asyncio.Task[None]] = []
        self.clients: list[openai.AsyncOpenAI] = []

    async def _one(self, client: openai.AsyncOpenAI) -> None:
        stream = await client.completions.create(
            model="kvmesh-tiny", prompt="def f(x):", max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish, tokens = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        if finish != "length" or tokens != MAX_TOKENS:
            raise AssertionError(f"cut stream: finish={finish} tokens={tokens}")

    async def _client(self, slot: int, client: openai.AsyncOpenAI) -> None:
        while slot < self.want and self.started < self.budget:
            self.started += 1
            try:
                await self._one(client)
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on
                self.failures.append(repr(exc))

    def set(self, streams: int) -> None:
        async def go() -> None:
            self.want = streams
            client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)
            self.clients.append(client)
            self.tasks = [t for t in self.tasks if not t.done()]
            for slot in range(len(self.tasks), streams):
                self.tasks.append(asyncio.get_running_loop().create_task(self._client(slot, client)))

        asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def __enter__(self) -> Ramp:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        async def drain() -> None:
            self.want = 0
            await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 60)
            for client in self.clients:
                await client.close()

        asyncio.run_coroutine_threadsafe(drain(), self.loop).result(70)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()  # else its self-pipe is found unclosed by a later test's GC (ResourceWarning)


def _wait(predicate, timeout: float, what) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


@pytest.mark.timeout(150)
def test_a_load_ramp_grows_the_fleet_and_its_end_shrinks_it_with_no_failed_request(tmp_path):
    with kvmesh_run(tmp_path, *ARGS, workers=1, speedup="0.25") as server:
        url = server.url
        _wait(lambda: _serving(url) == 1, 60, "the first worker routed")
        sizes = Sizes(url)
        sizes.thread.start()
        try:
            with Ramp(url) as ramp:
                ramp.set(1)  # light: one stream fits one worker's batch
                _wait(lambda: ramp.done >= 10, 60, "the light phase")
                assert sizes.now == 1 and _decisions(url, "start") == 0, f"no start under light load ({sizes.changes()})"
                ramp.set(12)  # heavy: queues on one worker (2 per batch): TTFT over its SLO
                _wait(lambda: sizes.now >= 3, 60, lambda: f"the fleet grown ({sizes.changes()}):\n{server.log()[-3000:]}")
                grown = ramp.done
                _wait(lambda: ramp.done >= grown + 20, 60, "load over the grown fleet")
                ramp.set(2)  # down to what one worker carries: workers drain and stop under traffic
                _wait(lambda: sizes.now == 1, 60, lambda: f"the fleet shrunk ({sizes.changes()}):\n{server.log()[-3000:]}")
                shrunk = ramp.done
                _wait(lambda: ramp.done >= shrunk + 10, 60, "load over the shrunk fleet")
                ramp.set(0)  # the load ends: every stream still running finishes
        finally:
            sizes.stop.set()
            sizes.thread.join(5)
        assert ramp.failures == [], ramp.failures[:5]
        assert max(n for _, n in sizes.samples) <= 4
        assert _decisions(url, "start") >= 2 and _decisions(url, "stop") >= 2
        # the stopped workers' processes are gone (drained and ended), one is left
        _wait(lambda: len(server.worker_pids()) == 1, 30, lambda: f"one worker process ({server.worker_pids()})")
        print(f"fleet size over time: {sizes.changes()}; {ramp.done} requests, 0 failed")


@pytest.mark.timeout(150)
def test_a_planned_run_whose_workers_cannot_start_gives_up_with_the_engines_error():
    """Under the planner a worker that cannot start is started again (the first ones
    by the fleet, later ones by the planner) and the failed starts count: kvmesh run
    exits 1 with the worker's own error instead of waiting forever with no worker."""
    import subprocess
    import sys

    from tests.helpers import free_port

    argv = ["run", "--planner", "--min-workers", "1", "--max-workers", "2", "--fault", "start", "--workers", "1",
            "--max-failed-starts", "3", "--planner-interval", "0.2", "--http-port", str(free_port())]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "kvmesh.cli.main", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == "kvmesh run: 3 worker starts in a row failed; the last: RuntimeError: mocker fault 'start': the engine refuses to start", r.stderr[-3000:]
