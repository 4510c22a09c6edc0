"""/dashboard without a browser: a self-contained page, its event stream, its bound."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from kvmesh.frontend.dashboard import MAX_STREAMS
from tests.helpers import InProcessStack

pytestmark = pytest.mark.timeout(20)


async def test_page_is_self_contained_and_events_describe_the_fleet() -> None:
    async with InProcessStack().running() as stack:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            page = await client.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            # nothing loaded from elsewhere: no URL, no src/href attribute, no import
            assert not re.search(r"https?://|\bsrc=|\bhref=|@import|//cdn", page.text), "the page loads an external asset"
            async with client.stream("GET", "/dashboard/events") as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        snap = json.loads(line[6:])
                        break
            assert [w["id"] for w in snap["workers"]] == ["0"]
            w = snap["workers"][0]
            assert w["kv_total"] > 0 and w["role"] == "aggregated" and w["in_flight"] == 0
            assert set(snap["series"]) == {"rate", "ttft_ms", "itl_ms"}
            # a closed page's stream ends on the server; the number of open ones is bounded
            while stack.frontend.dashboard.streams:
                await asyncio.sleep(0.05)
            stack.frontend.dashboard.streams = MAX_STREAMS
            refused = await client.get("/dashboard/events")
            assert refused.status_code == 503 and "retry-after" in refused.headers
            stack.frontend.dashboard.streams = 0
