"""A prefix from a peer on a real ``kvmesh run`` (issue 33): two mocker workers with
``--peer-fetch``; the router (overlap weight 0: it balances load, ties to the worker
holding less) sends the second prompt with a shared prefix to the worker that lacks it,
with a hint naming the worker that holds it; that worker reads the prefix over the
KV-transfer plane (authenticated with the fleet's cluster secret) instead of prefilling it."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import RUN_SECRET, kvmesh_run, worker_disagg_stats

pytestmark = pytest.mark.timeout(90)

ROUTES: list[dict[str, object]] = []
PREFIX = [(i * 11) % 1800 + 20 for i in range(320)]  # 20 blocks of 16


def _complete(client: openai.OpenAI, tokens: list[int]) -> tuple[str, int, int]:
    """The text, the chosen worker and the cached prompt tokens of a completion (and
    the router's explanation in ``ROUTES``)."""
    raw = client.completions.with_raw_response.create(
        model="kvmesh-tiny", prompt=tokens, max_tokens=8, extra_body={"ignore_eos": True, "router_explain": True}
    )
    body = raw.parse()
    details = body.usage.prompt_tokens_details if body.usage is not None else None
    route = body.model_extra["kvmesh_route"]  # type: ignore[index]
    ROUTES.append(route)
    return body.choices[0].text, int(str(route["worker"]), 16), getattr(details, "cached_tokens", 0) or 0


def _metric(url: str, name: str) -> float:
    """``name`` summed over its labels, from the frontend's /metrics."""
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M))


def _events_applied(url: str) -> float:
    return _metric(url, "kvmesh_router_kv_events_applied_total")


def test_the_second_worker_reads_the_prefix_the_first_holds(tmp_path: Path) -> None:
    args = ("--router-mode", "kv", "--peer-fetch", "--kv-overlap-weight", "0", "--canary-interval", "0", "--admin")
    with kvmesh_run(tmp_path, *args, workers=2, speedup="1") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        _, holder, _ = _complete(client, PREFIX + [7, 8, 9])
        deadline = time.monotonic() + 30
        while _events_applied(server.url) < 1:  # the router learns the holder's blocks from its KV events
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        busy = client.completions.create(  # the holder's load: a long prompt with the prefix, a long stream
            model="kvmesh-tiny", prompt=PREFIX + [(i * 5) % 1800 + 30 for i in range(800)], max_tokens=900,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(busy))  # it runs
        prompt = PREFIX + [11, 12, 13, 14]
        text, reader, cached = _complete(client, prompt)
        busy.close()
        assert reader != holder  # the idle worker holding less
        assert cached == 320  # read from the holder, not prefilled
        assert ROUTES[-1]["peer_fetch"] == {"worker": f"{holder:x}", "blocks": 20}  # router_explain says so
        again, _, _ = _complete(client, prompt)  # the same prompt served from a cache: same text
        assert text == again
        client.close()
        listed = httpx.get(server.url + "/admin/workers").json()["workers"]
        workers = {int(str(w["worker"]), 16): w["address"] for w in listed}
        s = asyncio.run(worker_disagg_stats(workers[reader], RUN_SECRET))
        assert (s.peer_fetches, s.peer_fetch_blocks, s.peer_fetch_fallbacks) == (1, 20, 0), s
        assert asyncio.run(worker_disagg_stats(workers[holder], RUN_SECRET)).peer_prefixes_served == 1
        deadline = time.monotonic() + 30
        while _metric(server.url, "kvmesh_disagg_peer_fetches_total") < 1:  # the frontend's /metrics, fleet-wide
            assert time.monotonic() < deadline, httpx.get(server.url + "/metrics").text[-2000:]
            time.sleep(0.2)
        assert _metric(server.url, "kvmesh_disagg_peer_fetch_blocks_total") == 20
