"""EtcdDiscovery against a real etcd: registration, watches, lease expiry and
revocation, and etcd being killed and restarted under a watch and a lease."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import aetcd
import msgspec
import pytest

from kvmesh.errors import CannotConnect, InvalidArgument
from kvmesh.runtime.discovery import WatchEvent
from kvmesh.runtime.discovery import etcd as etcd_discovery
from kvmesh.runtime.discovery.etcd import EtcdDiscovery
from tests.helpers import free_port
from tests.proxy import CuttableProxy
from tests.services import Etcd

T = TypeVar("T")


@pytest.fixture
async def connect(etcd: Etcd) -> AsyncIterator[Callable[..., Awaitable[EtcdDiscovery]]]:
    made: list[EtcdDiscovery] = []

    async def new(endpoints: list[str] | None = None, **options: float) -> EtcdDiscovery:
        d = EtcdDiscovery(endpoints or [etcd.endpoint], **options)
        await d.connect()
        made.append(d)
        return d

    yield new
    for d in made:
        await d.close()


class Collector:
    """Drains a watch into a list from a task of its own, as a long-lived client would."""

    def __init__(self, events: AsyncIterator[WatchEvent]) -> None:
        self.events: list[WatchEvent] = []
        self._source = events
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        async for event in self._source:
            self.events.append(event)

    async def wait_for(self, event: WatchEvent, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while event not in self.events:
            assert time.monotonic() < deadline, f"{event} not seen; got {self.events}"
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def retry(op: Callable[[], Awaitable[T]], timeout: float = 15.0) -> T:
    """``op`` once etcd answers again (right after a restart it may not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await op()
        except CannotConnect:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_register_discover_watch(connect) -> None:
    worker, frontend = await connect(), await connect()
    lease = await worker.grant_lease(10)
    assert lease.ttl_s == 10 and lease.id > 0
    await worker.put("/services/ns/backend/generate-1", b"one", lease.id)
    assert await frontend.get_prefix("/services/ns/backend/") == {"/services/ns/backend/generate-1": b"one"}
    async with contextlib.aclosing(frontend.watch_prefix("/services/ns/backend/")) as events:
        assert await anext(events) == WatchEvent("put", "/services/ns/backend/generate-1", b"one")
        await worker.put("/services/ns/backend/generate-2", b"two", lease.id)
        await worker.put("/services/ns/other/x", b"-")
        await worker.delete("/services/ns/backend/generate-1")
        assert await asyncio.wait_for(anext(events), 5) == WatchEvent("put", "/services/ns/backend/generate-2", b"two")
        assert await asyncio.wait_for(anext(events), 5) == WatchEvent("delete", "/services/ns/backend/generate-1")
    await lease.revoke()
    await lease.revoke()  # idempotent
    assert lease.lost.is_set()
    assert await frontend.get_prefix("/services/ns/backend/") == {}
    with pytest.raises(InvalidArgument, match="lease not found"):
        await worker.put("/services/ns/backend/late", b"x", lease.id)


async def test_connect_tries_endpoints_in_order(etcd: Etcd, connect, monkeypatch: pytest.MonkeyPatch) -> None:
    d = await connect([f"http://127.0.0.1:{free_port()}", etcd.endpoint])
    await d.put("/k", b"v")
    assert await d.get_prefix("/k") == {"/k": b"v"}
    # nothing answers: connect retries on its backoff for connect_timeout_s, then gives
    # up. Every delay handed out before the last one was slept, so their sum is the
    # time it spent retrying: it may never pass the configured timeout.
    timeout = 0.5
    delays: list[float] = []
    schedule = etcd_discovery._Backoff.next

    def next_delay(backoff: etcd_discovery._Backoff) -> float:
        assert sum(delays) <= timeout, f"retried on past connect_timeout_s={timeout}: slept {delays}"
        delays.append(schedule(backoff))
        return delays[-1]

    monkeypatch.setattr(etcd_discovery._Backoff, "next", next_delay)
    with pytest.raises(CannotConnect, match="no etcd endpoint answered") as refused:
        await connect([f"http://127.0.0.1:{free_port()}"], connect_timeout_s=timeout)
    assert delays, "gave up without consulting its retry schedule"
    # each try failed at once, refused: none waited for the request timeout
    assert type(refused.value.__cause__) is aetcd.ConnectionFailedError, repr(refused.value.__cause__)


async def test_lease_expires_when_keep_alive_stops(connect) -> None:
    worker, frontend = await connect(), await connect()
    lease = await worker.grant_lease(2)
    await worker.put("/services/ns/backend/generate-x", b"x", lease.id)
    watch = Collector(frontend.watch_prefix("/services/ns/backend/"))
    try:
        await watch.wait_for(WatchEvent("put", "/services/ns/backend/generate-x", b"x"))
        await asyncio.sleep(3)  # longer than the TTL: the keep-alive holds it
        assert await frontend.get_prefix("/services/") != {}
        await worker.close()  # stops the keep-alive, revokes nothing
        # expired by etcd after about one TTL (a live keep-alive would hold it forever)
        await watch.wait_for(WatchEvent("delete", "/services/ns/backend/generate-x"), timeout=30)
    finally:
        await watch.close()


async def test_etcdctl_revoke_removes_keys_and_sets_lost(etcd: Etcd, connect) -> None:
    worker = await connect()
    answers: list[int | None] = []  # what each keep-alive heard back: a TTL, or None (unreachable)
    refresh = worker._refresh

    async def counted(lease_id: int, timeout: float) -> int | None:
        answers.append(await refresh(lease_id, timeout))
        return answers[-1]

    worker._refresh = counted  # type: ignore[method-assign]
    lease = await worker.grant_lease(3)
    await worker.put("/services/ns/backend/generate-r", b"r", lease.id)
    etcd.etcdctl("lease", "revoke", f"{lease.id:x}")
    revoked = len(answers)
    assert await worker.get_prefix("/services/") == {}
    await asyncio.wait_for(lease.lost.wait(), 10 * lease.ttl_s)
    # lost at the first keep-alive that heard "gone" (TTL 0), the last one sent: any
    # before it were answered with a TTL or found etcd slow (one may have been in flight)
    after = answers[revoked:]
    assert [a is not None and a <= 0 for a in after] == [False] * (len(after) - 1) + [True], after
    assert not lease.expired  # gone while in contact: revoked, the stop signal


async def test_watch_resumes_after_etcd_restart(etcd: Etcd, connect, caplog: pytest.LogCaptureFixture) -> None:
    worker, frontend = await connect(), await connect()
    lease = await worker.grant_lease(10)
    await worker.put("/services/a", b"a", lease.id)
    await worker.put("/services/b", b"b")
    watch = Collector(frontend.watch_prefix("/services/"))
    try:
        await watch.wait_for(WatchEvent("put", "/services/b", b"b"))
        etcd.kill()
        await asyncio.sleep(3)
        etcd.start()
        late = await connect()  # a process starting just after etcd did
        await retry(lambda: late.put("/services/c", b"c"))
        await worker.delete("/services/b")
        await watch.wait_for(WatchEvent("delete", "/services/b"))
        assert watch.events == [
            WatchEvent("put", "/services/a", b"a"),
            WatchEvent("put", "/services/b", b"b"),
            WatchEvent("put", "/services/c", b"c"),
            WatchEvent("delete", "/services/b"),
        ]
        assert "etcd watch on /services/ interrupted" in caplog.text  # it did go through an outage
    finally:
        await watch.close()


async def test_lease_survives_a_shorter_outage(etcd: Etcd, connect) -> None:
    worker, frontend = await connect(), await connect()
    lease = await worker.grant_lease(10)
    await worker.put("/services/w", b"w", lease.id)
    etcd.kill()
    await asyncio.sleep(5)
    etcd.start()
    assert await retry(lambda: frontend.get_prefix("/services/")) == {"/services/w": b"w"}
    await asyncio.sleep(2)  # the keep-alive retries every second until etcd answers
    assert not lease.lost.is_set()
    assert (await worker.get_prefix("/services/")).keys() == {"/services/w"}
    assert int(json.loads(etcd.etcdctl("lease", "timetolive", f"{lease.id:x}", "-w", "json"))["ttl"]) > 5


async def test_lease_outlives_an_etcd_outage_longer_than_its_ttl(etcd: Etcd, connect) -> None:
    worker = await connect(retry_max_s=0.3)
    lease = await worker.grant_lease(2)
    await worker.put("/services/w", b"w", lease.id)
    etcd.kill()
    await asyncio.sleep(3 * lease.ttl_s)  # unreachable for 3 TTLs: not a lost lease
    assert not lease.lost.is_set()
    etcd.start()  # etcd extends every lease on restart; the keep-alive finds it
    await retry(lambda: worker.get_prefix("/services/"))
    await asyncio.sleep(lease.ttl_s)  # past the extended TTL: only keep-alives hold it now
    assert not lease.lost.is_set()
    assert (await worker.get_prefix("/services/")).keys() == {"/services/w"}


async def test_lease_expired_while_cut_off_is_lost_as_expired(etcd: Etcd, connect) -> None:
    host, port = etcd.endpoint.removeprefix("http://").split(":")
    proxy = CuttableProxy(host, int(port))
    await proxy.start()
    try:
        worker, other = await connect([proxy.endpoint], retry_max_s=0.3), await connect()
        lease = await worker.grant_lease(2)
        await worker.put("/services/w", b"w", lease.id)
        await proxy.cut()  # etcd is up; only this client cannot reach it
        watch = Collector(other.watch_prefix("/services/"))
        await watch.wait_for(WatchEvent("delete", "/services/w"), timeout=10)
        assert not lease.lost.is_set()  # it cannot know yet
        await proxy.restore()
        await asyncio.wait_for(lease.lost.wait(), 10)
        assert lease.expired  # may have run out while cut off: the owner re-registers
        await watch.close()
    finally:
        await proxy.close()


async def test_watch_after_compaction_yields_the_difference(etcd: Etcd, connect, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvmesh.discovery.etcd")
    worker, frontend = await connect(), await connect()
    await worker.put("/services/gone", b"1")
    await worker.put("/services/same", b"2")
    await worker.put("/services/changed", b"3")
    async with contextlib.aclosing(frontend.watch_prefix("/services/")) as events:
        assert len([await anext(events) for _ in range(3)]) == 3
        # NOTE: the watch is now parked after its snapshot, before it watches from the
        # snapshot's revision + 1; compacting past that revision forces a re-read.
        await worker.delete("/services/gone")
        await worker.put("/services/changed", b"3b")
        await worker.put("/services/new", b"4")
        etcd.etcdctl("compact", str(_revision(etcd)))
        got = [await asyncio.wait_for(anext(events), 5) for _ in range(3)]
        assert sorted(got, key=lambda e: e.key) == [
            WatchEvent("put", "/services/changed", b"3b"),
            WatchEvent("delete", "/services/gone"),
            WatchEvent("put", "/services/new", b"4"),
        ]
        assert "re-reading the prefix" in caplog.text
        await worker.put("/services/after", b"5")
        assert await asyncio.wait_for(anext(events), 5) == WatchEvent("put", "/services/after", b"5")


def _revision(etcd: Etcd) -> int:
    status = json.loads(etcd.etcdctl("endpoint", "status", "-w", "json"))
    return int(status[0]["Status"]["header"]["revision"])


async def test_runtime_cut_off_past_its_ttl_comes_back_under_the_same_key(etcd: Etcd, connect) -> None:
    """A process cut off from etcd (etcd itself up) for longer than its lease TTL:
    discovery drops its instance; once it reaches etcd again it takes a new lease and
    its record comes back under the same key with the same worker id, and nothing
    tells it to stop."""
    from kvmesh.config import RuntimeConfig
    from kvmesh.protocol import EngineConfig
    from kvmesh.runtime.distributed import DistributedRuntime

    host, port = etcd.endpoint.removeprefix("http://").split(":")
    proxy = CuttableProxy(host, int(port))
    await proxy.start()
    discovery = EtcdDiscovery([proxy.endpoint], retry_max_s=0.3)
    runtime = DistributedRuntime(RuntimeConfig(discovery="etcd", lease_ttl_s=2), discovery=discovery)
    await runtime.start()
    other = await connect()
    watch = Collector(other.watch_prefix("/services/"))
    try:
        endpoint = runtime.namespace("ns").component("backend").endpoint("generate")

        class Server:
            host, port = "127.0.0.1", 1

        info = endpoint.describe(Server(), engine=EngineConfig("m", "m", 128, 16, 64, 8, 256), model_path="m")  # type: ignore[arg-type]
        await endpoint.register(info)
        key = f"/services/ns/backend/generate-{runtime.lease_id:x}"
        await watch.wait_for(WatchEvent("put", key, msgspec.json.encode(info)))
        first_lease = runtime.lease.id  # type: ignore[union-attr]
        await proxy.cut()
        await watch.wait_for(WatchEvent("delete", key), timeout=10)
        await proxy.restore()
        async with asyncio.timeout(15):
            while runtime.renewals < 1:
                await asyncio.sleep(0.05)
        assert [e.kind for e in watch.events if e.key == key] == ["put", "delete", "put"]
        assert watch.events[-1].value == watch.events[0].value  # the same record: same worker id
        assert runtime.lease.id != first_lease and runtime.lease_id == first_lease  # type: ignore[union-attr]
        assert not runtime.lease_lost.is_set()
    finally:
        await watch.close()
        await runtime.shutdown()
        await proxy.close()


async def test_thresholds_watch_outlives_an_etcd_restart(etcd: Etcd, connect) -> None:
    """A decode worker's watch of the disaggregation thresholds: etcd SIGKILLed and
    restarted, and a change made afterwards still reaches the worker."""
    from types import SimpleNamespace

    from kvmesh.protocol import DisaggThresholds
    from kvmesh.worker.disagg import put_thresholds, watch_thresholds

    worker, operator = await connect(retry_max_s=0.3), await connect(retry_max_s=0.3)
    engine = SimpleNamespace(thresholds=DisaggThresholds(100, 4))
    task = asyncio.get_running_loop().create_task(watch_thresholds(worker, "ns", engine))  # type: ignore[arg-type]
    try:
        await put_thresholds(operator, "ns", DisaggThresholds(200, 8))
        async with asyncio.timeout(10):
            while engine.thresholds != DisaggThresholds(200, 8):
                await asyncio.sleep(0.02)
        etcd.kill()
        await asyncio.sleep(3)
        assert engine.thresholds == DisaggThresholds(200, 8)  # kept while etcd is gone
        etcd.start()
        await retry(lambda: put_thresholds(operator, "ns", DisaggThresholds(300, 2)))
        async with asyncio.timeout(15):
            while engine.thresholds != DisaggThresholds(300, 2):
                await asyncio.sleep(0.05)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
