"""Attacks on the NATS request plane (real nats-server): guessed and borrowed stream
ids on the call-home listener, unsigned requests, call-home without the secret."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import Ack, End, FrameWriter, OutItem
from kvmesh.runtime.nats import CallHomeServer, NatsRequest, NatsRequestClient, NatsRequestServer, connect_nats
from kvmesh.runtime.nats.wire import request_seal

pytestmark = pytest.mark.timeout(60)

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
LEASE = 0xBEEF
SECRET = ClusterSecret(b"k" * 32)


class Endpoints:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def forever(self, payload, ctx):
        self.calls.append("forever")
        while not ctx.is_stopped():
            yield "real"
            await asyncio.sleep(0.01)

    async def count(self, payload, ctx):
        self.calls.append("count")
        for i in range(dec(payload)):
            yield i


async def _eventually(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def fleet(nats, request):
    secret = getattr(request, "param", None)
    worker_nc, caller_nc = await connect_nats(nats.url), await connect_nats(nats.url)
    eps = Endpoints()
    server = NatsRequestServer(worker_nc, "ns", "worker", LEASE, secret=secret)
    server.register("forever", eps.forever)
    server.register("count", eps.count)
    await server.start()
    home = CallHomeServer(secret=secret)
    client = NatsRequestClient(caller_nc, home, "ns", "worker", LEASE, connect_timeout=3.0, response_timeout=5.0)
    try:
        yield server, client, home, eps, caller_nc
    finally:
        await client.close()
        await server.close()
        await home.close()
        await worker_nc.close()
        await caller_nc.close()


async def _inject(home: CallHomeServer, sids, handshake: bool = False) -> asyncio.StreamWriter:
    """A rogue connection to the call-home listener claiming and writing to ``sids``."""
    host, port = home.address.rsplit(":", 1)
    _, w = await asyncio.open_connection(host, int(port))
    fw = FrameWriter()
    for sid in sids:
        fw.add(Ack(sid))
        fw.add(OutItem(sid, "INJECTED"))
        fw.add(End(sid))
    w.write(fw.take())
    await w.drain()
    return w


async def test_stream_ids_are_random_and_frames_from_another_connection_are_dropped(fleet):
    server, client, home, eps, _ = fleet
    stream = client.stream("forever", enc(0), Context("victim"), decode=dec)
    assert await stream.__anext__() == "real"
    (victim_sid,) = home.streams
    assert victim_sid > 1 << 32  # not a counter from 1
    # the worst case: the rogue knows the id (no guessing at all)
    rogue = await _inject(home, [victim_sid, *range(1, 100)])
    await _eventually(lambda: home.foreign_frames >= 3)
    for _ in range(10):
        assert await stream.__anext__() == "real"
    await stream.aclose()
    rogue.close()


@pytest.mark.parametrize("fleet", [SECRET], indirect=True)
async def test_with_a_secret_the_rogue_is_refused_before_any_frame(fleet, caplog):
    server, client, home, eps, _ = fleet
    stream = client.stream("forever", enc(0), Context("victim"), decode=dec)
    assert await stream.__anext__() == "real"
    (victim_sid,) = home.streams
    rogue = await _inject(home, [victim_sid])
    await _eventually(lambda: "did not start the cluster-secret handshake" in caplog.text)
    for _ in range(5):
        assert await stream.__anext__() == "real"
    assert home.foreign_frames == 0  # never parsed: the connection was refused first
    await stream.aclose()
    rogue.close()


@pytest.mark.parametrize("fleet", [SECRET], indirect=True)
async def test_an_unsigned_request_is_refused_and_the_worker_dials_nothing(fleet, caplog):
    server, client, home, eps, caller_nc = fleet
    # a rogue's own call-home listener: the worker must never dial it
    dialled = asyncio.Event()
    rogue_home = await asyncio.start_server(lambda r, w: dialled.set(), "127.0.0.1", 0)
    port = rogue_home.sockets[0].getsockname()[1]
    try:
        plain = enc(NatsRequest(7, f"127.0.0.1:{port}", msgspec.Raw(enc(3))))
        foreign = request_seal(ClusterSecret(b"z" * 32)).seal(plain, client.subject("count").encode(), time.time())
        for data in (plain, foreign):  # not sealed; sealed with another secret
            reply = dec((await caller_nc.request(client.subject("count"), data, timeout=3)).data)
            assert reply[0] == "invalid_argument" and "cluster secret" in reply[1]
        assert server.unsigned == 2
        assert "not signed with this fleet's cluster secret" in caplog.text
        # the real caller is served meanwhile
        assert [x async for x in client.stream("count", enc(3), Context("ok"), decode=dec)] == [0, 1, 2]
        assert eps.calls == ["count"]
        assert not dialled.is_set()
    finally:
        rogue_home.close()
        await rogue_home.wait_closed()


async def test_a_caller_with_another_secret_is_refused(nats, caplog):
    worker_nc, caller_nc = await connect_nats(nats.url), await connect_nats(nats.url)
    eps = Endpoints()
    server = NatsRequestServer(worker_nc, "ns", "worker", LEASE, secret=SECRET)
    server.register("count", eps.count)
    await server.start()
    home = CallHomeServer(secret=ClusterSecret(b"z" * 32))
    client = NatsRequestClient(caller_nc, home, "ns", "worker", LEASE, connect_timeout=2.0)
    try:
        # the worker's refusal is signed with the worker's secret: this caller ignores it and
        # ends the stream when no call-home came, naming the cluster secret
        with pytest.raises(Exception, match="cluster secret"):
            [x async for x in client.stream("count", enc(3), Context("t"), decode=dec)]
        assert eps.calls == []
    finally:
        await server.close()
        await home.close()
        await worker_nc.close()
        await caller_nc.close()


async def test_prefill_jobs_not_signed_with_the_secret_are_dropped(nats, caplog):
    from kvmesh.disagg.queue import JetStreamPrefillQueue
    from kvmesh.protocol import PrefillJob, PreprocessedRequest, StopConditions

    nc, rogue_nc = await connect_nats(nats.url), await connect_nats(nats.url)
    real = JetStreamPrefillQueue(nc, "sec", secret=SECRET)
    rogue = JetStreamPrefillQueue(rogue_nc, "sec", secret=None)
    request = PreprocessedRequest(request_id="r", model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=1))
    try:
        await rogue.put(PrefillJob("forged", 1, request, [0], 0, 3))
        await real.put(PrefillJob("real", 1, request, [0], 0, 3))
        pulled = []
        for _ in range(4):
            delivery = await real.pull(2.0)
            if delivery is not None:
                pulled.append(delivery.job.job_id)
                await delivery.ack()
        assert pulled == ["real"]
        assert "not signed with this fleet's cluster secret" in caplog.text
    finally:
        await real.close()
        await rogue.close()
        await nc.close()
        await rogue_nc.close()


async def _routed_to_rogue(nc, subject: str, timeout: float = 20.0) -> None:
    """Wait until the server routes the caller's requests on ``subject`` to the rogue (a
    loaded CI run once saw NoResponders right after the rogue's flush)."""
    import nats.errors

    deadline = time.monotonic() + timeout
    while True:
        try:
            await nc.request(subject, b"probe", timeout=2.0)
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            assert time.monotonic() < deadline, f"the rogue's subscription on {subject} never took effect"
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("fleet", [SECRET], indirect=True)
async def test_a_forged_reply_cannot_end_a_stream(fleet, nats, caplog):
    from kvmesh.errors import ResponseTimeout
    from kvmesh.runtime.nats import NatsReply

    server, client, home, eps, caller_nc = fleet
    # a rogue on NATS answers every request for another worker with an unsigned error
    rogue_nc = await connect_nats(nats.url)
    victim = NatsRequestClient(caller_nc, home, "ns", "worker", 0xBAD, connect_timeout=5.0, response_timeout=5.0)
    async def forge(msg):
        await msg.respond(enc(NatsReply("engine_shutdown", "forged")))

    sub = await rogue_nc.subscribe(victim.subject("count"), cb=forge)
    await rogue_nc.flush()
    await _routed_to_rogue(caller_nc, victim.subject("count"))
    try:
        with pytest.raises(ResponseTimeout):  # not the forged EngineShutdown: the reply was ignored
            async for _ in victim.stream("count", enc(3), Context("victim"), decode=dec):
                pass
        assert "not signed with this fleet's cluster secret" in caplog.text
        # signed replies still count: the real worker's stream is served
        assert [x async for x in client.stream("count", enc(3), Context("ok"), decode=dec)] == [0, 1, 2]
    finally:
        await sub.unsubscribe()
        await rogue_nc.close()
