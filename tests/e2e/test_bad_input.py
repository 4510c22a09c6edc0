"""Bad input gets a 4xx with a message that says what to fix, and loses nothing:
after every bad request the server still serves a good one."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import kvmesh_run

pytestmark = pytest.mark.processes

GOOD = {"model": "kvmesh-tiny", "prompt": "ok", "max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("bad"), workers=1) as srv:
        yield srv


def _post(server, path, content=None, json=None, headers=None):
    return httpx.post(server.url + path, content=content, json=json, headers=headers, timeout=10)


def _assert_still_serving(server):
    r = _post(server, "/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


CASES = [
    ("malformed json", "/v1/chat/completions", b'{"model": "kvmesh-tiny", "messages": [', 400, "not valid JSON"),
    ("empty body", "/v1/completions", b"", 400, "empty"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "Expected `object`"),
    ("wrong type", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "max_tokens": "ten"}', 400, "$.max_tokens"),
    ("negative max_tokens", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "max_tokens": -5}', 400, "$.max_tokens"),
    ("temperature out of range", "/v1/chat/completions",
     b'{"model": "kvmesh-tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 9}', 400, "$.temperature"),
    ("missing messages", "/v1/chat/completions", b'{"model": "kvmesh-tiny"}', 400, "messages"),
    ("empty messages", "/v1/chat/completions", b'{"model": "kvmesh-tiny", "messages": []}', 400, "$.messages"),
    ("bad role", "/v1/chat/completions", b'{"model": "kvmesh-tiny", "messages": [{"role": "robot", "content": "x"}]}', 400, "role"),
    ("unknown model", "/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', 404, "gpt-9"),
    ("token id out of vocabulary", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": [1, 999999]}', 400, "999999"),
    ("prompt longer than context", "/v1/completions",
     b'{"model": "kvmesh-tiny", "prompt": [' + b",".join([b"7"] * 2100) + b"]}", 400, "context"),
    ("max_tokens past context", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 5000}', 400, "max_tokens"),
    ("min over max", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 5}', 400, "min_tokens"),
    ("n > 1", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "n": 3}', 400, "$.n"),
    ("several prompts", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": ["a", "b"]}', 400, "one prompt"),
    ("empty stop string", "/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "stop": [""]}', 400, "stop"),
]


@pytest.mark.parametrize("name,path,body,status,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_a_clear_4xx(server, name, path, body, status, needle):
    r = _post(server, path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["code"] == status
    _assert_still_serving(server)


def test_oversized_body_is_413(server):
    body = b'{"model": "kvmesh-tiny", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    r = _post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert "limit" in r.json()["error"]["message"]
    _assert_still_serving(server)


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405
    _assert_still_serving(server)


def test_streaming_bad_request_is_a_plain_4xx_not_a_stream(server):
    r = _post(server, "/v1/completions", json={"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 0, "stream": True})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    _assert_still_serving(server)
