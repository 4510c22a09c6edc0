"""Discovery reads are bounded by kvmesh, whatever the store accepts: anyone who can
write to discovery tries to make every frontend and planner decode huge or deeply
nested records, to make a prefix too large to read at all, and to flood a prefix with
records. Each oversized or surplus record is refused with a warning and counted;
the well-formed records keep working. Against a real etcd (its own 1.5 MiB value cap
is no bound of ours)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.assembly.discovery_fleet import DiscoveryFleet
from kvmesh.config import RuntimeConfig
from kvmesh.observability.metrics import count_discovery_refusals
from kvmesh.planner.orders import standby_key
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.runtime.discovery import WatchEvent
from kvmesh.runtime.discovery.etcd import EtcdDiscovery
from kvmesh.runtime.discovery.file import FileDiscovery
from kvmesh.runtime.discovery.memory import MemoryDiscovery
from kvmesh.runtime.distributed import Client, DistributedRuntime, RequestClient, instance_key
from kvmesh.runtime.names import COMPONENT, GENERATE
from tests.services import Etcd

pytestmark = pytest.mark.timeout(90)

NS = "kvmesh"
ENGINE = EngineConfig("m", "m", 2048, 16, 1024, 8, 2048)
BIG = 1400 * 1024  # under etcd's default 1.5 MiB request cap: etcd takes it


def record(worker_id: int, **fields: str) -> bytes:
    return msgspec.json.encode(InstanceInfo(worker_id, "127.0.0.1:9", ENGINE, **fields))


def key_of(worker_id: int) -> str:
    return instance_key(NS, COMPONENT, GENERATE, worker_id)


class Frontend:
    """What a frontend runs: a runtime on etcd and the watch of the generate prefix."""

    def __init__(self, runtime: DistributedRuntime) -> None:
        self.runtime = runtime
        self.attached: list[int] = []
        self.client: Client | None = None

    @property
    def discovery(self) -> EtcdDiscovery:
        d = self.runtime.discovery
        assert isinstance(d, EtcdDiscovery)
        return d

    async def watch(self) -> Client:
        async def added(info: InstanceInfo, client: RequestClient) -> None:
            self.attached.append(info.worker_id)
            await client.close()

        async def removed(worker_id: int) -> None:
            self.attached.remove(worker_id)

        endpoint = self.runtime.namespace(NS).component(COMPONENT).endpoint(GENERATE)
        self.client = endpoint.client(added, removed)
        await self.client.start()
        return self.client

    async def until(self, done: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"{what}; attached {[f'{w:x}' for w in self.attached]}"
            await asyncio.sleep(0.02)


@pytest.fixture
async def make_frontend(etcd: Etcd) -> AsyncIterator[Callable[[], Awaitable[Frontend]]]:
    made: list[Frontend] = []

    async def new() -> Frontend:
        rt = DistributedRuntime(RuntimeConfig(discovery="etcd"), EtcdDiscovery([etcd.endpoint]), secret=None)
        await rt.start()
        made.append(Frontend(rt))
        return made[-1]

    yield new
    for f in made:
        if f.client is not None:
            await f.client.close()
        await f.runtime.shutdown()


async def test_huge_and_nested_records_are_refused_before_decoding_and_the_others_attached(make_frontend, caplog) -> None:
    caplog.set_level(logging.WARNING)
    attacker, frontend = await make_frontend(), await make_frontend()
    await frontend.watch()
    put = attacker.discovery.put
    await put(key_of(0xA1), record(0xA1))
    await put(key_of(0xB2), record(0xB2, hostname="x" * BIG))  # well-formed, signed or not: 1.4 MB
    await put(key_of(0xC3), b"[" * (BIG // 2) + b"]" * (BIG // 2))  # 700,000 levels deep
    not_utf8 = key_of(0xC4).encode() + b"\xff"
    await attacker.discovery._call(lambda c: c.put(not_utf8, record(0xC4)))  # a key no kvmesh process writes
    await put(key_of(0xD4), record(0xD4))
    await frontend.until(lambda: 0xD4 in frontend.attached, "the record put after the attack was not attached")
    assert sorted(frontend.attached) == [0xA1, 0xD4], "an oversized record was decoded and attached"
    assert frontend.discovery.refused == {"too_large": 2, "too_many": 0}
    assert "refusing record /services/kvmesh/backend/generate-b2" in caplog.text
    # a refused record replacing a good one takes the good one out (its key no longer holds it)
    await put(key_of(0xA1), record(0xA1, hostname="y" * BIG))
    await frontend.until(lambda: 0xA1 not in frontend.attached, "a key replaced by an oversized value kept its old record")
    # the planner's reads (get_prefix: standby and serving records) get the same bound
    got = await frontend.discovery.get_prefix(key_of(0)[:-1])
    assert sorted(got) == [key_of(0xD4)]
    await put(standby_key(NS, 0x51), record(0x51))
    await put(standby_key(NS, 0x52), record(0x52, hostname="z" * BIG))
    fleet = DiscoveryFleet(frontend.runtime)
    await fleet._scan()
    assert sorted(fleet._standby) == [0x51] and sorted(fleet._serving) == [0xD4]
    registry = CollectorRegistry()
    count_discovery_refusals(registry, frontend.discovery.refused)
    assert f'kvmesh_discovery_records_refused_total{{reason="too_large"}} {frontend.discovery.refused["too_large"]}.0' in (
        generate_latest(registry).decode()
    )


async def test_a_prefix_too_large_for_one_read_is_still_read(make_frontend) -> None:
    """Three 1.4 MB records make a read of the whole prefix larger than gRPC takes in
    one message (4 MiB): one read of it fails every time, and a new frontend would
    never see the well-formed records beside them."""
    attacker = await make_frontend()
    await attacker.discovery.put(key_of(0xA1), record(0xA1))
    for junk in (0xE1, 0xE2, 0xE3):
        await attacker.discovery.put(key_of(junk), b"x" * BIG)
    await attacker.discovery.put(key_of(0xF1), record(0xF1))
    frontend = await make_frontend()
    got = await asyncio.wait_for(frontend.discovery.get_prefix(key_of(0)[:-1]), 20)
    assert sorted(got) == [key_of(0xA1), key_of(0xF1)]
    await frontend.watch()
    await frontend.until(lambda: sorted(frontend.attached) == [0xA1, 0xF1], "the watch never read the prefix")
    assert frontend.discovery.refused["too_large"] == 6  # 3 by the read, 3 by the watch


async def test_records_past_the_count_bound_are_refused_counted_and_logged(make_frontend, caplog) -> None:
    caplog.set_level(logging.WARNING)
    attacker = await make_frontend()
    for worker_id in range(1, 13):
        await attacker.discovery.put(key_of(worker_id), record(worker_id))
    frontend = await make_frontend()
    frontend.discovery.max_records = 8
    got = await frontend.discovery.get_prefix(key_of(0)[:-1])
    assert sorted(got) == [key_of(w) for w in range(1, 9)]  # the first 8 in key order
    await frontend.watch()
    await frontend.until(lambda: len(frontend.attached) == 8, "8 records not attached")
    await attacker.discovery.put(key_of(1), record(1, hostname="h"))  # an update of a key it has
    await attacker.discovery.put(key_of(0x99), record(0x99))  # a new key past the bound (seen after the update)
    await frontend.until(lambda: frontend.discovery.refused["too_many"] == 9, "the new key was not refused")
    assert sorted(frontend.attached) == list(range(1, 9)) and frontend.client is not None
    assert frontend.client.known[1].hostname == "h"
    assert "holds more than 8 keys" in caplog.text
    # a delete frees a slot for the next new key
    await attacker.discovery.delete(key_of(2))
    await attacker.discovery.put(key_of(0x9A), record(0x9A))
    await frontend.until(lambda: 0x9A in frontend.attached, "a freed slot was not used")
    assert 2 not in frontend.attached and 0x99 not in frontend.attached


async def test_the_watch_bound_on_every_backend() -> None:
    """The bound is the discovery layer's, not etcd's: the in-process backend too."""
    d = MemoryDiscovery()
    d.max_value_bytes, d.max_records = 100, 3
    await d.put("/p/0", b"0")
    events = d.watch_prefix("/p/")
    assert await anext(events) == WatchEvent("put", "/p/0", b"0")  # watching from here on
    await d.put("/p/a", b"a")
    await d.put("/p/big", b"x" * 101)
    await d.put("/p/b", b"b")
    await d.put("/p/c", b"c")  # past the count
    await d.delete("/p/big")  # never given out: nothing to delete
    await d.delete("/p/c")
    await d.put("/p/a", b"y" * 101)  # a kept key's value refused: it is gone for the watcher
    await d.put("/p/d", b"d")
    got = [await anext(events) for _ in range(4)]
    assert got == [
        WatchEvent("put", "/p/a", b"a"),
        WatchEvent("put", "/p/b", b"b"),
        WatchEvent("delete", "/p/a"),
        WatchEvent("put", "/p/d", b"d"),
    ]
    assert d.refused == {"too_large": 2, "too_many": 1}
    assert await d.get_prefix("/p/") == {"/p/0": b"0", "/p/b": b"b", "/p/d": b"d"}
    await events.aclose()
    await d.close()


async def test_the_file_backend_does_not_read_an_oversized_entry(tmp_path) -> None:
    d = FileDiscovery(tmp_path / "disc", poll_interval_s=0.01)
    await d.connect()
    d.max_value_bytes = 100
    await d.put("/p/big", b"x" * 10_000)
    await d.put("/p/ok", b"ok")
    assert await d.get_prefix("/p/") == {"/p/ok": b"ok"}
    events = d.watch_prefix("/p/")
    assert await anext(events) == WatchEvent("put", "/p/ok", b"ok")
    await d.put("/p/ok2", b"ok2")
    assert await anext(events) == WatchEvent("put", "/p/ok2", b"ok2")  # polled again: big not given out
    assert d.refused["too_large"] == 2  # once by get_prefix, once by the watch
    await events.aclose()
    await d.close()


async def test_a_watch_catching_up_over_large_records_resumes(etcd: Etcd) -> None:
    """A watch that resumes after losing etcd gets the changes it missed in one
    response: three 1.4 MB records put meanwhile made it larger than gRPC takes
    (4 MiB), and the watch failed the same way on every retry. It re-reads the prefix
    (in pages) instead, and watches on from there."""
    from tests.proxy import CuttableProxy

    proxy = CuttableProxy("127.0.0.1", etcd.client_port)
    await proxy.start()
    watcher, writer = EtcdDiscovery([proxy.endpoint], retry_max_s=0.3), EtcdDiscovery([etcd.endpoint])
    await watcher.connect()
    await writer.connect()
    seen: list[WatchEvent] = []

    async def collect() -> None:
        async for event in watcher.watch_prefix("/p/"):
            seen.append(event)

    async def until_seen(event: WatchEvent) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(20):
                while event not in seen:
                    await asyncio.sleep(0.02)
        assert event in seen, f"{event} not seen: the watch did not resume"

    task = asyncio.get_running_loop().create_task(collect())
    try:
        await writer.put("/p/a", b"a")
        await until_seen(WatchEvent("put", "/p/a", b"a"))
        await proxy.cut()
        for i in range(3):
            await writer.put(f"/p/big{i}", b"x" * BIG)
        await writer.put("/p/b", b"b")
        await proxy.restore()
        await until_seen(WatchEvent("put", "/p/b", b"b"))
        assert watcher.refused["too_large"] == 3 and [e.key for e in seen] == ["/p/a", "/p/b"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.close()
        await writer.close()
        await proxy.cut()


async def test_a_malformed_record_at_a_decode_workers_key_is_no_kv_endpoint(caplog) -> None:
    """A prefill worker looks a decode worker's KV endpoint up in its record: junk
    there is no endpoint (logged), not an exception out of the lookup."""
    from types import SimpleNamespace

    from kvmesh.worker.disagg import _metadata_lookup

    discovery = MemoryDiscovery()
    runtime = SimpleNamespace(config=SimpleNamespace(namespace=NS), discovery=discovery, secret=None)
    lookup = _metadata_lookup(object(), runtime)  # type: ignore[arg-type]
    await discovery.put(key_of(0x7), b'{"lease_id": "not a number"')
    assert await lookup(0x7) is None
    assert "not an instance record" in caplog.text
