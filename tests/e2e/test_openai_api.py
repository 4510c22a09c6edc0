"""The README's promise, as a new user would check it: `kvmesh run` serves, and the
official openai client streams chat completions and completions."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest

from tests.helpers import kvmesh_run

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("api")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_bundled_model(client):
    assert [m.id for m in client.models.list()] == ["kvmesh-tiny"]


def test_chat_completion_streams_content_then_the_end(client):
    stream = client.chat.completions.create(
        model="kvmesh-tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content, "no content streamed"
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens > 0


def test_completion_streams_and_matches_the_unary_answer(client):
    kwargs = dict(model="kvmesh-tiny", prompt="def hello():", max_tokens=10, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    unary = client.completions.create(**kwargs)
    assert unary.choices[0].finish_reason == "length"
    assert unary.usage.completion_tokens == 10
    # the mocker is deterministic: the same request gives the same text either way
    assert streamed == unary.choices[0].text


def test_chat_completion_unary(client):
    resp = client.chat.completions.create(
        model="kvmesh-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 5


def test_token_id_prompt_and_stop_at_max_tokens(client):
    resp = client.completions.create(model="kvmesh-tiny", prompt=list(range(100, 228)), max_tokens=64, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 128
    assert resp.usage.completion_tokens == 64


def test_curl_shows_sse_lines_and_done(server):
    body = '{"model":"kvmesh-tiny","prompt":"x = 1","max_tokens":4,"stream":true,"ignore_eos":true}'
    out = subprocess.run(
        ["curl", "-sN", server.url + "/v1/completions", "-H", "content-type: application/json", "-d", body],
        capture_output=True, text=True, timeout=30,
    ).stdout
    events = [line for line in out.split("\n\n") if line.strip()]
    assert all(e.startswith("data: ") for e in events), out
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]


def test_health_live_and_metrics(server, client):
    assert httpx.get(server.url + "/live").status_code == 200
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ready" and health["models"] == {"kvmesh-tiny": 2}
    client.completions.create(model="kvmesh-tiny", prompt="a", max_tokens=3, extra_body={"ignore_eos": True})
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "kvmesh_frontend_requests_total",
        "kvmesh_frontend_inflight_requests",
        "kvmesh_frontend_time_to_first_token_seconds_bucket",
        "kvmesh_frontend_inter_token_latency_seconds_bucket",
        "kvmesh_frontend_request_duration_seconds_bucket",
        "kvmesh_frontend_input_tokens_total",
        "kvmesh_frontend_output_tokens_total",
    ):
        assert name in metrics, name
    assert 'kvmesh_frontend_requests_total{endpoint="completions",model="kvmesh-tiny",status="200"}' in metrics


def test_stop_string_ends_the_stream_and_is_excluded(client):
    full = client.completions.create(model="kvmesh-tiny", prompt="import os", max_tokens=40, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[5:8]
    assert len(stop) == 3
    cut = client.completions.create(model="kvmesh-tiny", prompt="import os", max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
