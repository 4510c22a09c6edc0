"""Discovery backends without a network: memory and file, through the shared contract,
plus what only one of them does (memory ``expire``, file heartbeats and collection)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.runtime.discovery import (
    Discovery,
    FileDiscovery,
    MemoryDiscovery,
    MemoryStore,
    WatchEvent,
    make_discovery,
)

POLL_S = 0.02
Make = Callable[[], Awaitable[Discovery]]


@pytest.fixture(params=["memory", "file"])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Make]:
    """Connected backends that share one state, as separate processes would."""
    store = MemoryStore()
    made: list[Discovery] = []

    async def new() -> Discovery:
        d: Discovery = MemoryDiscovery(store) if request.param == "memory" else FileDiscovery(tmp_path, poll_interval_s=POLL_S)
        await d.connect()
        made.append(d)
        return d

    yield new
    for d in made:
        await d.close()


async def next_event(events: AsyncIterator[WatchEvent], timeout: float = 2.0) -> WatchEvent:
    return await asyncio.wait_for(anext(events), timeout)


async def take(events: AsyncIterator[WatchEvent], n: int) -> list[WatchEvent]:
    return [await next_event(events) for _ in range(n)]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------- make_discovery
def test_make_discovery_kinds(tmp_path: Path) -> None:
    store = MemoryStore()
    memory = make_discovery("memory", store=store)
    assert isinstance(memory, MemoryDiscovery) and memory.store is store
    assert isinstance(make_discovery("file", file_dir=str(tmp_path)), FileDiscovery)
    assert make_discovery("etcd", etcd_endpoints=["http://127.0.0.1:2379"]).name == "etcd"


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("zookeeper", {}, "unknown discovery kind 'zookeeper'"),
        ("file", {}, "file discovery needs file_dir"),
        ("etcd", {}, "etcd discovery needs etcd_endpoints"),
        ("etcd", {"etcd_endpoints": []}, "etcd discovery needs etcd_endpoints"),
        ("etcd", {"etcd_endpoints": ["unix:///run/etcd.sock"]}, "http://host:port"),  # https:// is supported
    ],
)
def test_make_discovery_rejects(kind: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_discovery(kind, **options)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- shared contract
async def test_put_get_delete(make: Make) -> None:
    a, b = await make(), await make()
    await a.put("/svc/x", b"1")
    await a.put("/svc/y z/é%", b"2")  # space, non-ASCII and % survive the file names
    await a.put("/other/x", b"3")
    assert await b.get_prefix("/svc/") == {"/svc/x": b"1", "/svc/y z/é%": b"2"}
    await b.put("/svc/x", b"1b")
    await a.delete("/svc/x")
    await a.delete("/svc/missing")  # deleting nothing is not an error
    assert await b.get_prefix("/svc/") == {"/svc/y z/é%": b"2"}
    assert await b.get_prefix("") == {"/svc/y z/é%": b"2", "/other/x": b"3"}


async def test_watch_yields_snapshot_then_changes(make: Make) -> None:
    a, b = await make(), await make()
    await a.put("/svc/old", b"0")
    await a.put("/unrelated", b"-")
    async with contextlib.aclosing(b.watch_prefix("/svc/")) as events:
        assert await next_event(events) == WatchEvent("put", "/svc/old", b"0")
        await a.put("/svc/new", b"1")
        assert await next_event(events) == WatchEvent("put", "/svc/new", b"1")
        await a.put("/unrelated", b"+")
        await a.put("/svc/new", b"2")
        assert await next_event(events) == WatchEvent("put", "/svc/new", b"2")
        await a.delete("/svc/old")
        assert await next_event(events) == WatchEvent("delete", "/svc/old")


async def test_revoke_deletes_keys_and_sets_lost(make: Make) -> None:
    a, b = await make(), await make()
    lease = await a.grant_lease(5.0)
    other = await a.grant_lease(5.0)
    await a.put("/svc/a", b"a", lease.id)
    await a.put("/svc/kept", b"k", other.id)
    await a.put("/svc/free", b"f")
    async with contextlib.aclosing(b.watch_prefix("/svc/")) as events:
        assert {e.key for e in await take(events, 3)} == {"/svc/a", "/svc/kept", "/svc/free"}
        await lease.revoke()
        assert lease.lost.is_set() and not other.lost.is_set()
        assert await next_event(events) == WatchEvent("delete", "/svc/a")
    assert await b.get_prefix("/svc/") == {"/svc/kept": b"k", "/svc/free": b"f"}
    await lease.revoke()  # idempotent
    with pytest.raises(InvalidArgument, match="not found"):
        await a.put("/svc/late", b"x", lease.id)


async def test_close_is_idempotent_and_ends_watches(make: Make) -> None:
    a = await make()
    await a.put("/svc/a", b"a")
    events = a.watch_prefix("/svc/")
    assert await next_event(events) == WatchEvent("put", "/svc/a", b"a")
    pending = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.05)
    await a.close()
    await a.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, 2.0)


# ---------------------------------------------------------------------- memory only
async def test_memory_expire_simulates_a_dead_process() -> None:
    store = MemoryStore()
    owner, watcher = MemoryDiscovery(store), MemoryDiscovery(store)
    lease = await owner.grant_lease(0.01)
    await owner.put("/svc/w", b"w", lease.id)
    await asyncio.sleep(0.05)
    assert not lease.lost.is_set()  # memory leases never expire by themselves
    async with contextlib.aclosing(watcher.watch_prefix("/svc/")) as events:
        assert await next_event(events) == WatchEvent("put", "/svc/w", b"w")
        watcher.expire(lease.id)
        assert await next_event(events) == WatchEvent("delete", "/svc/w")
    assert lease.lost.is_set()
    assert await owner.get_prefix("/") == {}


# ---------------------------------------------------------------------- file only
async def file_pair(directory: Path) -> tuple[FileDiscovery, FileDiscovery]:
    a = FileDiscovery(directory, poll_interval_s=POLL_S)
    b = FileDiscovery(directory, poll_interval_s=POLL_S)
    await a.connect()
    await b.connect()
    return a, b


async def test_file_keys_vanish_when_heartbeat_stops(tmp_path: Path) -> None:
    a, b = await file_pair(tmp_path)
    try:
        lease = await a.grant_lease(0.5)
        await a.put("/svc/a", b"a", lease.id)
        await asyncio.sleep(1.0)  # two TTLs: the heartbeat keeps it alive
        assert await b.get_prefix("/svc/") == {"/svc/a": b"a"}
        async with contextlib.aclosing(b.watch_prefix("/svc/")) as events:
            assert await next_event(events) == WatchEvent("put", "/svc/a", b"a")
            stopped = time.monotonic()
            await a.close()  # the process "dies": no more heartbeats, nothing revoked
            assert await next_event(events, timeout=30.0) == WatchEvent("delete", "/svc/a")
            # not before the 0.5 s TTL ran out (a load can only make it later); the upper
            # end is the deadline above: a live heartbeat would hold the key forever
            assert time.monotonic() - stopped >= 0.3
        # The reader collected the dead lease's key and heartbeat.
        assert os.listdir(tmp_path / "keys") == [] and os.listdir(tmp_path / "leases") == []
    finally:
        await a.close()
        await b.close()


async def test_file_lease_lost_when_heartbeat_removed(tmp_path: Path) -> None:
    a, b = await file_pair(tmp_path)
    try:
        lease = await a.grant_lease(0.3)
        await a.put("/svc/a", b"a", lease.id)
        os.unlink(tmp_path / "leases" / f"{lease.id:x}")  # revoked by someone else
        assert await b.get_prefix("/svc/") == {}
        await asyncio.wait_for(lease.lost.wait(), 1.0)
    finally:
        await a.close()
        await b.close()


async def test_file_layout_is_atomic_and_readable(tmp_path: Path) -> None:
    a, _ = await file_pair(tmp_path)
    try:
        lease = await a.grant_lease(2.0)
        assert 0 < lease.id < 2**63
        await a.put("/svc/e-1", b"v", lease.id)
        assert os.listdir(tmp_path / "keys") == ["k%2Fsvc%2Fe-1"]  # no temp file left behind
        assert (tmp_path / "leases" / f"{lease.id:x}").read_text().strip() == "2.0"
        with pytest.raises(InvalidArgument, match="too long"):
            await a.put("/" + "x" * 300, b"v")
    finally:
        await a.close()
