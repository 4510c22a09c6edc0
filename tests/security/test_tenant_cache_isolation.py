"""Cache isolation between tenants (issue 30, item 5): a tenant probing whether another
tenant's prompt prefix is cached, through ``usage.cached_tokens`` and the router's
explanation (``router_explain``), learns it without isolation and learns nothing with
``--cache-isolation tenant``.

Real ``kvmesh run`` (one mocker worker, KV router), a real keys file, the official
``openai`` client. The victim sends a secret prompt; the attacker then sends the same
prompt (its guess) and reads what the answer tells about the cache.
"""

from __future__ import annotations

import random

import openai
import pytest

from tests.helpers import kvmesh_run

pytestmark = pytest.mark.timeout(120)

KEYS = "sk-victim tenant=victim\nsk-attacker tenant=attacker\n"
MODEL = "kvmesh-tiny"


def _secret(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 2000) for _ in range(160)]  # 10 blocks of 16


def _probe(client: openai.OpenAI, prompt: list[int]) -> tuple[int, dict]:
    """(cached tokens, router explanation) of one completion of ``prompt``."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"router_explain": True})
    body = raw.http_response.json()
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body.get("kvmesh_route") or {}


def _run(tmp_path, isolation: str) -> tuple[int, dict, int, dict]:
    keys = tmp_path / f"keys-{isolation}"
    keys.write_text(KEYS)
    flags = ["--api-keys-file", str(keys), "--router-mode", "kv", "--cache-isolation", isolation, "--canary-interval", "0"]
    with kvmesh_run(tmp_path, *flags, workers=1) as server:
        victim = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-victim", max_retries=0)
        attacker = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-attacker", max_retries=0)
        secret = _secret(1)
        victim.completions.create(model=MODEL, prompt=secret, max_tokens=1)
        cached, route = _probe(attacker, secret)
        # control: the attacker's own prompt, sent twice, is found in the cache
        own = _secret(2)
        attacker.completions.create(model=MODEL, prompt=own, max_tokens=1)
        own_cached, own_route = _probe(attacker, own)
    return cached, route, own_cached, own_route


def test_without_isolation_a_tenant_learns_anothers_prefix_is_cached(tmp_path):
    """The attack works without isolation (cached_tokens tells); the explanation's
    per-worker overlaps are withheld from keyed callers in this mode."""
    cached, route, own_cached, _ = _run(tmp_path, "none")
    assert cached >= 144 and own_cached >= 144  # the victim's blocks serve the attacker's guess
    assert "overlap_blocks" not in route and "candidates" not in route and route.get("worker")


def test_with_isolation_the_probe_learns_nothing(tmp_path):
    cached, route, own_cached, own_route = _run(tmp_path, "tenant")
    assert own_cached >= 144 and own_route["overlap_blocks"] >= 9  # the channel works for one's own prompts ...
    assert cached == 0  # ... and says nothing about another tenant's
    assert route["overlap_blocks"] == 0 and all(c["overlap_blocks"] == 0 for c in route["candidates"])
