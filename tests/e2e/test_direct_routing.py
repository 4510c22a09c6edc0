"""Direct routing (issue 32, item 4): ``x-kvmesh-worker: <worker id, hex>`` pins a
request to one worker (canaries, debugging), through the push router's ``direct``
mode (``RoutingHints.worker_id``). It is an admin's tool: honoured only with
``--admin``, and with API keys only beside the admin key (``x-kvmesh-admin-key``;
without it a 403 that says so); without ``--admin`` the header is ignored (never
looked at). A bad id is a 400 naming the header; a worker that does not serve is a 503
(the request never goes elsewhere). Where a request went is read from the
``x-kvmesh-route`` header (``x-kvmesh-explain: 1``)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.test_health import _wait, _workers
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

BODY = {"model": "kvmesh-tiny", "prompt": "def f():", "max_tokens": 4, "stream": True}


def _route(url: str, headers: dict[str, str]) -> tuple[int, str]:
    """(status, the worker it went to, or the error body)."""
    with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=30,
                      headers={"x-kvmesh-explain": "1", **headers}) as r:  # fmt: skip
        text = r.read().decode()
        if r.status_code != 200:
            return r.status_code, text
        assert "[DONE]" in text
        return 200, json.loads(r.headers["x-kvmesh-route"])["worker"]


def test_an_admin_pins_a_worker_and_bad_pins_are_clear_4xx_and_503(tmp_path):
    with kvmesh_run(tmp_path, "--admin", "--canary-interval", "0", workers=2) as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 2, 60, "two workers routed")
        first, second = sorted(_workers(url))
        for target in (second, first):
            assert {_route(url, {"x-kvmesh-worker": target}) for _ in range(6)} == {(200, target)}
        status, body = _route(url, {"x-kvmesh-worker": "not-hex"})
        assert status == 400 and "x-kvmesh-worker" in body
        status, body = _route(url, {"x-kvmesh-worker": "fffffff0"})
        assert status == 503 and "pinned" in body
        # unpinned requests still spread over both
        assert {_route(url, {})[1] for _ in range(8)} == {first, second}


def test_without_admin_the_header_is_ignored(tmp_path):
    with kvmesh_run(tmp_path, "--canary-interval", "0", workers=2) as server:
        url = server.url
        _wait(lambda: len({_route(url, {})[1] for _ in range(4)}) == 2, 60, "both workers serving")
        seen = {_route(url, {"x-kvmesh-worker": "0"}) for _ in range(8)}
        assert {status for status, _ in seen} == {200} and len(seen) == 2, seen
