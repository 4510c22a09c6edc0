"""Fuzzing the public edge of a real ``kvmesh run``: a hypothesis-driven fuzzer over
request bodies (JSON shaped like requests, with wrong types, extreme numbers, odd
strings and raw bytes) and a schemathesis run over ``/openapi.json``, both with a
bounded number of examples. Neither may ever get a 5xx, and the server must still
answer a normal request afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import kvmesh_run
from tests.security._edge import MODEL, assert_still_serving

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

ARGS = ("--canary-interval", "0", "--header-timeout", "5")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("fuzz"), *ARGS, workers=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.sampled_from(["<|im_end|>", "<|im_start|>system\n", "\x00", "\ud7ff", "😀" * 10, "kvmesh-tiny"]),
)  # fmt: skip
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]), "content": st.one_of(st.text(max_size=60), _json)}
)
_common = {
    "model": st.one_of(st.just(MODEL), _scalars),
    "max_tokens": st.one_of(st.integers(min_value=-5, max_value=40), _scalars),
    "temperature": st.one_of(st.floats(min_value=0, max_value=2), _scalars),
    "stop": st.one_of(st.none(), st.text(max_size=5), st.lists(st.text(max_size=20), max_size=20), _json),
    "stream": st.booleans(),
    "seed": _scalars,
    "top_p": _scalars,
    "logprobs": _scalars,
    "priority": st.sampled_from(["premium", "standard", "best_effort", "x"]),
    "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(st.sampled_from(["messages", "add_generation_prompt", "x"]), _scalars, max_size=2)),
}


def _body(required: dict) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(required, optional=_common)


_chat = _body({"messages": st.one_of(st.lists(_message, max_size=4), _json)})
_completion = _body({"prompt": st.one_of(st.text(max_size=80), st.lists(st.integers(-3, 5000), max_size=20), _json)})
_responses = _body({"input": st.one_of(st.text(max_size=80), st.lists(_message, max_size=4), _json)})
_raw = st.binary(max_size=200).map(lambda b: b'{"model": "kvmesh-tiny", "prompt": "' + b + b'"}')


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]),
    body=st.one_of(*(b.map(lambda d: json.dumps(d).encode()) for b in (_chat, _completion, _responses)), _raw),
)
def test_fuzzed_bodies_never_get_a_5xx(client, path, body):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def test_the_server_answers_after_the_fuzzer(server):
    assert_still_serving(server)


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_schemathesis_finds_no_5xx(case):
    response = case.call(timeout=30)
    assert response.status_code < 500, (case.path, case.body, response.status_code, response.text[:300])


def test_the_server_answers_after_schemathesis(server):
    assert_still_serving(server)


def test_openapi_describes_the_real_routes(client):
    doc = client.get("/openapi.json").json()
    assert set(doc["paths"]) == {
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health", "/live",
        "/metrics", "/openapi.json",
    }  # fmt: skip
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["$ref"].endswith("/ChatCompletionRequest")
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]
