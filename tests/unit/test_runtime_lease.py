"""The runtime's lease through an outage (memory discovery playing etcd): a lease that
expired while its owner was cut off is replaced and the owner's records put again
under the same keys, with the same identity; a revoked lease is the stop signal."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvmesh.config import RuntimeConfig
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.runtime.discovery import MemoryDiscovery, MemoryStore
from kvmesh.runtime.distributed import DistributedRuntime, RequestClient

pytestmark = pytest.mark.timeout(20)


class _Server:
    host, port = "127.0.0.1", 1


async def _worker(store: MemoryStore) -> tuple[DistributedRuntime, MemoryDiscovery]:
    discovery = MemoryDiscovery(store)
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory"), discovery=discovery)
    await runtime.start()
    endpoint = runtime.namespace().component("backend").endpoint("generate")
    card = EngineConfig("m", "m", 128, 16, 64, 8, 256)
    await endpoint.register(endpoint.describe(_Server(), engine=card, model_path="m"))  # type: ignore[arg-type]
    return runtime, discovery


async def _until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_expired_out_of_contact_reregisters_same_key_and_identity() -> None:
    store = MemoryStore()
    runtime, discovery = await _worker(store)
    identity, first = runtime.lease_id, runtime.lease
    assert first is not None
    (key,) = await discovery.get_prefix("/services/")
    try:
        discovery.cut_off(first.id)
        await _until(lambda: runtime.renewals == 1)
        assert runtime.lease is not first and runtime.lease.id != first.id  # type: ignore[union-attr]
        assert runtime.lease_id == identity
        found = await discovery.get_prefix("/services/")
        assert list(found) == [key]
        assert msgspec.json.decode(found[key], type=InstanceInfo).worker_id == identity
        assert not runtime.lease_lost.is_set()
        # the new lease binds the record: revoking it (deliberately) stops the worker
        await runtime.lease.revoke()  # type: ignore[union-attr]
        await _until(runtime.lease_lost.is_set)
        assert await discovery.get_prefix("/services/") == {}
    finally:
        await runtime.shutdown()


async def test_revoked_lease_is_not_replaced() -> None:
    store = MemoryStore()
    runtime, discovery = await _worker(store)
    try:
        discovery.expire(runtime.lease_id)  # gone while in contact: a revoke
        await _until(runtime.lease_lost.is_set)
        await asyncio.sleep(0.05)
        assert runtime.renewals == 0
        assert await discovery.get_prefix("/services/") == {}
    finally:
        await runtime.shutdown()


async def test_watcher_sees_one_instance_through_a_reregistration() -> None:
    store = MemoryStore()
    watcher_rt = DistributedRuntime(RuntimeConfig(discovery="memory"), discovery=MemoryDiscovery(store))
    await watcher_rt.start()
    seen: list[tuple[str, int]] = []

    async def added(info: InstanceInfo, client: RequestClient) -> None:
        seen.append(("added", info.worker_id))

    async def removed(worker_id: int) -> None:
        seen.append(("removed", worker_id))

    client = watcher_rt.namespace().component("backend").endpoint("generate").client(added, removed)
    await client.start()
    runtime, discovery = await _worker(store)
    try:
        await _until(lambda: len(seen) == 1)
        discovery.cut_off(runtime.lease.id)  # type: ignore[union-attr]
        await _until(lambda: runtime.renewals == 1)
        await _until(lambda: len(seen) == 3)
        assert seen == [("added", runtime.lease_id), ("removed", runtime.lease_id), ("added", runtime.lease_id)]
        assert list(client.known) == [runtime.lease_id]
    finally:
        await client.close()
        await runtime.shutdown()
        await watcher_rt.shutdown()
