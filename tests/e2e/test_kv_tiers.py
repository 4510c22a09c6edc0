"""KV tiers on a real ``kvmesh run`` (issue 33): a prompt its worker's device pool
evicted comes back from the host tier, and the router, fed the workers' tier events
over the event plane, says so in ``router_explain``."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.helpers import kvmesh_run

pytestmark = pytest.mark.timeout(90)


def _words(seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(40))


def _route(client: openai.OpenAI, prompt: str) -> tuple[dict[str, object], int]:
    """The router's explanation of a completion of ``prompt``, and its cached prompt tokens."""
    raw = client.completions.with_raw_response.create(
        model="kvmesh-tiny", prompt=prompt, max_tokens=2, extra_body={"router_explain": True}
    )
    body = raw.parse()
    details = body.usage.prompt_tokens_details if body.usage is not None else None
    cached = getattr(details, "cached_tokens", 0) or 0
    return body.model_extra["kvmesh_route"], cached  # type: ignore[index]  # the body's extra field


def test_an_evicted_prompt_comes_back_from_the_host_tier(tmp_path: Path) -> None:
    args = ("--router-mode", "kv", "--num-blocks", "12", "--host-kv-blocks", "64", "--canary-interval", "0")
    with kvmesh_run(tmp_path, *args, workers=1) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        a = _words(1)
        _route(client, a)
        _route(client, _words(2))  # fills the device pool: a's blocks are written down
        deadline = time.monotonic() + 30
        while True:  # the events travel on the event plane: wait until the router has them
            route, cached = _route(client, a)
            tiers = [c.get("tier_blocks") for c in route["candidates"]]  # type: ignore[union-attr]
            if tiers[0] is not None or time.monotonic() > deadline:
                break
            _route(client, _words(2))  # push a out again
            time.sleep(0.2)
        assert tiers[0] is not None and tiers[0]["g2"] > 0, route  # type: ignore[index]
        assert cached > 0  # a's prefix was onboarded, not computed again
