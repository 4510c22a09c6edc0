"""/dashboard in a real browser: headless Chromium loads the page from a live
``kvmesh run``; the rendered page lists every worker, and after a worker is SIGKILLed
it shows that worker gone and its replacement, without a reload (server-sent events).
A screenshot is saved (``KVMESH_TEST_ARTIFACTS``, else the test's tmp dir)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.cdp import Chromium
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

ROWS = "JSON.stringify([...document.querySelectorAll('tr[data-worker]')].map(r => [r.dataset.worker, r.dataset.health]))"


def _worker_ids(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return set(re.findall(r'^kvmesh_worker_kv_blocks_total\{[^}]*worker_id="([0-9a-f]+)"', text, re.M))


def _wait(cond, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_dashboard_lists_workers_and_shows_a_killed_one_replaced(tmp_path: Path) -> None:
    artifacts = Path(os.environ.get("KVMESH_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    with kvmesh_run(tmp_path, "--router-mode", "kv", workers=3) as server:
        body = {"model": "kvmesh-tiny", "prompt": "a dashboard test", "max_tokens": 8, "ignore_eos": True}
        for _ in range(6):
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        before = _wait(lambda: ids if len(ids := _worker_ids(server.url)) == 3 else None, 30, "3 workers")
        browser = Chromium()
        try:
            browser.open(server.url + "/dashboard")

            def rows() -> dict[str, str]:
                return dict(json.loads(browser.poll(ROWS) or "[]"))  # poll: the first load may be under way

            shown = _wait(lambda: r if set(r := rows()) == before else None, 30, f"the page to list {before}")
            assert set(shown.values()) == {"healthy"}, shown
            assert browser.evaluate("document.getElementById('router').textContent") == "kv"
            assert browser.evaluate("document.getElementById('decisions').rows.length") >= 1
            stamp = browser.evaluate("document.body.dataset.updated")
            stop, statuses = threading.Event(), []

            def load() -> None:  # traffic while the operator watches (and a worker dies)
                with httpx.Client(timeout=30) as client:
                    while not stop.is_set():
                        statuses.append(client.post(server.url + "/v1/completions", json=body).status_code)
                        time.sleep(0.02)

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            _wait(lambda: float(browser.evaluate("document.getElementById('rate').textContent") or 0) > 0, 30,
                  "the request-rate sparkline to move")  # fmt: skip

            victim = server.worker_pids()[0]
            os.kill(victim, signal.SIGKILL)

            def replaced() -> dict[str, str] | None:
                r = rows()
                gone = [w for w, h in r.items() if h == "gone"]
                fresh = [w for w, h in r.items() if w not in before and h != "gone"]
                return r if len(gone) == 1 and gone[0] in before and len(fresh) == 1 else None

            try:
                after = _wait(replaced, 60, "the page to show the killed worker gone and its replacement")
            finally:
                stop.set()
                loader.join(30)
            assert statuses and set(statuses) == {200}, statuses  # no client saw the worker die
            assert browser.evaluate("document.body.dataset.updated") != stamp  # updated live, no reload
            time.sleep(1.2)  # one more event, so the screenshot shows the sparklines' latest point
            shot = artifacts / "dashboard.png"
            browser.screenshot(str(shot))
            assert shot.stat().st_size > 10_000
            assert len([h for h in after.values() if h == "healthy"]) >= 2
        finally:
            browser.close()
