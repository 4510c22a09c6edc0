"""The one way a worker instance boots and joins routing (kvmesh.worker.registration),
in every mode: a distributed worker puts its own record in discovery (memory and file
here, as etcd in tests/e2e/test_distributed.py) and takes it out when it stops; an
embedded worker registers by its READY line and ``kvmesh run``'s roster puts the same
signed record at the same key; a standby registers only when the planner orders it."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import msgspec
import pytest

from kvmesh.assembly.records import Roster
from kvmesh.config import RuntimeConfig, WorkerConfig
from kvmesh.engines.settings import MockerSettings
from kvmesh.planner.orders import Order, order_key, sign_order, standby_key
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.runtime import auth
from kvmesh.runtime.discovery.base import Discovery
from kvmesh.runtime.discovery.file import FileDiscovery
from kvmesh.runtime.discovery.memory import MemoryDiscovery
from kvmesh.runtime.distributed import DistributedRuntime, call, instance_key, record_is_signed
from kvmesh.runtime.names import COMPONENT, GENERATE, INFO
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.worker.main import READY_PREFIX, serve_one
from kvmesh.worker.registration import DiscoveryRegistration, ParentRegistration, ReadyLine, StandbyRegistration

pytestmark = pytest.mark.timeout(60)

SECRET = auth.ClusterSecret(b"k" * 32)
_decode_info = msgspec.json.Decoder(InstanceInfo).decode
MOCKER = MockerSettings(speedup=1e9, num_blocks=64)
ENGINE = EngineConfig("m", "m", 1024, 16, 64, 8, 256)


@pytest.fixture(autouse=True)
def _no_secret_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (auth.SECRET_ENV, auth.SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)


def _discovery(backend: str, tmp_path: Path) -> Discovery:
    return MemoryDiscovery() if backend == "memory" else FileDiscovery(tmp_path, poll_interval_s=0.02)


async def _ready_card(out: io.StringIO, task: asyncio.Future[None]) -> InstanceInfo:
    while READY_PREFIX not in out.getvalue():
        assert not task.done(), task.exception() if task.done() else None
        await asyncio.sleep(0.01)
    (line,) = out.getvalue().splitlines()
    return _decode_info(line[len(READY_PREFIX) :])


async def _record(discovery: Discovery, key: str) -> InstanceInfo | None:
    value = (await discovery.get_prefix(key)).get(key)
    return None if value is None else _decode_info(value)


@pytest.mark.parametrize("backend", ["memory", "file"])
async def test_a_distributed_worker_registers_itself_and_is_gone_when_it_stops(backend: str, tmp_path: Path) -> None:
    rcfg = RuntimeConfig(discovery=backend, file_discovery_dir=str(tmp_path), namespace="ns")
    discovery = _discovery(backend, tmp_path)
    await discovery.connect()
    runtime = DistributedRuntime(rcfg, discovery, SECRET, borrowed=True)
    out, stop = io.StringIO(), asyncio.Event()
    task = asyncio.ensure_future(serve_one(WorkerConfig(grace_s=0.2, engine_options=MOCKER), rcfg, stop, out, runtime=runtime))
    try:
        card = await _ready_card(out, task)
        key = instance_key("ns", COMPONENT, GENERATE, card.worker_id)
        record = await _record(discovery, key)  # registered before it said READY
        assert record is not None and record_is_signed(SECRET, key, record)
        assert record.worker_id == runtime.lease_id and record.address == card.address and record.event_address
        client = TcpClient(record.address, secret=SECRET)
        try:  # the record names the instance that answers there
            info = await call(client, INFO, decode=msgspec.msgpack.Decoder(InstanceInfo).decode)
        finally:
            await client.close()
        assert info is not None and info.worker_id == card.worker_id
        stop.set()
        await asyncio.wait_for(task, 30)
        assert await _record(discovery, key) is None
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await discovery.close()


async def test_an_embedded_worker_registers_by_its_ready_line_into_the_same_record() -> None:
    """``kvmesh run``: the worker's READY line, read by its supervisor, becomes the roster's
    record in the run's in-process discovery: the key and signature a distributed worker's
    own registration has."""
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory"), secret=SECRET)
    await runtime.start()
    roster = Roster(runtime)
    events = roster.events()
    out, stop = io.StringIO(), asyncio.Event()
    task = asyncio.ensure_future(serve_one(WorkerConfig(worker_id=5, grace_s=0.2, engine_options=MOCKER), None, stop, out))
    try:
        card = await _ready_card(out, task)
        assert card.worker_id == 5 and card.component == COMPONENT and card.endpoint == GENERATE
        await events.on_ready(card)
        key = instance_key(runtime.config.namespace, COMPONENT, GENERATE, 5)
        record = await _record(runtime.discovery, key)
        assert record is not None and record_is_signed(SECRET, key, record)
        assert msgspec.structs.replace(record, mac="") == card
        assert roster.kv_endpoint(5) == card.kv
        await events.on_exit(5)
        assert await _record(runtime.discovery, key) is None and roster.cards == {}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await runtime.shutdown()


async def test_under_a_planner_the_roster_keeps_the_card_and_leaves_publishing_to_it() -> None:
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory"), secret=SECRET)
    await runtime.start()
    heard: list[object] = []

    class Planner:
        async def on_ready(self, info: InstanceInfo) -> None:
            heard.append(info.worker_id)

        async def on_exit(self, worker_id: int) -> None:
            heard.append(-worker_id)

        async def on_failed(self, worker_id: int, why: str) -> None:
            heard.append(why)

    try:
        roster = Roster(runtime)
        events = roster.events(Planner())
        card = InstanceInfo(7, "127.0.0.1:1", ENGINE)
        await events.on_ready(card)
        assert heard == [7] and roster.cards == {7: card}  # a spare's card: the prefill queue finds it
        assert not await runtime.discovery.get_prefix("/services/")  # not routable unless the planner says so
        await events.on_failed(8, "boom")
        await events.on_exit(7)
        assert heard == [7, "boom", -7] and roster.cards == {}
    finally:
        await runtime.shutdown()


def test_the_ready_line_is_written_once_and_is_a_static_workers_registration() -> None:
    out, calls = io.StringIO(), []
    ready = ReadyLine(out, lambda: calls.append(1))
    registration = ParentRegistration(ready)
    card = InstanceInfo(3, "127.0.0.1:9", ENGINE)
    assert asyncio.run(registration.register(card, asyncio.Event()))
    ready(card)
    assert out.getvalue().count(READY_PREFIX) == 1 and len(calls) == 2
    assert json.loads(out.getvalue()[len(READY_PREFIX) :])["lease_id"] == 3
    assert not registration.lost.is_set()


async def test_a_standby_registers_only_when_ordered_and_drains_on_the_planners_stop() -> None:
    discovery = MemoryDiscovery()
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory", namespace="ns"), discovery, SECRET)
    await runtime.start()
    out = io.StringIO()
    endpoint = runtime.namespace().component(COMPONENT).endpoint(GENERATE)
    standby = StandbyRegistration(DiscoveryRegistration(endpoint), ReadyLine(out))
    card = InstanceInfo(runtime.lease_id, "127.0.0.1:1", ENGINE, component=COMPONENT)
    key = instance_key("ns", COMPONENT, GENERATE, runtime.lease_id)
    stop = asyncio.Event()

    async def order(action: str, seq: int) -> None:
        okey = order_key("ns", runtime.lease_id)
        signed = sign_order(SECRET, okey, Order(runtime.lease_id, action, seq, "test"))  # type: ignore[arg-type]
        await discovery.put(okey, msgspec.json.encode(signed))

    registering = asyncio.ensure_future(standby.register(card, stop))
    try:
        while not await discovery.get_prefix(standby_key("ns", runtime.lease_id)):
            await asyncio.sleep(0.01)
        assert out.getvalue().startswith(READY_PREFIX)  # up, though not routed to
        assert await _record(discovery, key) is None
        await order("serve", 1)
        assert await asyncio.wait_for(registering, 10)
        record = await _record(discovery, key)
        assert record is not None and record_is_signed(SECRET, key, record) and record.worker_id == card.worker_id
        assert not await discovery.get_prefix(standby_key("ns", runtime.lease_id))
        await order("stop", 2)
        await asyncio.wait_for(stop.wait(), 10)
        await standby.withdraw(0.0)
        assert await _record(discovery, key) is None
    finally:
        registering.cancel()
        await standby.close()
        await runtime.shutdown()
