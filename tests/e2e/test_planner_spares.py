"""The planner with a hot spare, on real processes: ``kvmesh run --workers 2
--hot-spares 1 --planner`` under steady streaming load (the official openai client);
a serving worker is SIGKILLed by PID; no request fails (in-flight streams migrate),
the spare is promoted and routed to, and a new spare is started and checked in the
background. Conditions are waited on; no wall-clock asserts: the time from the loss
to the promoted spare being routable is printed from the run's log (the figure and
its cold-start comparison are in bench/planner_spares.py)."""

from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import openai
import pytest

from tests.e2e.test_health import _wait, _workers
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

MAX_TOKENS = 24
ARGS = ("--planner", "--hot-spares", "1", "--planner-interval", "0.5", "--admin", "--canary-interval", "1")


def _metric(url: str, pattern: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(pattern, text))


def _ready_spares(url: str) -> float:
    return _metric(url, r'kvmesh_planner_workers\{role="spare"\} ([0-9.e+]+)')


def _routed(url: str, worker: str) -> float:
    return _metric(url, rf'kvmesh_router_decisions_total\{{model="kvmesh-tiny",worker="{worker}"\}} ([0-9.e+]+)')


class Load:
    """Streaming completions from a few threads until stopped; every failure kept."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        self.done, self.failures = 0, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _one(self) -> None:
        stream = self.client.completions.create(
            model="kvmesh-tiny", prompt="def f(x):", max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish, tokens = None, None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        if finish != "length" or tokens != MAX_TOKENS:
            raise AssertionError(f"truncated stream: finish={finish} tokens={tokens}")

    def _loop(self) -> None:
        while not self.stop.is_set() and self.done < 5000:
            try:
                self._one()
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on
                self.failures.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        self.client.close()


def test_a_killed_worker_is_replaced_by_its_hot_spare_with_no_failed_request(tmp_path):
    with kvmesh_run(tmp_path, *ARGS, workers=2, speedup="20") as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 2 and _ready_spares(url) == 1, 60, "2 serving workers and a checked spare")
        serving = _workers(url)
        spare_pids = set(server.worker_pids()) - {w["pid"] for w in serving.values()}
        assert len(spare_pids) == 1, "the spare runs but is not routed to"
        victim_id, victim = sorted(serving.items())[0]
        with Load(url) as load:
            _wait(lambda: load.done >= 20, 60, "warm load")
            assert _routed(url, victim_id) > 0
            os.kill(victim["pid"], signal.SIGKILL)
            # capacity back: two routable workers again, the spare among them
            _wait(lambda: len(w := _workers(url)) == 2 and victim_id not in w, 30, lambda: f"the spare promoted ({_workers(url)})")
            promoted = [w for w, v in _workers(url).items() if v["pid"] in spare_pids]
            assert promoted, f"the promoted worker is the spare ({_workers(url)}, spare pids {spare_pids})"
            # a new spare is started and checked in the background
            _wait(lambda: _ready_spares(url) == 1, 60, "a new hot spare")
            done = load.done
            _wait(lambda: load.done >= done + 20 and _routed(url, promoted[0]) > 0, 60, "load on the promoted spare")
        assert load.failures == [], load.failures[:5]
        assert _metric(url, r'kvmesh_planner_replacement_seconds_count\{how="promote"\} ([0-9.e+]+)') == 1
        assert _metric(url, r'kvmesh_planner_decisions_total\{action="promote",role="aggregated"\} ([0-9.e+]+)') == 1
        assert _metric(url, r'kvmesh_planner_decisions_total\{action="start",role="spare"\} ([0-9.e+]+)') >= 1
        figure = re.findall(r"routable ([0-9.]+) s after the loss \(promote\)", server.log())
        print(f"spare promoted: routable {figure[0]} s after the loss (planner log), {load.done} requests, 0 failed")


def test_disaggregated_the_decode_spare_takes_over_a_killed_decode_worker(tmp_path):
    args = ("--prefill-workers", "1", "--decode-workers", "2", "--max-local-prefill-length", "8", *ARGS)
    with kvmesh_run(tmp_path, *args, workers=1, speedup="20") as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 2 and _ready_spares(url) == 1, 60, "2 decode workers and a checked spare")
        serving = _workers(url)
        victim_id, victim = sorted(serving.items())[0]
        with Load(url) as load:
            _wait(lambda: load.done >= 20, 60, "warm load")
            os.kill(victim["pid"], signal.SIGKILL)
            _wait(lambda: len(w := _workers(url)) == 2 and victim_id not in w, 30, lambda: f"the spare promoted ({_workers(url)})")
            _wait(lambda: _ready_spares(url) == 1, 60, "a new hot spare")
            done = load.done
            _wait(lambda: load.done >= done + 20, 60, "load after the promotion")
        assert load.failures == [], load.failures[:5]
        assert _metric(url, r'kvmesh_planner_decisions_total\{action="promote",role="decode"\} ([0-9.e+]+)') == 1
        assert re.search(r'kvmesh_planner_input\{signal="prefill_queue_tokens"\}', httpx.get(url + "/metrics").text)
