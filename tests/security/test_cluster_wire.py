"""Attacks on the request plane's wire: oversized frames, slow reassembly, too many
streams, someone else's stream ids, and peers without the cluster secret."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc

import msgspec
import pytest

from kvmesh.errors import CannotConnect, ResourceExhausted
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import Ctl, FrameReader, FrameWriter, KILL, Out, Req
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer

pytestmark = pytest.mark.timeout(60)

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
SECRET = ClusterSecret(b"s" * 32)
OTHER = ClusterSecret(b"o" * 32)


async def count(payload, ctx):
    for i in range(dec(payload)):
        if ctx.is_stopped():
            return
        yield i
        await asyncio.sleep(0)


async def forever(payload, ctx):
    while not ctx.is_stopped():
        yield 1
        await asyncio.sleep(0.01)


async def fault(payload, ctx):
    FAULTS.append(dec(payload))
    yield "ok"

FAULTS: list[str] = []


async def _server(secret=None, max_streams: int | None = None) -> TcpServer:
    server = TcpServer(secret=secret)
    if max_streams is not None:
        server.max_streams = max_streams
    server.register("count", count)
    server.register("forever", forever)
    server.register("fault", fault)
    await server.start()
    return server


async def _collect(client, endpoint, payload):
    return [x async for x in client.stream(endpoint, enc(payload), Context("t"), decode=dec)]


def test_an_oversized_length_prefix_is_refused_before_any_allocation():
    reader = FrameReader(max_frame_bytes=16 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(Exception, match="exceeds the limit"):
            reader.feed(struct.pack(">I", 0xFFFF_FFF0) + b"x" * 100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert reader.buffered == 0


async def test_an_oversized_request_frame_closes_the_connection_and_the_server_stays_small():
    server = await _server()
    try:
        host, port = server.address.split(":")
        r, w = await asyncio.open_connection(host, int(port))
        # a caller → worker frame is bounded by MAX_REQUEST_FRAME (16 MiB), below the old 64 MiB
        w.write(struct.pack(">I", 32 * 1024 * 1024))
        await w.drain()
        data = await asyncio.wait_for(r.read(), 10)  # the server answers and closes
        frames = FrameReader().feed(data)
        assert frames and "exceeds the limit" in frames[0].message
        w.close()
    finally:
        await server.close()


def test_reassembly_is_linear_in_the_frame_size():
    """A 48 MiB frame arriving in 193 reads of 256 KiB: the reader allocates about the
    frame once (the join when its last byte is in), not a growing copy per read.
    Counted in bytes, not seconds: the most each ``feed`` allocated at once (tracemalloc's
    peak over it), summed over the reads. (``bench/request_plane.py --ab`` times it,
    against the reader that copied the pending buffer on every read.)"""
    w = FrameWriter()
    w.add(Out(1, msgspec.Raw(enc(b"x" * (48 * 1024 * 1024)))))
    data = w.take()
    chunks = [data[i : i + 256 * 1024] for i in range(0, len(data), 256 * 1024)]
    reader = FrameReader()
    frames = []
    allocated = []  # per read
    tracemalloc.start()
    try:
        for chunk in chunks:
            held, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            frames += reader.feed(chunk)
            allocated.append(tracemalloc.get_traced_memory()[1] - held)
    finally:
        tracemalloc.stop()
    assert len(frames) == 1 and len(frames[0].payload) > 48 * 1024 * 1024
    # linear: the frame once (+ a little per read); quadratic re-concatenation would
    # allocate the partial frame again on every read, ~100 × the frame here
    times = sum(allocated) / len(data)
    assert times < 1.5, f"reassembly allocated {times:.1f} × the frame over {len(chunks)} reads"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def test_length_prefixes_under_the_limit_allocate_only_what_arrived():
    """50 connections each announce a frame just under the limit (16 MiB) and send 10
    bytes of it: the server holds 10 bytes per connection, not 16 MiB (RSS flat)."""
    server = await _server()
    writers = []
    try:
        host, port = server.address.split(":")
        before = _rss_bytes()
        for _ in range(50):
            _, w = await asyncio.open_connection(host, int(port))
            w.write(struct.pack(">I", 16 * 1024 * 1024 - 1) + b"0123456789")
            writers.append(w)
        for w in writers:
            await w.drain()
        while sum(c._reader.buffered for c in server._conns) < 50 * 14:
            await asyncio.sleep(0.01)
        assert sum(c._reader.buffered for c in server._conns) == 50 * 14
        assert _rss_bytes() - before < 64 * 1024 * 1024  # 50 × 16 MiB would be 800 MiB
    finally:
        for w in writers:
            w.close()
        await server.close()


async def test_streams_per_connection_are_capped():
    server = await _server(max_streams=4)
    client = TcpClient(server.address, secret=None)
    try:
        streams = [client.stream("forever", enc(0), Context(f"s{i}"), decode=dec) for i in range(4)]
        for s in streams:
            assert await s.__anext__() == 1
        with pytest.raises(ResourceExhausted, match="streams open on one connection"):
            await _collect(client, "count", 2)
        for s in streams:
            await s.aclose()
        await asyncio.sleep(0.05)
        assert await _collect(client, "count", 2) == [0, 1]
    finally:
        await client.close()
        await server.close()


async def test_control_frames_for_another_connections_stream_are_dropped_and_counted():
    server = await _server()
    victim = TcpClient(server.address, secret=None)
    try:
        stream = victim.stream("forever", enc(0), Context("victim"), decode=dec)
        assert await stream.__anext__() == 1
        sid = next(iter(victim._conn.streams))
        host, port = server.address.split(":")
        r, w = await asyncio.open_connection(host, int(port))
        fw = FrameWriter()
        for guess in range(sid, sid + 64):
            fw.add(Ctl(guess, KILL))
        w.write(fw.take())
        await w.drain()
        while server.foreign_frames < 64:
            await asyncio.sleep(0.01)
        for _ in range(5):  # the victim's stream keeps going
            assert await stream.__anext__() == 1
        await stream.aclose()
        w.close()
    finally:
        await victim.close()
        await server.close()


async def test_a_caller_with_the_secret_is_served():
    server = await _server(SECRET)
    client = TcpClient(server.address, secret=SECRET)
    try:
        assert await _collect(client, "count", 3) == [0, 1, 2]
        results = await asyncio.gather(*(_collect(client, "count", 20) for _ in range(8)))
        assert all(r == list(range(20)) for r in results)
    finally:
        await client.close()
        await server.close()


async def test_a_rogue_without_the_secret_cannot_generate_or_inject_a_fault(caplog):
    FAULTS.clear()
    server = await _server(SECRET)
    real = TcpClient(server.address, secret=SECRET)
    rogue = TcpClient(server.address, secret=None, connect_timeout=5)
    try:
        live = real.stream("forever", enc(0), Context("real"), decode=dec)
        assert await live.__anext__() == 1
        with pytest.raises(CannotConnect, match="requires the fleet's cluster secret"):
            await _collect(rogue, "fault", "hang")
        with pytest.raises(CannotConnect):
            await _collect(rogue, "count", 3)
        # raw bytes: a Req frame straight away, no handshake
        host, port = server.address.split(":")
        r, w = await asyncio.open_connection(host, int(port))
        fw = FrameWriter()
        fw.add(Req(1, "fault", msgspec.Raw(enc("crash"))))
        w.write(fw.take())
        await w.drain()
        answer = FrameReader().feed(await asyncio.wait_for(r.read(), 15))  # then closed
        w.close()
        assert [(type(f).__name__, f.sid) for f in answer] == [("Err", 0)]  # nothing served, only why
        assert "requires the fleet's cluster secret" in answer[0].message
        assert FAULTS == []
        assert "did not start the cluster-secret handshake" in caplog.text
        for _ in range(3):  # the real caller keeps being served meanwhile
            assert await live.__anext__() == 1
        await live.aclose()
        assert await _collect(real, "count", 2) == [0, 1]
    finally:
        await real.close()
        await rogue.close()
        await server.close()


async def test_a_wrong_secret_is_refused_and_logged_on_both_sides(caplog):
    server = await _server(SECRET)
    client = TcpClient(server.address, secret=OTHER)
    try:
        with pytest.raises(CannotConnect, match="cluster secret mismatch"):
            await _collect(client, "count", 3)
        for _ in range(200):
            if "refusing connection" in caplog.text:
                break
            await asyncio.sleep(0.01)
        assert "refusing connection: cluster secret mismatch: caller" in caplog.text
        assert "cannot connect: cluster secret mismatch: worker" in caplog.text
    finally:
        await client.close()
        await server.close()


async def test_a_secret_caller_against_a_server_without_one_fails_fast_and_clearly(caplog):
    server = await _server(None)
    client = TcpClient(server.address, secret=SECRET, connect_timeout=5)
    try:
        with pytest.raises(CannotConnect, match="handshake"):
            await _collect(client, "count", 3)
        assert "this process has no cluster secret" in caplog.text
    finally:
        await client.close()
        await server.close()


async def test_a_peer_that_stalls_in_the_handshake_is_dropped(caplog):
    from kvmesh.runtime import auth

    server = TcpServer(secret=SECRET)
    server.handshake_timeout_s = 0.3
    await server.start()
    try:
        host, port = server.address.split(":")
        r, w = await asyncio.open_connection(host, int(port))
        w.write(auth.MAGIC)  # half a hello, then nothing
        await w.drain()
        assert await asyncio.wait_for(r.read(), 10) == b""
        w.close()
        assert "did not finish the cluster-secret handshake within 0.3 s" in caplog.text
    finally:
        await server.close()
