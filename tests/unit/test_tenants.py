"""Per-tenant limits (kvmesh.frontend.tenants): the keys file's options, the token
buckets' bounds under any interleaving of requests (hypothesis), the headers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.config import SecurityConfig
from kvmesh.frontend.auth import Authenticator, read_keys, read_keys_file
from kvmesh.frontend.tenants import Grant, Refusal, TenantLimiter, TenantPolicy, format_reset, parse_policy

pytestmark = pytest.mark.timeout(60)


def test_parse_policy_reads_every_option_and_refuses_bad_words():
    p = parse_policy(["tenant=acme", "rpm=60", "tpm=1000", "concurrent=2", "weight=2.5"], "key-1")
    assert p == TenantPolicy("acme", rpm=60, tpm=1000, concurrent=2, weight=2.5)
    assert parse_policy([], "key-1") is None
    assert parse_policy(["rpm=5"], "key-3") == TenantPolicy("key-3", rpm=5)
    for bad in (["rpm=0"], ["rpm=x"], ["burst=3"], ["tenant=a b"], ["weight=0"], ["tenant=a", "tenant=b"], ["rpm"]):
        with pytest.raises(ValueError):
            parse_policy(bad, "k")


def test_keys_file_old_and_new_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("k1\nk2 premium\nk3 tenant=acme rpm=10  # comment\nk4 best_effort tenant=b tpm=50 weight=3\n")
    assert read_keys_file(str(path)) == [("k1", "standard"), ("k2", "premium"), ("k3", "standard"), ("k4", "best_effort")]
    assert read_keys(str(path))[2:] == [("k3", "standard", "tenant=acme rpm=10"), ("k4", "best_effort", "tenant=b tpm=50 weight=3")]
    path.write_text("k1 premium rpm=-1\n")
    with pytest.raises(ValueError, match=r":1: rpm="):
        read_keys(str(path))
    path.write_text("k1 gold\n")
    with pytest.raises(ValueError, match=":1: write"):
        read_keys(str(path))


def test_keys_of_one_tenant_share_its_first_lines_policy_and_isolation_names_the_rest():
    keys = (("k1", "standard"), ("k2", "standard"), ("k3", "standard"))
    options = (("k1", "tenant=acme rpm=5 weight=3"), ("k2", "tenant=acme"))
    auth = Authenticator(SecurityConfig(api_keys=keys, api_key_options=options))
    assert auth.tenant_at(0) is auth.tenant_at(1) and auth.tenant_at(1).weight == 3  # type: ignore[union-attr]
    assert auth.tenant_at(2) is None  # no tenant: nothing extra per request
    isolated = Authenticator(SecurityConfig(api_keys=keys, api_key_options=options, cache_isolation="tenant"))
    assert isolated.tenant_at(2) == TenantPolicy("key-3")


def test_requests_bucket_refuses_past_the_limit_and_refills():
    lim = TenantLimiter([TenantPolicy("a", rpm=2)], now=0.0)
    g1, g2 = lim.reserve("a", 1, 1, 0.0), lim.reserve("a", 1, 1, 0.0)
    assert isinstance(g1, Grant) and isinstance(g2, Grant)
    refused = lim.reserve("a", 1, 1, 0.0)
    assert isinstance(refused, Refusal) and refused.limit == "requests"
    assert refused.retry_after_s == pytest.approx(30.0)  # 2 per minute: one every 30 s
    assert dict(refused.headers)["x-ratelimit-remaining-requests"] == "0"
    assert isinstance(lim.reserve("a", 1, 1, 30.0), Grant)
    assert lim.usage()["a"].limited_requests == 1


def test_tokens_are_reserved_then_settled_with_the_real_count():
    lim = TenantLimiter([TenantPolicy("a", tpm=100)], now=0.0)
    g = lim.reserve("a", 10, 80, 0.0)  # estimate 90
    assert isinstance(g, Grant) and g.reserved_tokens == 90
    assert isinstance(lim.reserve("a", 10, 10, 0.0), Refusal)  # 10 left, 20 asked
    lim.settle(g, 10, 5, 0.0)  # used 15 of 90: 75 back
    assert lim.remaining("a", 0.0)[1] == pytest.approx(85)
    headers = dict(lim.reserve("a", 10, 10, 0.0).headers)  # type: ignore[union-attr]
    assert headers["x-ratelimit-limit-tokens"] == "100" and headers["x-ratelimit-remaining-tokens"] == "65"


def test_concurrency_slot_is_given_back_at_settle():
    lim = TenantLimiter([TenantPolicy("a", concurrent=1)], now=0.0)
    g = lim.reserve("a", 1, 1, 0.0)
    assert isinstance(g, Grant)
    refused = lim.reserve("a", 1, 1, 0.0)
    assert isinstance(refused, Refusal) and refused.limit == "concurrent"
    lim.settle(g, 1, 1, 0.0)
    assert isinstance(lim.reserve("a", 1, 1, 0.0), Grant)


def test_reset_format():
    assert [format_reset(s) for s in (0.25, 1, 1.5, 360, 61.2)] == ["250ms", "1s", "1.5s", "6m0s", "1m2s"]


# one step: ("reserve", dt, prompt, max_tokens, used fraction) or ("settle", dt, index)
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.floats(0, 5), st.integers(0, 40), st.integers(0, 40), st.floats(0, 1)),
        st.tuples(st.just("settle"), st.floats(0, 5), st.integers(0, 1000)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(_steps, st.integers(1, 20), st.integers(50, 300), st.integers(1, 6))
def test_no_interleaving_overdraws_a_bucket(steps, rpm, tpm, concurrent):
    """Whatever the order of arrivals and ends: admitted requests over [0, T] stay
    within rpm + rpm·T/60, tokens used within tpm + tpm·T/60, and in flight within
    the concurrency limit."""
    lim = TenantLimiter([TenantPolicy("t", rpm=rpm, tpm=tpm, concurrent=concurrent)], now=0.0)
    now, admitted, used = 0.0, 0, 0
    open_: list[tuple[Grant, int, int]] = []
    for step in steps:
        now += step[1]
        if step[0] == "reserve":
            _, _, prompt, max_tokens, frac = step
            got = lim.reserve("t", prompt, max_tokens, now)
            if isinstance(got, Grant):
                admitted += 1
                open_.append((got, prompt, int(max_tokens * frac)))
        elif open_:
            grant, prompt, generated = open_.pop(step[2] % len(open_))
            lim.settle(grant, prompt, generated, now)
            used += prompt + generated
        assert len(open_) == lim.usage()["t"].in_flight <= concurrent
        assert admitted <= rpm + rpm * now / 60 + 1e-6
        reserved = sum(g.reserved_tokens for g, _, _ in open_)
        # an estimate over the capacity is capped, so one request may use more than it reserved
        assert used + reserved <= tpm + tpm * now / 60 + 80 + 1e-6


def test_metric_labels_are_bounded_and_the_rest_is_other():
    from kvmesh.frontend.tenant_state import TenantGate
    from kvmesh.frontend.tenants import MAX_METRIC_TENANTS

    gate = TenantGate([TenantPolicy(f"t{i:03d}") for i in range(MAX_METRIC_TENANTS + 6)])
    for i in range(MAX_METRIC_TENANTS + 6):
        grant = gate.reserve(TenantPolicy(f"t{i:03d}"), 10, 5)
        assert isinstance(grant, Grant)
        gate.settle(grant, 10, 5)
    usage = gate.metric_usage()
    assert len(usage) == MAX_METRIC_TENANTS + 1 and usage["other"]["requests"] == 6
    assert usage["other"]["completion_tokens"] == 30 and usage["t000"]["prompt_tokens"] == 10
