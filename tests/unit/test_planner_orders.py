"""Orders through discovery: a standby worker obeys only orders signed with the
cluster secret, for its own id, newer than the last one it obeyed (no forgery, no
replay); the planner's orders verify."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvmesh.config import RuntimeConfig
from kvmesh.planner.orders import Order, StandbyLink, order_is_signed, order_key, sign_order, standby_key
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.discovery.memory import MemoryDiscovery
from kvmesh.errors import KvmeshError
from kvmesh.runtime.distributed import DistributedRuntime, record_is_signed, sign_record

SECRET = ClusterSecret(b"planner-orders-test-secret-0123456789abcdef")
OTHER = ClusterSecret(b"someone-else-entirely-9876543210-fedcba-xyz")
ENGINE = EngineConfig("m", "m", 1024, 16, 64, 8, 256)


def test_orders_sign_and_verify_per_key() -> None:
    key = order_key("ns", 7)
    order = sign_order(SECRET, key, Order(7, "serve", 1, "test"))
    assert order_is_signed(SECRET, key, order)
    assert not order_is_signed(OTHER, key, order)
    assert not order_is_signed(SECRET, order_key("ns", 8), order)  # moved to another worker's key
    assert not order_is_signed(SECRET, key, msgspec.structs.replace(order, action="stop"))


async def _next(link: StandbyLink) -> Order | None:
    try:
        return await asyncio.wait_for(link.next_order(), 0.2)
    except TimeoutError:
        return None


async def test_a_standby_obeys_signed_newer_orders_only() -> None:
    discovery = MemoryDiscovery()
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory", namespace="ns"), discovery, secret=SECRET)
    await runtime.start()
    try:
        info = InstanceInfo(runtime.lease_id, "127.0.0.1:1", ENGINE)
        link = StandbyLink(runtime, info)
        await link.offer()
        skey = standby_key("ns", info.worker_id)
        offered = msgspec.json.decode((await discovery.get_prefix(skey))[skey], type=InstanceInfo)
        assert record_is_signed(SECRET, skey, offered)
        key = order_key("ns", info.worker_id)

        async def put(order: Order) -> None:
            await discovery.put(key, msgspec.json.encode(order))

        await put(Order(info.worker_id, "serve", 5))  # unsigned
        await put(sign_order(OTHER, key, Order(info.worker_id, "serve", 6)))  # the wrong secret
        await put(sign_order(SECRET, key, Order(info.worker_id + 1, "serve", 7)))  # another worker's
        await discovery.put(key, b"{not json")
        # oversized: refused before it is decoded (even when signed: a bound, not a trust check)
        await put(sign_order(SECRET, key, Order(info.worker_id, "serve", 8, "x" * (1 << 20))))
        assert await _next(link) is None
        await put(sign_order(SECRET, key, Order(info.worker_id, "serve", 10)))
        got = await _next(link)
        assert got is not None and got.action == "serve"
        await put(sign_order(SECRET, key, Order(info.worker_id, "stop", 9)))  # older: a replay
        assert await _next(link) is None
        await put(sign_order(SECRET, key, Order(info.worker_id, "stop", 11)))
        got = await _next(link)
        assert got is not None and got.action == "stop"
        await link.withdraw()
        assert skey not in await discovery.get_prefix(skey)
        await link.close()
    finally:
        await runtime.shutdown()


@pytest.mark.parametrize("action", ["serve", "stop"])
def test_order_round_trips(action: str) -> None:
    order = Order(3, action, 99, "why")  # type: ignore[arg-type]
    assert msgspec.json.decode(msgspec.json.encode(order), type=Order) == order


async def test_discovery_fleet_promotes_by_role_and_a_move_drains_the_old_worker() -> None:
    from kvmesh.assembly.discovery_fleet import DiscoveryFleet
    from kvmesh.planner.core import Role
    from kvmesh.runtime.distributed import instance_key
    from kvmesh.runtime.names import COMPONENT, GENERATE, PREFILL_COMPONENT

    discovery = MemoryDiscovery()
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory", namespace="ns"), discovery, secret=SECRET)
    await runtime.start()

    async def record(key: str, info: InstanceInfo) -> None:
        await discovery.put(key, msgspec.json.encode(sign_record(SECRET, key, info)))

    try:
        for wid, component in ((1, COMPONENT), (2, PREFILL_COMPONENT)):
            await record(instance_key("ns", component, GENERATE, wid), InstanceInfo(wid, "127.0.0.1:1", ENGINE, component=component))
        await record(standby_key("ns", 10), InstanceInfo(10, "127.0.0.1:1", ENGINE, component=COMPONENT))
        await record(standby_key("ns", 11), InstanceInfo(11, "127.0.0.1:1", ENGINE, component=PREFILL_COMPONENT))
        forged = InstanceInfo(12, "127.0.0.1:1", ENGINE)  # not signed: ignored
        await discovery.put(standby_key("ns", 12), msgspec.json.encode(forged))
        fleet = DiscoveryFleet(runtime)
        await fleet._scan()
        assert sorted(fleet._standby) == [10, 11]
        assert {w: r for w, (r, _) in fleet._serving.items()} == {1: Role.DECODE, 2: Role.PREFILL}
        fleet.vetted.update({10: True, 11: True})

        async def order_of(wid: int) -> Order:
            key = order_key("ns", wid)
            order = msgspec.json.decode((await discovery.get_prefix(key))[key], type=Order)
            assert order_is_signed(SECRET, key, order)
            return order

        await fleet.move(1, Role.PREFILL)  # decode worker 1 becomes prefill capacity
        assert (await order_of(11)).action == "serve" and fleet.promoting == {11: Role.PREFILL}
        assert not await discovery.get_prefix(order_key("ns", 1))  # the old one serves until then
        # the standby registers as a prefill instance and withdraws its standby record
        await record(instance_key("ns", PREFILL_COMPONENT, GENERATE, 11), InstanceInfo(11, "127.0.0.1:1", ENGINE, component=PREFILL_COMPONENT))
        await discovery.delete(standby_key("ns", 11))
        await fleet._scan()
        assert fleet.promoting == {} and (await order_of(1)).action == "stop"
        with pytest.raises(KvmeshError):
            await fleet.promote(10, Role.PREFILL)  # no prefill standby left
        await fleet.promote(11, Role.DECODE)  # the id the core picked is not ready: a fitting one is
        assert fleet.promoting == {10: Role.DECODE}
    finally:
        await runtime.shutdown()
