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
from kvmesh.runtime.distributed import DistributedRuntime, record_is_signed

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
