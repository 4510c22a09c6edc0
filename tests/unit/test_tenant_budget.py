"""The shared tenant budget (issue 30, item 3 across frontends): the lease arithmetic
(pure), and SharedBudget over an in-memory compare-and-set store: no interleaving of
several frontends' takes, settles and give-backs spends more than the limit in a
window (hypothesis drives the interleaving); signed values (forged, replayed)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvmesh.frontend.tenant_budget import BudgetLedger, plan_lease, window_end_s, window_of
from kvmesh.frontend.tenant_shared import SharedBudget
from kvmesh.frontend.tenant_state import TenantGate
from kvmesh.frontend.tenants import Grant, Refusal, TenantPolicy
from kvmesh.runtime.auth import ClusterSecret

pytestmark = pytest.mark.timeout(120)

T0 = 60.0 * 1000 + 5  # 5 s into a window


def test_plan_lease_slices_and_refusals() -> None:
    assert plan_lease(100, 0, 1) == 10  # a tenth of the limit
    assert plan_lease(100, 95, 1) == 3  # at most half of what is left
    assert plan_lease(100, 99, 1) == 1
    assert plan_lease(100, 100, 1) == 0  # spent
    assert plan_lease(100, 90, 30) == 0  # what is left cannot cover the need
    assert plan_lease(100, 0, 40) == 40  # a large need takes what it needs
    assert plan_lease(10, 0, 0) == 0
    assert window_of(T0) == 1000 and window_end_s(T0) == pytest.approx(55.0)


def test_ledger_refund_debt_and_windows() -> None:
    ledger = BudgetLedger()
    ledger.credit("a", 7, 10)
    assert ledger.take("a", 7, 6) and not ledger.take("a", 7, 5)
    assert ledger.shortfall("a", 7, 5) == 1
    ledger.refund("a", 7, 7, 2)  # 2 unused come back in the same window
    assert ledger.take("a", 7, 6)
    ledger.refund("a", 7, 8, 5)  # a refund from a past window is dropped
    ledger.refund("a", 7, 8, -3)  # a debt is charged to the current window
    assert ledger.leased("a", 8) == 0 and ledger.shortfall("a", 8, 1) == 4
    ledger.credit("a", 8, 4)
    assert ledger.unspent("a", 8) == 1 and ledger.take("a", 8, 1)


# an in-memory JetStream KV with nats-py's shape (get/create/update by revision)


class KeyNotFoundError(Exception):
    entry = None


class KeyWrongLastSequenceError(Exception):
    pass


@dataclass
class _Entry:
    value: bytes
    revision: int


class FakeKV:
    """Every call yields to the loop a random number of times (seeded by hypothesis),
    so concurrent frontends' reads and writes interleave."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.data: dict[str, _Entry] = {}
        self.revision = 0

    async def _yield(self) -> None:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)

    async def get(self, key: str) -> _Entry:
        await self._yield()
        if key not in self.data:
            raise KeyNotFoundError(key)
        e = self.data[key]
        return _Entry(e.value, e.revision)

    async def create(self, key: str, value: bytes) -> int:
        return await self.update(key, value, last=0)

    async def update(self, key: str, value: bytes, last: int) -> int:
        await self._yield()
        have = self.data[key].revision if key in self.data else 0
        if have != last:
            raise KeyWrongLastSequenceError("wrong last sequence")
        self.revision += 1
        self.data[key] = _Entry(value, self.revision)
        return self.revision


@pytest.fixture(autouse=True)
def _fake_nats_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import nats.js.errors as errors

    monkeypatch.setattr(errors, "KeyNotFoundError", KeyNotFoundError)
    monkeypatch.setattr(errors, "KeyWrongLastSequenceError", KeyWrongLastSequenceError)


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def _budget(kv: FakeKV, secret: ClusterSecret | None = None, clock: Clock | None = None) -> SharedBudget:
    budget = SharedBudget(None, "t", secret=secret, clock=clock or Clock())
    budget._kv = kv
    return budget


def _granted(kv: FakeKV, budget: SharedBudget, kind: str) -> int:
    entry = kv.data.get(budget.key("acme", kind, window_of(T0)))
    if entry is None:
        return 0
    if budget._secret is None:
        return int(msgspec.msgpack.decode(entry.value))
    return int(msgspec.msgpack.decode(entry.value)[1])


OPS = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(["request", "tokens", "settle", "give_back"]), st.integers(1, 40)),
    min_size=4,
    max_size=40,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: a failure is reported as found
)
@given(ops=OPS, seed=st.integers(0, 2**32), signed=st.booleans())
def test_no_interleaving_of_frontends_spends_more_than_the_limit(ops: list[tuple[int, str, int]], seed: int, signed: bool) -> None:
    rpm, tpm = 3, 50
    kv = FakeKV(random.Random(seed))
    secret = ClusterSecret(b"s" * 32) if signed else None
    frontends = [_budget(kv, secret) for _ in range(3)]
    spent = {"requests": 0, "tokens": 0}
    held: list[tuple[int, int]] = []  # (frontend, tokens reserved) of admitted token requests

    async def one(f: int, op: str, n: int) -> None:
        budget = frontends[f]
        if op == "request":
            if await budget.take("acme", "requests", rpm, 1) is not None:
                spent["requests"] += 1
        elif op == "tokens":
            if await budget.take("acme", "tokens", tpm, n) is not None:
                spent["tokens"] += n
                held.append((f, n))
        elif op == "settle" and held:
            g, reserved = held.pop(0)
            used = reserved // 2  # half was used: the rest comes back to the lease
            frontends[g].refund("acme", "tokens", window_of(T0), reserved - used)
            spent["tokens"] -= reserved - used
        elif op == "give_back":
            await budget.give_back()

    async def main() -> None:
        await asyncio.gather(*(one(*op) for op in ops))

    asyncio.run(main())
    assert spent["requests"] <= rpm
    assert spent["tokens"] <= tpm
    for kind, limit in (("requests", rpm), ("tokens", tpm)):
        granted = _granted(kv, frontends[0], kind)
        assert granted <= limit
        # the counter is what the frontends hold between them (nothing lost, nothing made up)
        assert granted == sum(b.ledger.leased(f"acme\0{kind}", window_of(T0)) for b in frontends)
    assert all(b.store_errors == 0 and b.ignored == 0 for b in frontends)


async def test_all_of_a_limit_is_spendable_across_frontends() -> None:
    kv = FakeKV(random.Random(1))
    a, b = _budget(kv), _budget(kv)
    results = [await (a if i % 2 else b).take("acme", "requests", 10, 1) for i in range(20)]
    assert sum(r is not None for r in results) == 10
    assert results[-1] is None
    assert a.operations + b.operations <= 2 * 20  # one read + one write per lease at most


async def test_given_back_budget_goes_to_the_other_frontend() -> None:
    kv = FakeKV(random.Random(2))
    clock = Clock()
    a, b = _budget(kv, clock=clock), _budget(kv, clock=clock)
    assert await a.take("acme", "requests", 100, 1) is not None  # leases a slice of 10
    for _ in range(90):
        assert await b.take("acme", "requests", 100, 1) is not None
    assert await b.take("acme", "requests", 100, 1) is None  # a holds the rest
    await a.give_back()
    assert await b.take("acme", "requests", 100, 1) is None  # refused without a store read for a second
    clock.t += 1.5
    assert await b.take("acme", "requests", 100, 1) is not None


async def test_forged_and_replayed_values_are_ignored() -> None:
    secret = ClusterSecret(b"k" * 32)
    kv = FakeKV(random.Random(3))
    clock = Clock()
    a = _budget(kv, secret, clock)
    key = a.key("acme", "requests", window_of(T0))
    for _ in range(4):
        assert await a.take("acme", "requests", 10, 1) is not None
    granted = _granted(kv, a, "requests")
    old = kv.data[key].value
    forged = msgspec.msgpack.encode([kv.data[key].revision, 0, b"\0" * 32])  # "nothing leased", a wrong MAC
    await kv.update(key, forged, last=kv.data[key].revision)
    b, granted = None, None
    admitted = 0
    while await a.take("acme", "requests", 10, 1) is not None:
        admitted += 1
    assert admitted == 10 - 4 and a.ignored >= 1  # the forgery gave no budget back
    await kv.update(key, old, last=kv.data[key].revision)  # an old signed value written again
    clock.t += 1.5  # past the second a spent budget is not read again
    assert await a.take("acme", "requests", 10, 1) is None
    assert a.ignored >= 2
    del b, granted


async def test_store_out_of_reach_admits_under_local_limits() -> None:
    calls = []

    class Down:
        async def get(self, key: str) -> None:
            calls.append(key)
            raise OSError("no route")

    clock = Clock()
    budget = SharedBudget(None, "t", secret=None, clock=clock)
    budget._kv = Down()
    assert await budget.take("acme", "requests", 10, 1) is not None
    assert budget.store_errors == 1 and len(calls) == 1
    for _ in range(20):  # the next requests do not wait for the store
        assert await budget.take("acme", "requests", 10, 1) is not None
    assert len(calls) == 1
    clock.t += 6  # tried again after DOWN_RETRY_S
    assert await budget.take("acme", "requests", 10, 1) is not None
    assert len(calls) == 2 and budget.store_errors == 2


async def test_gate_refusal_undoes_the_local_reservation_and_has_headers() -> None:
    kv = FakeKV(random.Random(4))
    policy = TenantPolicy("acme", rpm=5, tpm=1000)
    gates = [TenantGate([policy]) for _ in range(2)]
    for gate in gates:
        gate.shared = _budget(kv)
    outcomes = []
    for i in range(10):
        gate = gates[i % 2]
        got = gate.reserve(policy, 10, 10)
        assert isinstance(got, Grant)  # each frontend's own bucket would admit 5
        outcomes.append(await gate.share(got, policy))
    admitted = [o for o in outcomes if isinstance(o, Grant)]
    refused = [o for o in outcomes if isinstance(o, Refusal)]
    assert len(admitted) == 5 and len(refused) == 5
    headers = dict(refused[0].headers)
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-limit-requests"] == "5"
    assert refused[0].limit == "requests" and 0 < refused[0].retry_after_s <= 60
    usage = {n: u for g in gates for n, u in g.limiter.usage().items() if u.requests}
    assert sum(g.limiter.usage()["acme"].requests for g in gates) == 5
    assert sum(g.limiter.usage()["acme"].in_flight for g in gates) == 5
    assert usage
    for grant in admitted:  # settled: tokens not used go back to the frontend's lease
        gate = gates[outcomes.index(grant) % 2]
        gate.settle(grant, 10, 2)
    assert sum(g.limiter.usage()["acme"].in_flight for g in gates) == 0


def test_tenants_without_rpm_or_tpm_never_reach_the_shared_budget() -> None:
    only_concurrent, isolated = TenantPolicy("a", concurrent=2), TenantPolicy("b")
    gate = TenantGate([only_concurrent, isolated, TenantPolicy("c", rpm=1)])
    assert not gate.shares(TenantPolicy("c", rpm=1))  # no shared store: the local limiter alone
    gate.shared = _budget(FakeKV(random.Random(5)))
    assert not gate.shares(only_concurrent) and not gate.shares(isolated)
    assert gate.shares(TenantPolicy("c", rpm=1))
