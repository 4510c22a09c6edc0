"""An idle SSE stream receives ``: keep-alive`` comments at the configured interval
(``--keepalive``), so proxies and clients do not time it out, and they stop when
the client leaves."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers import kvmesh_run
from tests.security._edge import MODEL

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

INTERVAL = 0.3


def test_an_idle_stream_gets_keep_alive_comments_at_the_interval(tmp_path):
    # speedup 0.001: one engine step takes seconds, so the stream stays idle
    with kvmesh_run(tmp_path, "--keepalive", str(INTERVAL), "--canary-interval", "0", workers=1, speedup="0.001") as srv:
        body = {"model": MODEL, "prompt": "def f():", "max_tokens": 2, "stream": True}
        seen: list[float] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line == ": keep-alive":
                    seen.append(time.monotonic())
                elif line.startswith("data:"):
                    break  # the engine produced something: the stream is not idle any more
                if len(seen) >= 4:
                    break
        assert len(seen) >= 4, seen
        gaps = [b - a for a, b in zip(seen, seen[1:])]
        # never more often than the interval (the sweep may add up to a quarter of it, load more)
        assert min(gaps) >= INTERVAL * 0.7, gaps
