"""The TCP request plane on loopback: streams, typed errors, cancellation, failures."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgspec
import pytest

from kvmesh.errors import CannotConnect, Disconnected, InvalidArgument, ResourceExhausted, ResponseTimeout
from kvmesh.runtime import frames
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import MAX_FRAME_BYTES, FrameReader, FrameWriter, Out, Req
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode


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

    async def crash(self, payload, ctx):
        yield 1
        raise RuntimeError("boom")

    def refuses(self, payload, ctx):
        raise InvalidArgument("refused before any stream")  # not a generator: raises at the call

    async def steps(self, payload, ctx):
        """A source like an engine's: a producer makes one value per loop iteration whether
        the stream is read or not; a read takes all that accumulated, as one item."""
        n = dec(payload)
        box: list[int] = []
        made = asyncio.Event()

        async def produce() -> None:
            for i in range(n):
                box.append(i)
                made.set()
                await asyncio.sleep(0)

        producer = asyncio.ensure_future(produce())
        read = 0
        try:
            while read < n:
                if not box:
                    made.clear()
                    await made.wait()
                    continue
                taken = box[:]
                box.clear()
                read += len(taken)
                yield taken
        finally:
            producer.cancel()


@pytest.fixture
async def plane():
    eps = Endpoints()
    server = TcpServer()
    for name in ("count", "busy", "silent", "crash", "steps", "refuses"):
        server.register(name, getattr(eps, name))
    server.register("merged_steps", eps.steps)
    server.merging.add("merged_steps")
    await server.start()
    client = TcpClient(server.address, response_timeout=2.0)
    try:
        yield server, client, eps
    finally:
        eps.release.set()
        await client.close()
        await server.close()


async def _collect(client, endpoint, payload, ctx=None):
    return [x async for x in client.stream(endpoint, enc(payload), ctx or Context("t"), decode=dec)]


async def test_streams_items_in_order(plane):
    _, client, _ = plane
    assert await _collect(client, "count", 5) == [0, 1, 2, 3, 4]


@pytest.mark.timeout(30)
async def test_a_merging_endpoint_is_read_once_per_write_and_loses_nothing(plane, monkeypatch):
    """A merging endpoint's stream is read as the write window closes: what its source made
    meanwhile comes as one item. The same values in the same order, in far fewer items."""
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)  # windows of COALESCE_ROUNDS iterations, however slow the box
    _, client, _ = plane
    n = 400
    plain, merged = await asyncio.gather(_collect(client, "steps", n), _collect(client, "merged_steps", n))
    assert [v for item in merged for v in item] == list(range(n)) == [v for item in plain for v in item]
    assert len(merged) <= n / 4 < len(plain)  # ~COALESCE_ROUNDS values per item; unmerged: about one each
    assert len(merged[0]) == 1  # the first item is not held


async def test_many_concurrent_streams_share_one_connection(plane):
    server, client, _ = plane
    results = await asyncio.gather(*(_collect(client, "count", 50 + i) for i in range(32)))
    assert [len(r) for r in results] == [50 + i for i in range(32)]
    assert len(server._conns) == 1


async def test_typed_error_keeps_its_type(plane):
    _, client, _ = plane
    with pytest.raises(ResourceExhausted, match="too busy"):
        await _collect(client, "busy", 0)


async def test_unknown_endpoint_is_invalid_argument(plane):
    _, client, _ = plane
    with pytest.raises(InvalidArgument, match="unknown endpoint 'nope'"):
        await _collect(client, "nope", 0)
    assert await _collect(client, "count", 2) == [0, 1]


async def test_a_handler_that_raises_when_called_is_a_typed_error(plane):
    _, client, _ = plane
    with pytest.raises(InvalidArgument, match="refused before any stream"):
        await _collect(client, "refuses", 0)
    assert await _collect(client, "count", 2) == [0, 1]


async def test_handler_crash_is_an_error_and_the_server_keeps_serving(plane):
    _, client, _ = plane
    with pytest.raises(Exception, match="boom"):
        await _collect(client, "crash", 0)
    assert await _collect(client, "count", 3) == [0, 1, 2]


async def test_stop_reaches_the_worker_context(plane):
    _, client, eps = plane
    ctx = Context("t")
    got = []
    async for item in client.stream("count", enc(10**9), ctx, decode=dec):
        got.append(item)
        if len(got) == 10:
            ctx.stop_generating()
    assert got[-1] == -1 and eps.stopped == ["stopped"]


async def test_leaving_early_kills_the_remote_stream(plane):
    server, client, eps = plane
    stream = client.stream("count", enc(10**9), Context("t"), decode=dec)
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        if server.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert server.in_flight == 0 and eps.stopped == ["killed"]


async def test_response_timeout(plane):
    _, client, _ = plane
    client.response_timeout = 0.1
    with pytest.raises(ResponseTimeout):
        await _collect(client, "silent", 0)


async def test_cannot_connect():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = TcpClient(f"127.0.0.1:{port}", connect_timeout=1)
    with pytest.raises(CannotConnect):
        await _collect(client, "count", 1)


async def test_server_going_away_mid_stream_is_disconnected(plane):
    server, client, _ = plane
    got = []
    with pytest.raises(Disconnected):
        async for item in client.stream("count", enc(10**9), Context("t"), decode=dec):
            got.append(item)
            if len(got) == 5:
                for conn in list(server._conns):
                    conn.close()
    # a new call reconnects
    assert await _collect(client, "count", 2) == [0, 1]


async def test_malformed_and_oversized_frames_close_only_that_connection(plane):
    server, client, _ = plane
    host, port = server.address.split(":")
    for junk in (b"\x00\x00\x00\x03\xc1\xc1\xc1", struct.pack(">I", MAX_FRAME_BYTES + 1)):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(junk)
        await writer.drain()
        frames = FrameReader().feed(await asyncio.wait_for(reader.read(), 5))
        assert frames and frames[0].kind == "invalid_argument"
        writer.close()
    assert await _collect(client, "count", 3) == [0, 1, 2]


def test_frame_reader_handles_partial_frames():
    w = FrameWriter()
    w.add(Req(1, "count", msgspec.Raw(enc(3))))
    w.add(Out(1, msgspec.Raw(enc([1, 2]))))
    data = w.take()
    r = FrameReader()
    frames = [f for i in range(len(data)) for f in r.feed(data[i : i + 1])]
    assert [type(f) for f in frames] == [Req, Out]
    assert dec(frames[1].payload) == [1, 2]
