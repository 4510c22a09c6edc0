"""Attack: a keyed caller pins a worker of its choosing (``x-kvmesh-worker``, direct
routing: an admin's tool for canaries and debugging) to aim its load at one worker.
With API keys the pin is honoured only beside the admin key (``x-kvmesh-admin-key``);
a user key alone, or a wrong admin key, gets a 403 that says what the header needs."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_direct_routing import _route
from tests.e2e.test_health import _wait
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

KEY, ADMIN_KEY = "sk-direct-routing-user", "sk-direct-routing-admin"


def test_with_api_keys_a_pin_needs_the_admin_key(tmp_path):
    args = ("--api-key", KEY, "--admin", "--admin-key", ADMIN_KEY, "--canary-interval", "0")
    with kvmesh_run(tmp_path, *args, workers=2) as server:
        url, user = server.url, {"authorization": f"Bearer {KEY}"}
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        _wait(lambda: len(httpx.get(url + "/admin/workers", headers=admin).json()["workers"]) == 2, 60, "two workers")
        target = sorted(w["worker"] for w in httpx.get(url + "/admin/workers", headers=admin).json()["workers"])[1]
        status, body = _route(url, {**user, "x-kvmesh-worker": target})
        assert status == 403 and "x-kvmesh-admin-key" in body
        status, body = _route(url, {**user, "x-kvmesh-worker": target, "x-kvmesh-admin-key": "wrong"})
        assert status == 403
        pinned = {**user, "x-kvmesh-worker": target, "x-kvmesh-admin-key": ADMIN_KEY}
        assert {_route(url, pinned) for _ in range(6)} == {(200, target)}
