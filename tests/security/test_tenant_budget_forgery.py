"""The shared tenant budget (issue 30, item 3) against someone else on NATS: with a
cluster secret, whoever can write the JetStream KV bucket but lacks the secret cannot
give a tenant back its spent minute: an unsigned "nothing leased", one with a made-up MAC, a signed value
copied from another tenant's key, an old signed value written again, and a deleted
key are all ignored, and two frontends still admit exactly the limit (a real
nats-server). Fails when the MAC or the revision binding is not checked."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvmesh.frontend.tenant_budget import window_of
from kvmesh.frontend.tenant_shared import SharedBudget
from kvmesh.runtime.auth import ClusterSecret

pytestmark = pytest.mark.timeout(60)

LIMIT = 6


class Clock:
    def __init__(self) -> None:
        self.t = window_of(time.time()) * 60.0 + 1  # one window for the whole test

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("attack", ["unsigned", "forged", "other-key", "replayed", "deleted"])
async def test_writes_without_the_secret_do_not_refill_a_spent_budget(nats, attack: str) -> None:  # type: ignore[no-untyped-def]
    from kvmesh.runtime.nats import connect_nats

    secret = ClusterSecret(b"fleet-secret-" * 3)
    clock = Clock()
    conns = [await connect_nats(nats.url) for _ in range(3)]
    a, b = (SharedBudget(nc, "forge", secret=secret, clock=clock) for nc in conns[:2])
    try:
        window = window_of(clock())
        assert await a.take("other", "requests", 100, 1) is not None  # a signed value of another tenant's key
        first = await a.take("acme", "requests", LIMIT, 1)
        assert first is not None
        admitted = 1
        kv = await conns[2].jetstream().key_value(a.bucket)  # the attacker: on NATS, without the secret
        key = a.key("acme", "requests", window)
        early = (await kv.get(key)).value  # an old signed value ("1 leased")
        for i in range(LIMIT * 2):
            if await (a, b)[i % 2].take("acme", "requests", LIMIT, 1) is not None:
                admitted += 1
        assert admitted == LIMIT
        if attack == "unsigned":
            await kv.put(key, msgspec.msgpack.encode(0))
        elif attack == "forged":  # the right shape and revision, "nothing leased", a MAC made up
            revision = (await kv.get(key)).revision
            await kv.put(key, msgspec.msgpack.encode([revision, 0, b"\0" * 32]))
        elif attack == "other-key":
            await kv.put(key, (await kv.get(a.key("other", "requests", window))).value)
        elif attack == "replayed":
            await kv.put(key, early)
        else:
            await kv.delete(key)
        clock.t += 2  # past the second a spent budget is refused without a read
        for i in range(LIMIT * 2):
            if await (a, b)[i % 2].take("acme", "requests", LIMIT, 1) is not None:
                admitted += 1
        assert admitted == LIMIT, f"{attack}: {admitted} admitted"
        assert a.ignored + b.ignored >= 1
    finally:
        for nc in conns:
            await nc.close()
