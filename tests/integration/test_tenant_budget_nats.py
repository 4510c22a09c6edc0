"""Tenants' limits across several frontends (issue 30, item 3): two frontends' tenant
gates, each on its own connection to a real nats-server, share one per-minute budget
through the JetStream KV store; with the shared budget off each admits the limit."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvmesh.frontend.tenant_shared import SharedBudget
from kvmesh.frontend.tenant_state import TenantGate
from kvmesh.frontend.tenants import Grant, Refusal, TenantPolicy
from kvmesh.runtime.auth import ClusterSecret

pytestmark = pytest.mark.timeout(60)

POLICY = TenantPolicy("acme.eu", rpm=10, tpm=100_000)


async def _admitted(
    url: str, shared: bool, secret: ClusterSecret | None, namespace: str
) -> tuple[int, list[Refusal], list[SharedBudget], list[TenantGate]]:
    from kvmesh.runtime.nats import connect_nats

    conns = [await connect_nats(url) for _ in range(2)]
    gates = [TenantGate([POLICY]) for _ in range(2)]
    now = time.time()  # one window for the whole test (the minute may turn while it runs)
    budgets = [SharedBudget(nc, namespace, secret=secret, clock=lambda: now) for nc in conns]
    if shared:
        for gate, budget in zip(gates, budgets):
            gate.shared = budget
    admitted, refused = 0, []
    try:
        for i in range(20):  # split across both frontends
            gate = gates[i % 2]
            got: Grant | Refusal = gate.reserve(POLICY, 20, 16)
            if isinstance(got, Grant) and gate.shares(POLICY):
                got = await gate.share(got, POLICY)
            if isinstance(got, Grant):
                admitted += 1
                gate.settle(got, 20, 3)
            else:
                refused.append(got)
    finally:
        for nc in conns:
            await nc.close()
    return admitted, refused, budgets, gates


@pytest.mark.parametrize("signed", [False, True])
async def test_two_frontends_share_one_tenant_budget(nats, signed: bool) -> None:  # type: ignore[no-untyped-def]
    secret = ClusterSecret(b"x" * 32) if signed else None
    admitted, refused, budgets, gates = await _admitted(nats.url, True, secret, f"share{int(signed)}")
    assert admitted == 10
    assert len(refused) == 10 and all(r.limit == "requests" for r in refused)
    headers = dict(refused[0].headers)
    assert headers["x-ratelimit-limit-requests"] == "10" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in headers and 0 < refused[0].retry_after_s <= 60
    assert all(b.store_errors == 0 and b.ignored == 0 for b in budgets)
    # rpm 10: slices of 1 (a read and a write each); the refused: one read per frontend, then refused
    # locally for a second; tpm 100,000: one slice of 10,000 per frontend
    assert sum(b.operations for b in budgets) == 2 * 10 + 2 + 2 * 2
    # /admin/usage: what is left in the fleet (each frontend's own bucket still holds 5)
    usage = msgspec.json.decode(gates[0].usage_json())
    assert usage["tenants"]["acme.eu"]["remaining"]["requests"] == 0
    assert usage["shared_budget"]["store_errors"] == 0 and usage["shared_budget"]["store_operations"] > 0


async def test_without_the_shared_budget_each_frontend_admits_the_limit(nats) -> None:  # type: ignore[no-untyped-def]
    admitted, refused, _, _ = await _admitted(nats.url, False, None, "local")
    assert admitted == 20 and not refused  # N frontends: N × the limit
