"""API keys, the admin surface and priority tiers on real ``kvmesh run`` processes:
what is open by default, what a key unlocks, and what no client can reach."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import kvmesh_run
from tests.security._edge import MODEL, assert_still_serving

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

KEY = "sk-test-standard-0123456789"
PREMIUM_KEY = "sk-test-premium-0123456789"
ADMIN_KEY = "sk-test-admin-0123456789"
BODY = {"model": MODEL, "prompt": "def f():", "max_tokens": 2}


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("open"), "--canary-interval", "0", workers=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    keys = tmp / "keys"
    keys.write_text(f"# key tier\n{KEY} standard\n{PREMIUM_KEY} premium\n")
    args = ("--api-keys-file", str(keys), "--admin", "--admin-key", ADMIN_KEY, "--canary-interval", "0")
    with kvmesh_run(tmp, *args, workers=1) as srv:
        yield srv


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_admin_routes_are_404_by_default(open_server):
    assert httpx.get(open_server.url + "/admin/workers").status_code == 404
    r = httpx.post(open_server.url + "/admin/fault", json={"worker": "0", "fault": "crash"})
    assert r.status_code == 404
    r = httpx.post(open_server.url + "/admin/fault", content=b'{"worker": "0", "fault": "crash"}', headers={"content-type": "text/plain"})
    assert r.status_code == 404
    assert_still_serving(open_server)


def test_premium_from_a_client_is_refused_without_trust(open_server):
    r = httpx.post(open_server.url + "/v1/completions", json={**BODY, "priority": "premium"})
    assert r.status_code == 403 and "trust-priority-header" in r.json()["error"]["message"]
    r = httpx.post(open_server.url + "/v1/completions", json=BODY, headers={"x-kvmesh-priority": "premium"})
    assert r.status_code == 403
    r = httpx.post(open_server.url + "/v1/completions", json={**BODY, "priority": "best_effort"})
    assert r.status_code == 200


def test_no_key_is_401_in_openai_shape(keyed_server):
    for headers in ({}, _bearer("sk-wrong"), {"authorization": KEY}, {"authorization": "Basic " + KEY}):
        r = httpx.post(keyed_server.url + "/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(keyed_server.url + "/v1/models").status_code == 401


def test_the_openai_client_with_a_key(keyed_server):
    with openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY) as client:
        out = client.completions.create(model=MODEL, prompt="def f():", max_tokens=3)
    assert out.usage.completion_tokens == 3
    with openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sk-nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_health_live_and_metrics_stay_open(keyed_server):
    for path in ("/health", "/live", "/metrics", "/openapi.json"):
        assert httpx.get(keyed_server.url + path).status_code == 200, path


def test_a_key_bounds_the_priority_tier(keyed_server):
    r = httpx.post(keyed_server.url + "/v1/completions", json={**BODY, "priority": "premium"}, headers=_bearer(KEY))
    assert r.status_code == 403
    r = httpx.post(keyed_server.url + "/v1/completions", json={**BODY, "priority": "premium"}, headers=_bearer(PREMIUM_KEY))
    assert r.status_code == 200
    r = httpx.post(keyed_server.url + "/v1/completions", json={**BODY, "priority": "standard"}, headers=_bearer(KEY))
    assert r.status_code == 200


def test_admin_needs_the_admin_key_and_json(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/admin/workers").status_code == 401
    assert httpx.get(url + "/admin/workers", headers=_bearer(PREMIUM_KEY)).status_code == 401  # an API key is not the admin key
    r = httpx.get(url + "/admin/workers", headers=_bearer(ADMIN_KEY))
    assert r.status_code == 200
    worker = r.json()["workers"][0]["worker"]
    text = {**_bearer(ADMIN_KEY), "content-type": "text/plain"}
    r = httpx.post(url + "/admin/fault", content=b'{"worker": "%s", "fault": "slow:factor=1"}' % worker.encode(), headers=text)
    assert r.status_code == 415
    r = httpx.post(url + "/admin/fault", json={"worker": worker, "fault": ""}, headers=_bearer(ADMIN_KEY))
    assert r.status_code == 200, r.text
    assert_still_serving(keyed_server, _bearer(KEY))


def test_metrics_behind_a_key_when_asked(tmp_path):
    with kvmesh_run(tmp_path, "--api-key", KEY, "--metrics-auth", "--canary-interval", "0", workers=1) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics", headers=_bearer(KEY)).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200


def test_the_api_key_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_API_KEY", KEY)
    with kvmesh_run(tmp_path, "--canary-interval", "0", workers=1) as srv:
        assert httpx.post(srv.url + "/v1/completions", json=BODY).status_code == 401
        assert httpx.post(srv.url + "/v1/completions", json=BODY, headers=_bearer(KEY)).status_code == 200


def test_admin_without_keys_answers_only_to_an_ip_or_localhost(tmp_path):
    """DNS rebinding: a page on evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    with kvmesh_run(tmp_path, "--admin", "--canary-interval", "0", workers=1) as srv:
        assert httpx.get(srv.url + "/admin/workers").status_code == 200
        assert httpx.get(srv.url + "/admin/workers", headers={"host": "localhost:1"}).status_code == 200
        r = httpx.get(srv.url + "/admin/workers", headers={"host": "evil.example"})
        assert r.status_code == 403
        r = httpx.post(srv.url + "/admin/fault", json={"worker": "0", "fault": "crash"}, headers={"host": "evil.example:80"})
        assert r.status_code == 403
