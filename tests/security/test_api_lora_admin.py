"""The LoRA admin routes (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)
make workers read a folder on their host: only the admin may call them. Attacks on a
real ``kvmesh run``: a user's API key, no key, a cross-site text/plain POST with the
admin key, a DNS-rebinding Host without keys; and without ``--admin`` the routes do
not exist."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import kvmesh_run

pytestmark = pytest.mark.processes

USER, ADMIN = "sk-lora-user-0123456789", "sk-lora-admin-0123456789"
BODY = {"lora_name": "x", "lora_path": "/etc"}
ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@pytest.mark.timeout(90)
def test_only_the_admin_key_moves_adapters(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_API_KEY", USER)
    monkeypatch.setenv("KVMESH_ADMIN_KEY", ADMIN)
    with kvmesh_run(tmp_path, "--admin", "--canary-interval", "0", workers=1) as server:
        for route in ROUTES:
            url = server.url + route
            assert httpx.post(url, json=BODY).status_code == 401
            assert httpx.post(url, json=BODY, headers={"authorization": f"Bearer {USER}"}).status_code == 401
            assert httpx.post(url, json=BODY, headers={"x-api-key": USER}).status_code == 401
            cross_site = httpx.post(url, content=b'{"lora_name": "x", "lora_path": "/etc"}',
                                    headers={"authorization": f"Bearer {ADMIN}", "content-type": "text/plain"})  # fmt: skip
            assert cross_site.status_code == 415
        # the admin key is no API key: it does not open the generation routes
        gen = httpx.post(server.url + "/v1/completions", json={"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 1},
                         headers={"authorization": f"Bearer {ADMIN}"})  # fmt: skip
        assert gen.status_code == 401
        # the admin's load of a folder that is no adapter: a 400 that does not echo the host's path
        bad = httpx.post(server.url + ROUTES[0], json=BODY, headers={"authorization": f"Bearer {ADMIN}"})
        assert bad.status_code == 400 and "/etc" not in bad.text


@pytest.mark.timeout(90)
def test_without_admin_no_routes_and_without_keys_no_rebinding(tmp_path) -> None:
    with kvmesh_run(tmp_path, "--canary-interval", "0", workers=1) as server:
        for route in ROUTES:
            assert httpx.post(server.url + route, json=BODY).status_code == 404
    with kvmesh_run(tmp_path, "--admin", "--canary-interval", "0", workers=1) as server:
        for route in ROUTES:
            rebound = httpx.post(server.url + route, json=BODY, headers={"host": f"attacker.example:{server.port}"})
            assert rebound.status_code == 403
