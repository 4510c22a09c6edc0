"""The NATS request plane against a real nats-server: requests on NATS subjects,
responses streamed back over call-home TCP, typed errors, cancellation (also across
processes), failures."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
from nats.errors import NoRespondersError

from kvmesh.errors import CannotConnect, ConnectionTimeout, Disconnected, InvalidArgument, ResourceExhausted, ResponseTimeout
from kvmesh.runtime.context import Context
from kvmesh.runtime.nats import (
    CallHomeServer,
    NatsReply,
    NatsRequestClient,
    NatsRequestServer,
    connect_nats,
    request_subject,
)
from tests.helpers import REPO, free_port

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
LEASE = 0x1F2E


class Endpoints:
    def __init__(self) -> None:
        self.stopped: list[str] = []
        self.release = asyncio.Event()

    async def count(self, payload, ctx):
        for i in range(dec(payload)):
            if ctx.is_stopped():
                self.stopped.append("killed" if ctx.is_killed() else "stopped")
                yield -1
                return
            yield i
            await asyncio.sleep(0)

    async def busy(self, payload, ctx):
        raise ResourceExhausted("too busy")
        yield  # pragma: no cover

    async def silent(self, payload, ctx):
        await self.release.wait()
        yield 1


class Plane:
    def __init__(self, server: NatsRequestServer, client: NatsRequestClient, home: CallHomeServer, eps: Endpoints, nc) -> None:
        self.server, self.client, self.home, self.eps, self.nc = server, client, home, eps, nc


@pytest.fixture
async def plane(nats):
    worker_nc, caller_nc = await connect_nats(nats.url), await connect_nats(nats.url)
    eps = Endpoints()
    server = NatsRequestServer(worker_nc, "ns", "worker", LEASE)
    for name in ("count", "busy", "silent"):
        server.register(name, getattr(eps, name))
    await server.start()
    home = CallHomeServer()
    client = NatsRequestClient(caller_nc, home, "ns", "worker", LEASE, connect_timeout=2.0, response_timeout=2.0)
    try:
        yield Plane(server, client, home, eps, caller_nc)
    finally:
        eps.release.set()
        await client.close()
        await server.close()
        await home.close()
        await worker_nc.close()
        await caller_nc.close()


async def _collect(client, endpoint, payload, ctx=None):
    return [x async for x in client.stream(endpoint, enc(payload), ctx or Context("t"), decode=dec)]


async def _eventually(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_streams_items_in_order(plane):
    assert await _collect(plane.client, "count", 5) == [0, 1, 2, 3, 4]
    assert plane.server.subject("count") == "ns.worker.count-1f2e"
    assert plane.server.transport == "nats:ns.worker.{endpoint}-1f2e"
    assert plane.home.open_streams == 0 and plane.server.in_flight == 0


async def test_many_concurrent_streams_share_one_call_home_connection(plane):
    results = await asyncio.gather(*(_collect(plane.client, "count", 50 + i) for i in range(32)))
    assert [len(r) for r in results] == [50 + i for i in range(32)]
    assert len(plane.server._conns) == 1 and len(plane.home._conns) == 1


async def test_two_instances_have_their_own_subjects(plane, nats):
    nc = await connect_nats(nats.url)
    other = NatsRequestServer(nc, "ns", "worker", LEASE + 1)

    async def whoami(payload, ctx):
        yield "other"

    other.register("count", whoami)
    await other.start()
    to_other = NatsRequestClient(plane.nc, plane.home, "ns", "worker", LEASE + 1)
    try:
        assert await _collect(to_other, "count", 3) == ["other"]
        assert await _collect(plane.client, "count", 3) == [0, 1, 2]
    finally:
        await other.close()
        await nc.close()


async def test_typed_error_keeps_its_type(plane):
    with pytest.raises(ResourceExhausted, match="too busy"):
        await _collect(plane.client, "busy", 0)
    assert await _collect(plane.client, "count", 2) == [0, 1]


async def test_nobody_serving_is_cannot_connect_quickly(plane, monkeypatch):
    answers = []  # each NATS request the caller made: its subject and how it ended
    request = plane.nc.request

    async def recorded(subject, *args, **kwargs):
        try:
            reply = await request(subject, *args, **kwargs)
        except Exception as exc:
            answers.append((subject, type(exc)))
            raise
        answers.append((subject, None))
        return reply

    monkeypatch.setattr(plane.nc, "request", recorded)
    with pytest.raises(CannotConnect, match="nobody serves ns.worker.nope-1f2e"):
        await _collect(plane.client, "nope", 1)
    # a connect timeout the test never reaches: it ends on nats' own "no responders"
    gone = NatsRequestClient(plane.nc, plane.home, "ns", "worker", 0xDEAD, connect_timeout=3600.0)
    with pytest.raises(CannotConnect, match="nobody serves ns.worker.count-dead"):
        await _collect(gone, "count", 1)
    # one request each, answered "no responders" by nats: not sent again, not waited out
    assert answers == [
        ("ns.worker.nope-1f2e", NoRespondersError),
        ("ns.worker.count-dead", NoRespondersError),
    ]
    assert plane.home.open_streams == 0


async def test_stop_accepting_sends_new_requests_away_and_finishes_open_streams(plane):
    stream = plane.client.stream("count", enc(50), Context("t"), decode=dec)
    first = await stream.__anext__()
    await plane.server.stop_accepting()
    with pytest.raises(CannotConnect):
        await _collect(plane.client, "count", 1)
    rest = [x async for x in stream]
    assert [first, *rest] == list(range(50))
    assert await plane.server.wait_idle(1.0)


async def test_stop_reaches_the_worker_context(plane):
    ctx = Context("t")
    got = []
    async for item in plane.client.stream("count", enc(10**9), ctx, decode=dec):
        got.append(item)
        if len(got) == 10:
            ctx.stop_generating()
    assert got[-1] == -1 and plane.eps.stopped == ["stopped"]


async def test_stop_before_the_worker_calls_home_is_delivered(plane):
    ctx = Context("t")
    ctx.stop_generating()
    got = await _collect(plane.client, "count", 10**9, ctx)  # held until the worker's Ack
    assert got[-1] == -1 and len(got) < 1000 and plane.eps.stopped == ["stopped"]


async def test_leaving_early_kills_the_remote_stream(plane):
    stream = plane.client.stream("count", enc(10**9), Context("t"), decode=dec)
    async for _ in stream:
        break
    await stream.aclose()
    await _eventually(lambda: plane.server.in_flight == 0)
    assert plane.eps.stopped == ["killed"] and plane.home.open_streams == 0


async def test_response_timeout(plane):
    plane.client.response_timeout = 0.1
    with pytest.raises(ResponseTimeout):
        await _collect(plane.client, "silent", 0)


async def test_worker_that_cannot_call_home_is_a_response_timeout(plane):
    # Workers are told to call 127.0.0.2, where nothing listens.
    home = CallHomeServer("127.0.0.1", advertise_host="127.0.0.2")
    client = NatsRequestClient(plane.nc, home, "ns", "worker", LEASE, connect_timeout=0.3)
    try:
        with pytest.raises(ResponseTimeout, match="did not call home"):
            await _collect(client, "count", 3)
    finally:
        await home.close()


async def test_worker_going_away_mid_stream_is_disconnected(plane):
    got = []
    with pytest.raises(Disconnected):
        async for item in plane.client.stream("count", enc(10**9), Context("t"), decode=dec):
            got.append(item)
            if len(got) == 5:
                for conn in list(plane.server._conns):
                    conn.close()
    assert plane.home.open_streams == 0
    # the next request makes a new call-home connection
    assert await _collect(plane.client, "count", 2) == [0, 1]


async def test_serving_resumes_after_nats_server_restarts(plane, nats):
    nats.kill()
    plane.client.connect_timeout = 0.5
    plane.client.plane_wait_s = 0.5  # past it, the plane's error goes to the caller
    with pytest.raises((CannotConnect, ConnectionTimeout)):
        await _collect(plane.client, "count", 1)
    nats.start()  # same port: both clients reconnect and the worker re-subscribes
    deadline = time.monotonic() + 10
    while True:
        try:
            assert await _collect(plane.client, "count", 3) == [0, 1, 2]
            break
        except (CannotConnect, ConnectionTimeout):
            assert time.monotonic() < deadline, "serving did not resume"
            await asyncio.sleep(0.1)


async def test_request_sent_while_nats_is_down_waits_for_it_and_completes(plane, nats):
    plane.client.connect_timeout = 0.5
    plane.client.response_timeout = 20  # it bounds the wait for the plane too
    nats.kill()
    await _eventually(lambda: not plane.nc.is_connected, 5)
    pending = asyncio.ensure_future(_collect(plane.client, "count", 200))
    await asyncio.sleep(1.5)  # several sends time out meanwhile
    assert not pending.done()
    nats.start()
    # sent again under new stream ids: answers to the earlier sends are killed, so the
    # caller sees one stream, not several interleaved
    assert await asyncio.wait_for(pending, 15) == list(range(200))


async def test_request_while_nats_stays_down_fails_after_plane_wait(plane, nats, monkeypatch):
    plane.client.connect_timeout = 0.3
    plane.client.plane_wait_s = 1.0
    nats.kill()
    await _eventually(lambda: not plane.nc.is_connected, 5)
    sends = 0
    request = plane.nc.request

    async def counted(*args, **kwargs):
        nonlocal sends
        sends += 1
        return await request(*args, **kwargs)

    monkeypatch.setattr(plane.nc, "request", counted)
    # a timer of plane_wait_s, set before the request: the client's own deadline falls
    # after it, and the client awaits again once past its deadline before it gives up,
    # so the timer has run when the error comes back if (and only if) it waited it out
    waited = asyncio.Event()
    asyncio.get_running_loop().call_later(plane.client.plane_wait_s, waited.set)
    with pytest.raises((CannotConnect, ConnectionTimeout)):
        await _collect(plane.client, "count", 1)
    assert waited.is_set(), "the error reached the caller before plane_wait_s"
    assert sends >= 2, "not sent again while the plane was down"
    nats.start()  # for the fixture's clean close
    await _eventually(lambda: plane.nc.is_connected, 10)


async def test_malformed_request_is_a_typed_error_and_the_server_keeps_serving(plane):
    subject = plane.server.subject("count")
    for junk in (b"\xc1\xc1", enc([1, 2]), enc([1, "not an address", b""])):
        reply = dec((await plane.nc.request(subject, junk, timeout=2)).data, type=NatsReply)
        assert reply.kind == InvalidArgument.kind, reply
    assert await _collect(plane.client, "count", 3) == [0, 1, 2]


async def test_bad_names_are_rejected(plane):
    with pytest.raises(ValueError, match="component"):
        request_subject("ns", "a.b", "gen", 1)
    with pytest.raises(InvalidArgument):
        await _collect(plane.client, "has space", 1)
    with pytest.raises(ValueError, match="endpoint"):
        plane.server.register("a.b", Endpoints().count)


async def test_endpoints_registered_after_start_are_served(plane):
    with pytest.raises(CannotConnect):
        await _collect(plane.client, "late", 2)
    plane.server.register("late", plane.eps.count)
    await plane.server.ready()
    assert await _collect(plane.client, "late", 2) == [0, 1]


async def test_connect_nats_to_nothing_is_cannot_connect():
    with pytest.raises(CannotConnect):
        await connect_nats(f"nats://127.0.0.1:{free_port()}", connect_timeout=0.5, first_connect_attempts=2)


async def test_nats_request_timeout_is_connection_timeout(plane):
    # A subscriber that never answers stands in for a wedged worker.
    await plane.nc.subscribe(plane.server.subject("count").replace("1f2e", "bad"), cb=_ignore)
    await plane.nc.flush()
    wedged = NatsRequestClient(plane.nc, plane.home, "ns", "worker", 0xBAD, connect_timeout=0.2)
    with pytest.raises(ConnectionTimeout):
        await _collect(wedged, "count", 1)


async def _ignore(msg) -> None:
    pass


# -------------------------------------------------------------- a worker in another process

WORKER = textwrap.dedent(
    """
    import asyncio, sys
    import msgspec
    from kvmesh.runtime.nats import NatsRequestServer, connect_nats

    async def main(url, lease):
        nc = await connect_nats(url)

        async def count(payload, ctx):
            for i in range(msgspec.msgpack.decode(payload)):
                if ctx.is_stopped():
                    await nc.publish("test.stopped", b"killed" if ctx.is_killed() else b"stopped")
                    yield -1
                    return
                yield i
                await asyncio.sleep(0.001)

        server = NatsRequestServer(nc, "ns", "worker", lease)
        server.register("count", count)
        await server.start()
        await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


async def _wait_serving(client: NatsRequestClient, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert await _collect(client, "count", 1) == [0]
            return
        except CannotConnect:
            assert proc.poll() is None, "the worker process exited"
            assert time.monotonic() < deadline, "the worker process never served"
            await asyncio.sleep(0.05)


@pytest.mark.processes
async def test_cancellation_crosses_processes(nats, tmp_path):
    lease = 0xC0FFEE
    log = open(tmp_path / "worker.log", "wb")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen([sys.executable, "-c", WORKER, nats.url, str(lease)], stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    nc = await connect_nats(nats.url)
    home = CallHomeServer()
    client = NatsRequestClient(nc, home, "ns", "worker", lease, connect_timeout=2.0, response_timeout=5.0)
    reports: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_report(msg) -> None:
        reports.put_nowait(msg.data)

    await nc.subscribe("test.stopped", cb=on_report)
    try:
        await _wait_serving(client, proc)

        # STOP: the worker's ctx is stopped and it ends the stream itself
        ctx = Context("stop")
        got = []
        async for item in client.stream("count", enc(10**9), ctx, decode=dec):
            got.append(item)
            if len(got) == 5:
                ctx.stop_generating()
        assert got[-1] == -1
        assert await asyncio.wait_for(reports.get(), 5) == b"stopped"

        # leaving early: KILL reaches the other process
        stream = client.stream("count", enc(10**9), Context("leave"), decode=dec)
        async for _ in stream:
            break
        await stream.aclose()
        assert await asyncio.wait_for(reports.get(), 5) == b"killed"

        # the worker process dies mid-stream
        got = []
        with pytest.raises(Disconnected):
            async for item in client.stream("count", enc(10**9), Context("die"), decode=dec):
                got.append(item)
                if len(got) == 3:
                    os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        # Until nats-server sees the dead worker's connection drop, a request still goes to
        # its subscription and times out; after that nobody serves the subject.
        client.connect_timeout = 0.5
        with pytest.raises(CannotConnect):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    await _collect(client, "count", 1)
                except ConnectionTimeout:
                    pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        await home.close()
        await nc.close()


async def test_a_late_answer_to_an_earlier_send_is_killed_not_merged():
    """A request sent again after a plane outage gets a new stream id: if the worker
    that got the first send calls home after all, that stream is killed and none of
    its items reach the caller."""
    from kvmesh.runtime.frames import KILL, Ack, Ctl, End, FrameReader, FrameWriter, Out
    from kvmesh.runtime.stream import END, Mailbox

    home = CallHomeServer()
    await home.start()
    try:
        stream = home.open(Mailbox(dec, None))
        first = stream.sid
        home.rekey(stream)  # what NatsRequestClient does before sending again
        assert stream.sid != first and home.streams == {stream.sid: stream}
        reader, writer = await asyncio.open_connection("127.0.0.1", home.port)
        frames = FrameWriter()
        for frame in (Ack(first), Out(first, msgspec.Raw(enc("late"))), End(first)):
            frames.add(frame)
        for frame in (Ack(stream.sid), Out(stream.sid, msgspec.Raw(enc("answer"))), End(stream.sid)):
            frames.add(frame)
        writer.write(frames.take())
        got = []
        while (item := await asyncio.wait_for(stream.box.next(), 5)) is not END:
            got.append(item)
        assert got == ["answer"]
        kill = FrameReader().feed(await asyncio.wait_for(reader.read(4096), 5))
        assert kill == [Ctl(first, KILL)]
        writer.close()
    finally:
        await home.close()
