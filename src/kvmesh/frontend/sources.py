"""Where the frontend learns about workers: discovery (embedded memory, file, etcd) or
a fixed list of addresses (static mode). Both end in ``registry.attach`` /
``registry.detach``."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from kvmesh.errors import KvmeshError
from kvmesh.frontend.models import ModelRegistry
from kvmesh.observability.metrics import count_discovery_refusals
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.distributed import Client, DistributedRuntime, RequestClient, call
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.names import COMPONENT, GENERATE, INFO, PREFILL_COMPONENT
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = ["watch_workers", "StaticWorkers"]

log = logging.getLogger("kvmesh.frontend")

_decode_info = msgspec.msgpack.Decoder(InstanceInfo).decode


async def watch_workers(runtime: DistributedRuntime, registry: ModelRegistry) -> Client:
    """Attach every ``backend/generate`` instance discovery reports, detach removed ones."""

    async def added(info: InstanceInfo, client: RequestClient) -> None:
        try:
            await registry.attach(info, client)
        except KvmeshError as exc:
            log.error("cannot serve worker %x: %s", info.worker_id, exc.message)

    c = registry.config
    count_discovery_refusals(registry.metrics.registry, runtime.discovery.refused)
    endpoint = runtime.namespace().component(COMPONENT).endpoint(GENERATE)
    client = endpoint.client(added, registry.detach, c.connect_timeout_s, c.response_timeout_s)
    await client.start()
    return client


async def watch_prefill_workers(runtime: DistributedRuntime, seen: dict[int, object]) -> Client:
    """Prefill workers (never routed to), for the fleet's metrics and the dashboard:
    ``seen`` maps worker id → its request-plane client while it is registered."""

    async def added(info: InstanceInfo, client: object) -> None:
        seen[info.worker_id] = client

    async def removed(worker_id: int) -> None:
        gone = seen.pop(worker_id, None)
        close = getattr(gone, "close", None)
        if close is not None:
            await close()

    endpoint = runtime.namespace().component(PREFILL_COMPONENT).endpoint(GENERATE)
    client = endpoint.client(added, removed)
    await client.start()
    return client


class StaticWorkers:
    """Static mode: workers at fixed addresses. Each is asked for its card (``info``)
    every ``interval_s``; one that stops answering is detached until it answers again."""

    def __init__(self, addresses: list[str], registry: ModelRegistry, interval_s: float = 1.0) -> None:
        self.addresses = addresses
        self.registry = registry
        self.interval_s = interval_s
        self._attached: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._poll_all()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._poll_all()

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(a) for a in self.addresses))

    async def _poll(self, address: str) -> None:
        client = TcpClient(address, connect_timeout=self.interval_s)
        try:
            info = await call(client, INFO, decode=_decode_info)
        except KvmeshError:
            info = None
        finally:
            await client.close()
        known = self._attached.get(address)
        if info is None:
            if known is not None:
                del self._attached[address]
                await self.registry.detach(known)
            return
        if known is None:
            if info.worker_id in self._attached.values():
                log.error("static worker %s has the same id %d as another; give each its own --worker-id", address, info.worker_id)
                return
            self._attached[address] = info.worker_id
            c = self.registry.config
            client = TcpClient(address, c.connect_timeout_s, c.response_timeout_s)
            await self.registry.attach(msgspec.structs.replace(info, address=address), client)
