"""KV events cannot poison routing: a real worker publishes on the zmq event plane
while a rogue publisher sends hash −1, an invalid UTF-8 topic, events in another
worker's name, oversized messages and (with a cluster secret) unsigned envelopes.
Every bad event is counted as rejected, the router's reader keeps going, and the real
worker's events keep being applied."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.protocol import BlockStored, InstanceInfo, KvEvent, OutputChunk, PreprocessedRequest, StopConditions
from kvmesh.router.core import RouterSettings
from kvmesh.router.indexer import KvIndexer
from kvmesh.router.service import KvRouterService
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context
from kvmesh.runtime.event_plane.base import Envelope
from kvmesh.runtime.event_plane.zmq import ZmqEventPlane
from kvmesh.runtime.events import CallbackPublisher, NullPublisher
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import GENERATE, KV_EVENTS_TOPIC
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.worker.service import WorkerService

pytestmark = pytest.mark.timeout(90)

WORKER, ROGUE = 0x7, 0x66
BLOCK = 16
SECRET = ClusterSecret(b"e" * 32)
enc = msgspec.msgpack.encode


async def _until(predicate, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _generate(client: TcpClient, seed: int) -> None:
    prompt = [(seed * 131 + i) % 1900 + 100 for i in range(3 * BLOCK + 5)]
    req = PreprocessedRequest(
        request_id=str(seed), model="m", token_ids=prompt, stop=StopConditions(max_tokens=BLOCK + 2, ignore_eos=True)
    )
    decode = msgspec.msgpack.Decoder(OutputChunk).decode
    async for _ in client.stream(GENERATE, enc(req), Context(str(seed)), decode=decode):
        pass


class Stack:
    async def start(self, secret: ClusterSecret | None) -> None:
        self.worker_plane = ZmqEventPlane(secret=secret)
        kv = await self.worker_plane.publisher(KV_EVENTS_TOPIC, WORKER)
        publisher = CallbackPublisher(lambda e: kv.publish(enc(e)), lambda r: None)
        opts = MockerOptions(speedup=1e9, worker_id=WORKER, block_size=BLOCK, eos_rate=0.0)
        self.engine = MockerEngine(opts, publisher)
        self.service = WorkerService(self.engine, server=None)
        config = await self.service.start()
        self.client = TcpClient(self.service.address, secret=None)
        self.metrics = FrontendMetrics()
        self.router_plane = ZmqEventPlane(secret=secret, max_message_bytes=1024 * 1024)
        sub = await self.router_plane.subscribe(KV_EVENTS_TOPIC)
        self.router = KvRouterService(RouterSettings(block_size=BLOCK), sub, self.metrics.model("m").router)
        self.router.start()
        self.router.add_worker(Instance(InstanceInfo(WORKER, self.service.address, config, event_address=kv.address), self.client))
        # the rogue: a publisher the router is connected to, and a worker entry in its name
        self.rogue = zmq.Context.instance().socket(zmq.PUB)
        port = self.rogue.bind_to_random_port("tcp://127.0.0.1")
        rogue_info = InstanceInfo(ROGUE, "127.0.0.1:1", config, event_address=f"tcp://127.0.0.1:{port}")
        self.router.add_worker(Instance(rogue_info, TcpClient("127.0.0.1:1", connect_timeout=0.5, secret=None)))
        self.seed = 0

    def applied(self) -> float:
        return self.metrics.registry.get_sample_value("kvmesh_router_kv_events_applied_total", {"model": "m"}) or 0

    def rejected(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value("kvmesh_router_kv_events_rejected_total", {"model": "m", "reason": reason})
        return value or 0

    async def serve_some(self) -> float:
        """Serve requests until the router applied more of the real worker's events."""
        before = self.applied()
        for _ in range(3):
            self.seed += 1
            await _generate(self.client, self.seed)
        await _until(lambda: self.applied() > before)
        return self.applied()

    def inject(self, *messages: bytes) -> None:
        for data in messages:
            self.rogue.send(data)

    async def close(self) -> None:
        self.rogue.close(linger=0)
        await self.router.close()
        await self.client.close()
        await self.service.shutdown(grace_s=1)
        await self.worker_plane.close()
        await self.router_plane.close()


def _envelope(publisher: int, seq: int, event: KvEvent, topic: str = KV_EVENTS_TOPIC) -> bytes:
    return enc(Envelope(publisher, seq, topic, enc(event)))


def _bad_topic(publisher: int, seq: int, payload: bytes) -> bytes:
    # [publisher, seq, <str with invalid UTF-8>, payload]: msgpack fixarray of 4
    return b"\x94" + enc(publisher) + enc(seq) + b"\xa2\xff\xfe" + enc(payload)


@pytest.fixture
async def stack(request):
    s = Stack()
    await s.start(getattr(request, "param", None))
    try:
        yield s
    finally:
        await s.close()


async def test_poisoned_events_are_counted_and_routing_keeps_working(stack):
    # the rogue's subscription is connected when its first message gets through
    await _until(lambda: (stack.inject(_envelope(ROGUE, 1, KvEvent(ROGUE, 0, BlockStored([5])))), stack.applied() >= 1)[1], 30)
    applied = await stack.serve_some()
    stack.inject(
        _envelope(ROGUE, 2, KvEvent(ROGUE, 1, BlockStored([-1]))),  # hash −1
        _envelope(ROGUE, 3, KvEvent(ROGUE, 1, BlockStored([7, -(1 << 63)]))),  # the most negative
        _bad_topic(ROGUE, 4, b"x"),  # invalid UTF-8 topic
        _envelope(ROGUE, 5, KvEvent(WORKER, 999, BlockStored([1, 2, 3]))),  # in the real worker's name
        _envelope(WORKER, 6, KvEvent(ROGUE, 1, BlockStored([7]))),  # another's publisher id, its own event
        b"\x94" + b"\xc1" * 8,  # not msgpack
        _envelope(ROGUE, 7, KvEvent(ROGUE, 1, BlockStored(list(range(70_000))))),  # too many blocks
        b"\x00" * (2 * 1024 * 1024),  # over the subscriber's maximum message size
    )
    await _until(lambda: stack.rejected("bad_hash") >= 2 and stack.rejected("publisher_mismatch") >= 2)
    await _until(lambda: stack.rejected("too_many_blocks") >= 1)
    sub = stack.router.subscription
    await _until(lambda: sub.malformed >= 2)  # the invalid topic and the junk, dropped by the subscriber
    assert sub._sock.getsockopt(zmq.MAXMSGSIZE) == 1024 * 1024  # zmq drops bigger messages unread
    reader = stack.router._reader  # None: served from the zmq descriptor (Inbox.serve), still watched
    assert (reader is None or not reader.done()) and sub._fd is not None  # the reader never died
    assert 1 not in stack.router.core.indexer.blocks_of(WORKER)
    for _ in range(2):  # the real worker's events keep being applied
        now = await stack.serve_some()
        assert now > applied
        applied = now
    await _until(lambda: stack.router.core.indexer.blocks_of(WORKER) == stack.engine.kv_dump())  # caught up


@pytest.mark.parametrize("stack", [SECRET], indirect=True)
async def test_with_a_secret_a_rogue_can_neither_publish_nor_listen(stack):
    """The router's subscription speaks CURVE with keys derived from the secret: the
    rogue's plain PUB socket never completes a handshake, so nothing it sends arrives;
    a rogue SUB without the secret hears nothing from the real worker."""
    applied = await stack.serve_some()
    sub = stack.router.subscription
    listener = zmq.Context.instance().socket(zmq.SUB)
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    listener.setsockopt(zmq.RCVTIMEO, 200)
    listener.connect(stack.router.workers[WORKER].info.event_address)
    forged = _envelope(WORKER, 10_000, KvEvent(WORKER, 10_000, BlockStored([424242])))
    heard = 0
    try:
        for _ in range(5):
            stack.inject(forged, _envelope(ROGUE, 1, KvEvent(ROGUE, 0, BlockStored([5]))))
            applied = await stack.serve_some()  # the real worker's events keep arriving meanwhile
            try:
                listener.recv(zmq.NOBLOCK)
                heard += 1
            except zmq.Again:
                pass
    finally:
        listener.close(linger=0)
    assert heard == 0
    assert sub.malformed == 0 and sub.unsigned == 0  # nothing of the rogue's was even read
    assert stack.rejected("publisher_mismatch") == 0 and stack.rejected("unknown_worker") == 0
    assert 424242 not in stack.router.core.indexer.blocks_of(WORKER)
    assert stack.router.core.indexer.blocks_of(ROGUE) == set()
    assert applied > 0
    await _until(lambda: stack.router.core.indexer.blocks_of(WORKER) == stack.engine.kv_dump())  # caught up


@pytest.mark.parametrize("stack", [SECRET], indirect=True)
async def test_with_a_secret_a_curve_client_with_its_own_keys_hears_nothing(stack):
    """A rogue that knows the publishers' public key (a public key is no secret) and
    speaks CURVE with a key pair of its own completes no handshake: the publisher's ZAP
    handler admits the fleet's subscriber key only, while the real router keeps hearing."""
    from kvmesh.runtime.event_plane.zmq import CurveKeys

    await stack.serve_some()
    public, secret = zmq.curve_keypair()
    ctx = zmq.Context()
    listener = ctx.socket(zmq.SUB)
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    listener.curve_serverkey = CurveKeys(SECRET).server_public
    listener.curve_publickey, listener.curve_secretkey = public, secret
    listener.connect(stack.router.workers[WORKER].info.event_address)
    heard = 0
    try:
        for _ in range(5):
            applied = await stack.serve_some()  # the real worker publishes meanwhile
            while True:
                try:
                    listener.recv(zmq.NOBLOCK)
                    heard += 1
                except zmq.Again:
                    break
            await asyncio.sleep(0.05)  # let a handshake (if admitted) finish between rounds
    finally:
        listener.close(linger=0)
        ctx.term()
    assert heard == 0
    assert applied > 0


def test_envelopes_from_a_fleet_member_without_a_valid_mac_are_dropped():
    from kvmesh.runtime.event_plane.base import Opener, seal

    opener = Opener(SECRET)
    good = seal(SECRET, Envelope(WORKER, 1, KV_EVENTS_TOPIC, b"x"))
    assert opener.open(enc(good)) is not None
    tampered = Envelope(WORKER, 1, KV_EVENTS_TOPIC, b"y", good.mac)
    assert opener.open(enc(tampered)) is None
    assert opener.open(enc(Envelope(WORKER, 1, KV_EVENTS_TOPIC, b"x"))) is None
    assert opener.unsigned == 2


def test_the_indexer_cap_evicts_a_workers_oldest_blocks():
    idx = KvIndexer(max_blocks_per_worker=64)
    idx.apply(1, BlockStored(list(range(60))))
    idx.apply(2, BlockStored(list(range(1000, 1010))))
    idx.apply(1, BlockStored(list(range(60, 70))))  # 70 > 64: down to 56, the oldest go
    held = idx.blocks_of(1)
    assert held == set(range(14, 70)) and idx.evicted == 14
    assert idx.worker_block_count(1) == 56
    assert idx.blocks_of(2) == set(range(1000, 1010))  # other workers are untouched
    for start in range(100, 100_000, 50):  # a flood stays bounded
        idx.apply(1, BlockStored(list(range(start, start + 50))))
        assert idx.worker_block_count(1) <= 64
    assert idx.find_matches([99_999 - 10, 99_999 - 9]) == {1: 2}
