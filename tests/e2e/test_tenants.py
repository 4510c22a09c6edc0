"""Tenants end to end (issue 30, item 3): a real ``kvmesh run`` with a real keys file,
called with the official ``openai`` client: 429 + Retry-After + x-ratelimit-* past a
limit, the headers on successful answers (streamed and not), the concurrency limit
holding, per-tenant /metrics and /admin/usage."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers import kvmesh_run

pytestmark = pytest.mark.timeout(120)

ADMIN = "sk-admin-tenants-test"
KEYS = """\
sk-alpha standard tenant=alpha rpm=3
sk-beta tenant=beta concurrent=2
sk-gamma tenant=gamma tpm=300
sk-plain premium
sk-delta tenant=delta weight=2
"""
MODEL = "kvmesh-tiny"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys"
    keys.write_text(KEYS)
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_ADMIN_KEY", ADMIN)
    try:
        # speedup 1: a 200-token answer streams for seconds (the concurrency test holds two)
        with kvmesh_run(tmp, "--api-keys-file", str(keys), "--admin", workers=1, speedup="1") as s:
            yield s
    finally:
        mp.undo()


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _async_client(server, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _chat(client: openai.OpenAI, max_tokens: int = 2, **kw):
    return client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, **kw)


def test_requests_per_minute_429_with_headers_and_headers_on_success(server):
    alpha = _client(server, "sk-alpha")
    remaining = []
    raw = _chat(alpha)
    remaining.append(raw.headers["x-ratelimit-remaining-requests"])
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    assert raw.parse().choices[0].message.content
    raw_stream = _chat(alpha, stream=True)  # a streamed answer carries them too
    remaining.append(raw_stream.headers["x-ratelimit-remaining-requests"])
    assert [c for c in raw_stream.parse()]
    remaining.append(_chat(alpha).headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError) as err:
        alpha.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    headers = err.value.response.headers
    assert err.value.status_code == 429
    assert 1 <= int(headers["retry-after"]) <= 20  # 3 per minute: one back every 20 s
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "alpha" in err.value.message and "requests per minute" in err.value.message
    # the Anthropic Messages route: its own error shape, the same headers
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "sk-alpha"},
                   json={"model": MODEL, "max_tokens": 2, "messages": MESSAGES})  # fmt: skip
    assert r.status_code == 429 and r.json()["type"] == "error" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(r.headers["retry-after"]) >= 1


def test_a_key_without_limits_gets_no_ratelimit_headers(server):
    raw = _chat(_client(server, "sk-plain"))
    assert raw.parse().choices[0].message.content
    assert not [h for h in raw.headers if h.startswith("x-ratelimit")]


def test_tokens_per_minute_counts_what_was_generated(server):
    gamma = _client(server, "sk-gamma")
    raw = _chat(gamma, max_tokens=100)  # reserves prompt + 100
    usage = raw.parse().usage
    assert int(raw.headers["x-ratelimit-limit-tokens"]) == 300
    # settled with the real count: the bucket lost prompt + completion, no more
    left = _chat(gamma, max_tokens=1).headers["x-ratelimit-remaining-tokens"]
    assert 300 - usage.total_tokens - 2 * (usage.prompt_tokens + 1) - 5 <= int(left) <= 300 - usage.total_tokens
    with pytest.raises(openai.RateLimitError) as err:
        gamma.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=280)
    assert "tokens per minute" in err.value.message
    assert err.value.response.headers["x-ratelimit-limit-tokens"] == "300"


def test_concurrency_limit_holds_under_a_burst(server):
    """Eight concurrent streams from a tenant limited to two: at most two are ever
    served, the others get 429 (none errors, none waits for the others)."""

    async def burst() -> list[object]:
        beta = _async_client(server, "sk-beta")

        async def one() -> object:
            try:
                stream = await beta.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, stream=True)
                async for _ in stream:
                    pass
                return "ok"
            except openai.RateLimitError as exc:
                return exc.response.headers.get("retry-after")

        try:
            return await asyncio.gather(*(one() for _ in range(8)))
        finally:
            await beta.close()

    results = asyncio.run(burst())
    assert 1 <= results.count("ok") <= 2, results
    assert all(r == "ok" or r is not None for r in results)
    usage = httpx.get(server.url + "/admin/usage", headers={"authorization": f"Bearer {ADMIN}"}).json()["tenants"]["beta"]
    assert usage["usage"]["limited_concurrent"] == 8 - results.count("ok")
    # the slots came back: a new request is served
    deadline = time.monotonic() + 30
    while usage["usage"]["in_flight"] and time.monotonic() < deadline:
        usage = httpx.get(server.url + "/admin/usage", headers={"authorization": f"Bearer {ADMIN}"}).json()["tenants"]["beta"]
    assert _chat(_client(server, "sk-beta")).parse().choices


def test_usage_per_tenant_in_metrics_and_admin_usage(server):
    _chat(_client(server, "sk-plain"))
    delta = _client(server, "sk-delta")
    for stream in (False, True):
        raw = _chat(delta, max_tokens=3, stream=stream)
        assert not [h for h in raw.headers if h.startswith("x-ratelimit")]  # a tenant without limits
        assert list(raw.parse()) if stream else raw.parse().choices
    text = httpx.get(server.url + "/metrics").text
    assert 'kvmesh_tenant_requests_total{tenant="delta"} 2.0' in text
    assert 'kvmesh_tenant_completion_tokens_total{tenant="delta"} 6.0' in text
    assert 'kvmesh_tenant_rate_limited_total{limit="requests",tenant="alpha"}' in text
    assert "sk-alpha" not in text and "sk-beta" not in text  # labels are tenant names, never keys
    assert httpx.get(server.url + "/admin/usage", headers={"authorization": "Bearer sk-alpha"}).status_code == 401
    usage = httpx.get(server.url + "/admin/usage", headers={"authorization": f"Bearer {ADMIN}"}).json()
    delta = usage["tenants"]["delta"]
    assert delta["limits"] == {"rpm": 0, "tpm": 0, "concurrent": 0, "weight": 2.0}
    assert delta["usage"]["requests"] == 2 and delta["usage"]["completion_tokens"] == 6
    assert delta["remaining"] == {"requests": None, "tokens": None}
    assert set(usage["tenants"]) == {"alpha", "beta", "gamma", "delta"}  # sk-plain has no tenant
