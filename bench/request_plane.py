"""Request-plane micro-benchmark: kvmesh's TCP and NATS planes against a raw asyncio
socket baseline measured in the same run, on loopback.

    python bench/request_plane.py                        # raw, tcp, nats
    python bench/request_plane.py --planes tcp --json out.json
    python bench/request_plane.py --chunks 50000 --requests 5000 --loop asyncio

Worker and caller share one process and one event loop (the nats-server, started here
on a free port and stopped in ``finally``, is a process of its own). Every plane
serves the same handler: ``count`` items, each an ``OutputChunk(token_ids=[i])``
encoded with msgspec and decoded by the caller. The baseline does the same encoding
and decoding over a minimal length-prefixed protocol (one connection, stream ids, one
write per loop iteration), so a ratio is the cost of the plane itself: frames,
mailboxes, contexts, tasks, and for NATS the request/reply through the server.

Measured per plane:

* one stream of ``--chunks`` items: chunks/s;
* ``--streams`` concurrent streams of ``--stream-chunks`` items each: total chunks/s;
* ``--requests`` sequential 1-item requests: latency p50 / p99 (µs).

Throughput ratios are plane / raw (below 1 is slower); latency ratios are plane / raw
(above 1 is slower). Each measurement stops early after ``--max-seconds``.

Trust A/B (``--ab``): the cost of the cluster-secret handshake and of the bounded,
linear framing, in one run. Arms, measured in alternating rounds (``--rounds``) so
load hits each alike, best of the rounds kept:

* ``tcp-before``: the TCP plane with the frame reader it had before (copies the whole
  pending buffer twice per read; kept below as ``LegacyFrameReader``), no secret;
* ``tcp``: today's frame reader, no secret;
* ``tcp-secret``: today's reader and a cluster secret (one handshake per connection);
* ``nats`` / ``nats-secret`` with ``--planes`` including nats (signed requests and the
  call-home handshake).

The ``×before`` column is arm / ``tcp-before`` (the goal: ≥ 0.97 of streamed chunks/s).

    python bench/request_plane.py --ab --rounds 5

Sealing alone (``--seal-micro``, also printed by ``--ab``): the CPU time of one 1-item
request's framing (a ``Req`` write up, an ``Ack``+``Out``+``End`` write down), without and
with a cluster secret (a tag frame per write, written and checked), and per frame of a
stream's 16-frame writes; no sockets, so far less noise than the planes.

Against another commit (``--base-commit C``): this script runs once per round and arm
in a process of its own, on ``C``'s ``src/`` (arm ``before``, from ``git archive``) and
on this tree's (``now``), alternating the order every round; it prints each arm's
medians and now/before, also as the median of per-round ratios (the two arms ran back
to back). Every figure of a run is also taken relative to that run's ``raw`` baseline,
which cancels the machine's load at the time of the run. The planes default to
``tcp,tcp-secret`` (with a secret: the handshake, and since issue 29 the records).

    python bench/request_plane.py --base-commit 94780dc --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path
from typing import Any

import msgspec

from _lib import percentile, source_arms
from kvmesh.errors import InvalidArgument
from kvmesh.protocol import OutputChunk
from kvmesh.runtime import tcp_client, tcp_server
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import MAX_FRAME_BYTES, Frame
from kvmesh.runtime.nats import CallHomeServer, NatsRequestClient, NatsRequestServer, connect_nats
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer

REPO = Path(__file__).resolve().parent.parent
PLANES = ("raw", "tcp", "nats", "tcp-before", "tcp-secret", "nats-secret")
BENCH_SECRET = ClusterSecret(b"request-plane bench secret, 32 bytes")
StreamFn = Callable[[int], AsyncIterator[Any]]

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(OutputChunk).decode


async def count_handler(payload, ctx) -> AsyncIterator[OutputChunk]:
    """The endpoint every plane serves: ``count`` small chunks."""
    for i in range(msgspec.msgpack.decode(payload)):
        yield OutputChunk(token_ids=[i])


# ---------------------------------------------------------------- raw socket baseline
#
# frame = u32 length, then body; request body = u32 sid, u32 count;
# response body = u32 sid + msgpack item, or u32 sid alone for the end of the stream.

_LEN = struct.Struct(">I")
_REQ = struct.Struct(">II")


def _frames(buf: bytearray) -> list[bytes]:
    out = []
    pos = 0
    while len(buf) - pos >= 4:
        (size,) = _LEN.unpack_from(buf, pos)
        if len(buf) - pos - 4 < size:
            break
        out.append(bytes(buf[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    del buf[:pos]
    return out


class _RawServerConn(asyncio.Protocol):
    def __init__(self, tasks: set[asyncio.Task[None]]) -> None:
        self._tasks = tasks
        self._buf = bytearray()
        self._out = bytearray()
        self._transport: asyncio.Transport | None = None
        self._flush_scheduled = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buf.extend(data)
        for body in _frames(self._buf):
            sid, count = _REQ.unpack(body)
            task = asyncio.ensure_future(self._serve(sid, count))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sid: int, count: int) -> None:
        async for item in count_handler(_encode(count), None):
            data = _encode(item)
            self._send(_LEN.pack(4 + len(data)) + _LEN.pack(sid) + data)
        self._send(_LEN.pack(4) + _LEN.pack(sid))

    def _send(self, frame: bytes) -> None:
        self._out += frame
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is not None and self._out:
            self._transport.write(bytes(self._out))
        self._out.clear()


class _RawClientConn(asyncio.Protocol):
    def __init__(self) -> None:
        self._buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.boxes: dict[int, tuple[deque[Any], list[asyncio.Future[None] | None]]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._buf.extend(data)
        for body in _frames(self._buf):
            (sid,) = _LEN.unpack_from(body)
            items, waiter = self.boxes[sid]
            items.append(_decode(body[4:]) if len(body) > 4 else None)
            if waiter[0] is not None and not waiter[0].done():
                waiter[0].set_result(None)


class RawPlane:
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server = await loop.create_server(lambda: _RawServerConn(self._tasks), "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        _, self._conn = await loop.create_connection(_RawClientConn, "127.0.0.1", port)
        self._next_sid = 1

    async def stream(self, count: int) -> AsyncIterator[OutputChunk]:
        sid = self._next_sid
        self._next_sid += 1
        items: deque[Any] = deque()
        waiter: list[asyncio.Future[None] | None] = [None]
        self._conn.boxes[sid] = (items, waiter)
        self._conn.transport.write(_LEN.pack(_REQ.size) + _REQ.pack(sid, count))
        try:
            while True:
                while items:
                    item = items.popleft()
                    if item is None:
                        return
                    yield item
                waiter[0] = asyncio.get_running_loop().create_future()
                await waiter[0]
        finally:
            del self._conn.boxes[sid]

    async def close(self) -> None:
        self._conn.transport.close()
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


# ---------------------------------------------------------------- the frame reader before


class LegacyFrameReader:
    """The request plane's frame reader before the trust work (for the A/B only): it
    copies the whole pending buffer twice on every read."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._decoder = msgspec.msgpack.Decoder(Frame)
        self._max = max_frame_bytes

    def feed(self, data: bytes) -> list[Any]:
        if self._buf:
            self._buf.extend(data)
            data = bytes(self._buf)
            self._buf.clear()
        view = memoryview(data)
        frames = []
        pos = 0
        end = len(data)
        decode = self._decoder.decode
        while end - pos >= 4:
            (size,) = _LEN.unpack_from(data, pos)
            if size > self._max:
                raise InvalidArgument(f"frame of {size} bytes exceeds the limit of {self._max} bytes")
            if end - pos - 4 < size:
                break
            frames.append(decode(view[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        if pos < end:
            self._buf.extend(view[pos:])
        return frames


# ---------------------------------------------------------------- kvmesh planes


async def _tcp_plane(stack: AsyncExitStack, secret: ClusterSecret | None = None) -> StreamFn:
    server = TcpServer(secret=secret)
    server.register("count", count_handler)
    await server.start()
    stack.push_async_callback(server.close)
    client = TcpClient(server.address, response_timeout=10, secret=secret)
    stack.push_async_callback(client.close)
    return lambda n: client.stream("count", _encode(n), Context("bench"), decode=_decode)


async def _tcp_before_plane(stack: AsyncExitStack) -> StreamFn:
    # NOTE: the bench's one swap of a module global: both ends of this arm's connection
    # build their readers from it; it is put back when the arm's stack closes.
    saved = tcp_client.FrameReader, tcp_server.FrameReader
    tcp_client.FrameReader = tcp_server.FrameReader = LegacyFrameReader  # type: ignore[assignment,misc]

    async def restore() -> None:
        tcp_client.FrameReader, tcp_server.FrameReader = saved  # type: ignore[misc]

    stack.push_async_callback(restore)
    stream_fn = await _tcp_plane(stack)
    await _drain(stream_fn, 1)  # connect now, while the legacy reader is in place
    return stream_fn


async def _nats_plane(stack: AsyncExitStack, url: str, secret: ClusterSecret | None = None) -> StreamFn:
    worker_nc, caller_nc = await connect_nats(url, name="bench-worker"), await connect_nats(url, name="bench-caller")
    stack.push_async_callback(caller_nc.close)
    stack.push_async_callback(worker_nc.close)
    server = NatsRequestServer(worker_nc, "bench", "worker", 0xBE7C, secret=secret)
    server.register("count", count_handler)
    await server.start()
    stack.push_async_callback(server.close)
    home = CallHomeServer(secret=secret)
    stack.push_async_callback(home.close)
    client = NatsRequestClient(caller_nc, home, "bench", "worker", 0xBE7C, connect_timeout=5, response_timeout=10)
    return lambda n: client.stream("count", _encode(n), Context("bench"), decode=_decode)


async def _raw_plane(stack: AsyncExitStack) -> StreamFn:
    raw = RawPlane()
    await raw.start()
    stack.push_async_callback(raw.close)
    return raw.stream


# ---------------------------------------------------------------- measurements


async def _drain(stream_fn: StreamFn, count: int) -> int:
    got = 0
    async for _ in stream_fn(count):
        got += 1
    if got != count:
        raise RuntimeError(f"stream returned {got} of {count} items")
    return got


async def _throughput(stream_fn: StreamFn, streams: int, chunks: int, repeats: int, max_s: float) -> float:
    """Best-of-``repeats`` chunks/s of ``streams`` concurrent streams of ``chunks`` items."""
    best = 0.0
    deadline = time.perf_counter() + max_s
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        await asyncio.gather(*(_drain(stream_fn, chunks) for _ in range(streams)))
        best = max(best, streams * chunks / (time.perf_counter() - start))
        if time.perf_counter() > deadline:
            break
    return best


async def _latency(stream_fn: StreamFn, requests: int, max_s: float) -> tuple[float, float, int]:
    """(p50 µs, p99 µs, requests done) of sequential 1-item requests."""
    gc.collect()
    samples = []
    deadline = time.perf_counter() + max_s
    for _ in range(requests):
        start = time.perf_counter()
        await _drain(stream_fn, 1)
        samples.append((time.perf_counter() - start) * 1e6)
        if time.perf_counter() > deadline:
            break
    return percentile(samples, 50), percentile(samples, 99), len(samples)  # type: ignore[return-value]


async def _measure(name: str, stream_fn: StreamFn, a: argparse.Namespace) -> dict[str, Any]:
    for _ in range(20):  # warm-up: connections, caches
        await _drain(stream_fn, 10)
    single = await _throughput(stream_fn, 1, a.chunks, a.repeats, a.max_seconds)
    multi = await _throughput(stream_fn, a.streams, a.stream_chunks, a.repeats, a.max_seconds)
    p50, p99, done = await _latency(stream_fn, a.requests, a.max_seconds)
    result = {"plane": name, "single_chunks_per_s": single, "concurrent_chunks_per_s": multi,
              "latency_p50_us": p50, "latency_p99_us": p99, "latency_requests": done}  # fmt: skip
    if not a.quiet:
        print(f"  {name}: {single:,.0f} / {multi:,.0f} chunks/s, p50 {p50:.0f} µs", file=sys.stderr)
    return result


async def _open_plane(name: str, stack: AsyncExitStack, nats_url: str | None) -> StreamFn:
    if name == "raw":
        return await _raw_plane(stack)
    if name == "tcp-before":
        return await _tcp_before_plane(stack)
    if name in ("tcp", "tcp-secret"):
        return await _tcp_plane(stack, BENCH_SECRET if name == "tcp-secret" else None)
    assert nats_url is not None
    return await _nats_plane(stack, nats_url, BENCH_SECRET if name == "nats-secret" else None)


_BEST = {"single_chunks_per_s": max, "concurrent_chunks_per_s": max, "latency_p50_us": min, "latency_p99_us": min}


async def _bench(a: argparse.Namespace, nats_url: str | None) -> list[dict[str, Any]]:
    names = ["raw", *[p for p in a.planes if p != "raw"]]
    best: dict[str, dict[str, Any]] = {}
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rnd in range(a.rounds):  # alternating rounds (order reversed every other one): load hits every arm alike
        for name in names if rnd % 2 == 0 else names[::-1]:
            async with AsyncExitStack() as stack:
                r = await _measure(name, await _open_plane(name, stack, nats_url), a)
            rounds[name].append(dict(r))
            if name not in best:
                best[name] = r
            else:
                for key, pick in _BEST.items():
                    best[name][key] = pick(best[name][key], r[key])
    results = [best[n] for n in names]
    raw = results[0]
    before = best.get("tcp-before")
    for r in results:
        r["single_ratio"] = r["single_chunks_per_s"] / raw["single_chunks_per_s"]
        r["concurrent_ratio"] = r["concurrent_chunks_per_s"] / raw["concurrent_chunks_per_s"]
        r["p50_ratio"] = r["latency_p50_us"] / raw["latency_p50_us"]
        r["p99_ratio"] = r["latency_p99_us"] / raw["latency_p99_us"]
        if before is not None:
            r["single_vs_before"] = r["single_chunks_per_s"] / before["single_chunks_per_s"]
            r["concurrent_vs_before"] = r["concurrent_chunks_per_s"] / before["concurrent_chunks_per_s"]
            for key in ("single_chunks_per_s", "concurrent_chunks_per_s"):
                mine = statistics.median(x[key] for x in rounds[r["plane"]])
                theirs = statistics.median(x[key] for x in rounds["tcp-before"])
                r[f"{key.split('_')[0]}_vs_before_median"] = mine / theirs
                # the two arms ran in the same round, close in time: slow drifts of the machine cancel
                paired = [x[key] / y[key] for x, y in zip(rounds[r["plane"]], rounds["tcp-before"])]
                r[f"{key.split('_')[0]}_vs_before_paired"] = statistics.median(paired)
                r[f"{key.split('_')[0]}_vs_before_spread"] = (min(paired), max(paired))
    return results


def framing_micro(repeats: int = 15) -> dict[str, float]:
    """CPU time of the frame readers alone (no sockets: far less noise than the planes):
    100,000 small ``Out`` frames arriving in 64 KiB reads, legacy vs today's reader,
    alternating, best of ``repeats``; plus one cluster-secret handshake (both sides)."""
    from kvmesh.runtime.auth import Handshake
    from kvmesh.runtime.frames import FrameReader, FrameWriter, Out, OutItem

    w = FrameWriter()
    for i in range(100_000):
        w.add(OutItem(1, OutputChunk(token_ids=[i])))
    data = w.take()
    reads = [data[i : i + 65536] for i in range(0, len(data), 65536)]
    best = {"legacy": float("inf"), "today": float("inf")}
    for _ in range(repeats):
        for name, cls in (("legacy", LegacyFrameReader), ("today", FrameReader)):
            reader = cls()
            gc.collect()
            start = time.process_time()  # CPU time: less sensitive to other processes than wall time
            n = sum(len(reader.feed(r)) for r in reads)
            best[name] = min(best[name], time.process_time() - start)
            assert n == 100_000
    # one 16 MiB frame in 256 KiB reads: the legacy reader's copying grows with the square
    w.add(Out(1, msgspec.Raw(_encode(b"x" * (16 * 1024 * 1024 - 64)))))
    big = w.take()
    big_reads = [big[i : i + 256 * 1024] for i in range(0, len(big), 256 * 1024)]
    big_s = {}
    for name, cls in (("legacy", LegacyFrameReader), ("today", FrameReader)):
        reader = cls()
        start = time.process_time()
        assert sum(len(reader.feed(r)) for r in big_reads) == 1
        big_s[name] = time.process_time() - start
    hs_best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(1000):
            c, s = Handshake(BENCH_SECRET, "request", True), Handshake(BENCH_SECRET, "request", False)
            reply, _ = s.feed(c.start())
            proof, _ = c.feed(reply)
            s.feed(proof)
        hs_best = min(hs_best, (time.perf_counter() - start) / 1000)
    return {"legacy_ns_per_frame": best["legacy"] / 100_000 * 1e9, "today_ns_per_frame": best["today"] / 100_000 * 1e9,
            "handshake_us": hs_best * 1e6, "big_frame_legacy_s": big_s["legacy"], "big_frame_today_s": big_s["today"]}  # fmt: skip


def sealing_micro(requests: int = 20_000, repeats: int = 9) -> dict[str, float]:
    """CPU time of a request's framing alone, without and with a cluster secret (no
    sockets, both ends in this process): one 1-item request is a ``Req`` write up and an
    ``Ack``+``Out``+``End`` write down (what the TCP plane writes at c=1), each sealed and
    checked when sealed; plus 16 ``Out`` frames per write (a stream). Arms alternate,
    best of ``repeats``; the paired figure is the median of per-repeat differences."""
    from kvmesh.runtime.frames import Ack, End, FrameReader, FrameWriter, OutItem, Req

    def ends(sealed: bool) -> tuple[FrameWriter, FrameWriter, Callable[[bytes], list[Any]], Callable[[bytes], list[Any]]]:
        up, down, caller, worker = FrameWriter(), FrameWriter(), FrameReader(), FrameReader()
        if sealed:
            up.seal(b"u" * 32)
            down.seal(b"d" * 32)
            caller, worker = caller.sealed(b"d" * 32), worker.sealed(b"u" * 32)
        return up, down, caller.feed, worker.feed

    def per_request(sealed: bool) -> float:
        up, down, caller, worker = ends(sealed)
        payload, item = msgspec.Raw(_encode(1)), OutputChunk(token_ids=[0])
        gc.collect()
        start = time.process_time()
        for sid in range(requests):
            up.add(Req(sid, "count", payload))
            worker(up.take())
            for frame in (Ack(sid), OutItem(sid, item), End(sid)):
                down.add(frame)
            caller(down.take())
        return (time.process_time() - start) / requests * 1e6

    def per_frame(sealed: bool) -> float:
        _, down, caller, _ = ends(sealed)
        item = OutputChunk(token_ids=[7])
        gc.collect()
        start = time.process_time()
        for _ in range(requests // 4):
            for _ in range(16):
                down.add(OutItem(1, item))
            caller(down.take())
        return (time.process_time() - start) / (requests // 4 * 16) * 1e9

    out: dict[str, float] = {}
    for name, run in (("request_us", per_request), ("stream_ns_per_frame", per_frame)):
        pairs = [(run(False), run(True)) for _ in range(repeats)]
        out[f"{name}_plain"] = min(p for p, _ in pairs)
        out[f"{name}_sealed"] = min(s for _, s in pairs)
        out[f"{name}_added"] = statistics.median(s - p for p, s in pairs)
    return out


def format_table(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    ab = "single_vs_before" in results[0]
    cols = [("plane", 11), ("1 stream chunks/s", 18), ("×raw", 6)] + ([("×before", 8)] if ab else [])
    cols += [(f"{a.streams} streams chunks/s", 20), ("×raw", 6)] + ([("×before", 8)] if ab else [])
    cols += [("1-chunk p50 µs", 15), ("×raw", 6), ("p99 µs", 9), ("×raw", 6)]
    head = " ".join(f"{n:>{w}}" for n, w in cols)
    lines = [head, "-" * len(head)]
    for r in results:
        vals = [r["plane"], f"{r['single_chunks_per_s']:,.0f}", f"{r['single_ratio']:.2f}"]
        vals += [f"{r['single_vs_before']:.3f}"] if ab else []
        vals += [f"{r['concurrent_chunks_per_s']:,.0f}", f"{r['concurrent_ratio']:.2f}"]
        vals += [f"{r['concurrent_vs_before']:.3f}"] if ab else []
        vals += [f"{r['latency_p50_us']:.1f}", f"{r['p50_ratio']:.2f}", f"{r['latency_p99_us']:.1f}", f"{r['p99_ratio']:.2f}"]
        lines.append(" ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols)))
    if ab:
        for r in results:
            if "single_vs_before_median" in r and r["plane"] != "raw":
                lines.append(f"  {r['plane']:>11} / tcp-before, medians over the rounds: 1 stream {r['single_vs_before_median']:.3f},"
                             f" {a.streams} streams {r['concurrent_vs_before_median']:.3f}")  # fmt: skip
                (s_lo, s_hi), (c_lo, c_hi) = r["single_vs_before_spread"], r["concurrent_vs_before_spread"]
                lines.append(f"  {r['plane']:>11} / tcp-before, median of per-round ratios: 1 stream {r['single_vs_before_paired']:.3f}"
                             f" [{s_lo:.3f}-{s_hi:.3f}], {a.streams} streams {r['concurrent_vs_before_paired']:.3f}"
                             f" [{c_lo:.3f}-{c_hi:.3f}]")  # fmt: skip
    lines.append(
        f"(1 stream = {a.chunks} chunks; {a.streams} streams x {a.stream_chunks} chunks; best of {a.repeats} x {a.rounds}"
        f" alternating rounds; latency over {results[0]['latency_requests']} sequential requests; loop={a.loop})"
    )
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--planes", default="tcp,nats", help="comma-separated subset of tcp,nats (raw always runs)")
    p.add_argument("--chunks", type=int, default=20_000, help="items in the single-stream run")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams")
    p.add_argument("--stream-chunks", type=int, default=1_000, help="items per concurrent stream")
    p.add_argument("--requests", type=int, default=2_000, help="sequential 1-item requests")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs per measurement (best is kept)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="time bound per measurement")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds over the arms (best kept)")
    p.add_argument("--ab", action="store_true", help="trust A/B: tcp-before, tcp, tcp-secret (+ nats-secret with nats)")
    p.add_argument("--base-commit", metavar="C", help="A/B against commit C's src/: one process per round and arm (see above)")
    p.add_argument("--seal-micro", action="store_true", help="only the framing's CPU per request, without and with a secret (no sockets)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    if a.base_commit and "--planes" not in (argv if argv is not None else sys.argv[1:]):
        a.planes = "tcp,tcp-secret"
    a.planes = [x.strip() for x in a.planes.split(",") if x.strip()]
    if a.ab:
        a.planes = ["tcp-before", "tcp", "tcp-secret"] + (["nats", "nats-secret"] if "nats" in a.planes else [])
    unknown = set(a.planes) - set(PLANES)
    if unknown:
        p.error(f"unknown plane(s) {', '.join(sorted(unknown))}; choose from {', '.join(PLANES[1:])}")
    for name in ("chunks", "streams", "stream_chunks", "requests", "repeats", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.chunks > 1_000_000 or a.streams * a.stream_chunks > 1_000_000 or a.requests > 100_000:
        p.error("counts are bounded: at most 1e6 chunks per run and 1e5 requests")
    return a


def _run(coro: Awaitable[Any], loop: str) -> Any:
    if loop == "uvloop":
        try:
            import uvloop

            return uvloop.run(coro)  # type: ignore[arg-type]
        except ImportError:
            print("uvloop is not installed; using asyncio", file=sys.stderr)
    return asyncio.run(coro)  # type: ignore[arg-type]


# ---------------------------------------------------------------- A/B against a commit

_AB_KEYS = (("single_chunks_per_s", "1 stream chunks/s", True), ("concurrent_chunks_per_s", "streams chunks/s", True),
            ("latency_p50_us", "c=1 p50 µs", False), ("latency_p99_us", "c=1 p99 µs", False))  # fmt: skip


def _arm_run(a: argparse.Namespace, src: str, extra: dict[str, str], out: Path) -> dict[str, dict[str, Any]]:
    """One run of this script on ``src`` in a process of its own: results by plane."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--planes", ",".join(a.planes), "--rounds", "1", "--quiet",
           "--json", str(out), "--loop", a.loop, "--chunks", str(a.chunks), "--streams", str(a.streams),
           "--stream-chunks", str(a.stream_chunks), "--requests", str(a.requests), "--repeats", str(a.repeats),
           "--max-seconds", str(a.max_seconds)]  # fmt: skip
    done = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=src, **extra), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the bench on {src} failed:\n{done.stderr[-2000:]}")
    return {r["plane"]: r for r in json.loads(out.read_text())["results"]}


def compare_commits(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        arms = source_arms(REPO, a.base_commit, ["now=src"], tmp)
        runs: dict[str, list[dict[str, dict[str, Any]]]] = {label: [] for label, _, _ in arms}
        for rnd in range(a.rounds):
            for label, src, extra in arms if rnd % 2 == 0 else arms[::-1]:
                runs[label].append(_arm_run(a, src, extra, Path(tmp) / f"{label}-{rnd}.json"))
                if not a.quiet:
                    r = runs[label][-1]
                    print(f"  round {rnd + 1} {label:>6}: " + ", ".join(
                        f"{p} {r[p]['single_chunks_per_s']:,.0f}/{r[p]['concurrent_chunks_per_s']:,.0f} chunks/s p50 "
                        f"{r[p]['latency_p50_us']:.0f} µs" for p in a.planes), file=sys.stderr, flush=True)  # fmt: skip
    print(format_commits(runs, a))
    return 0


def format_commits(runs: dict[str, list[dict[str, dict[str, Any]]]], a: argparse.Namespace) -> str:
    before, now = runs["before"], runs["now"]
    lines = [f"{'plane':>11} {'figure':>18} {'before':>10} {'now':>10} {'now/before':>11} {'paired':>7} {'spread':>13}"
             f" {'vs raw: paired':>15}"]  # fmt: skip
    for plane in a.planes:
        for key, name, higher in _AB_KEYS:
            b = [r[plane][key] for r in before]
            n = [r[plane][key] for r in now]
            paired = [x / y for x, y in zip(n, b)]
            # each run's figure over its own raw baseline: the load at the time of the run cancels
            rel = [(x[plane][key] / x["raw"][key]) / (y[plane][key] / y["raw"][key]) for x, y in zip(now, before)]
            lines.append(f"{plane:>11} {name:>18} {statistics.median(b):10,.1f} {statistics.median(n):10,.1f}"
                         f" {statistics.median(n) / statistics.median(b):11.3f} {statistics.median(paired):7.3f}"
                         f" [{min(paired):.3f}-{max(paired):.3f}] {statistics.median(rel):15.3f}")  # fmt: skip
    lines.append(f"(before = {a.base_commit}, now = this tree; medians of {a.rounds} alternating rounds, one process per"
                 f" round and arm; throughput: higher is better, latency: lower is better; loop={a.loop})")  # fmt: skip
    return "\n".join(lines)


def _print_sealing(m: dict[str, float]) -> None:
    print(f"framing alone, one 1-item request (Req up, Ack+Out+End down): {m['request_us_plain']:.2f} µs CPU,"
          f" {m['request_us_sealed']:.2f} µs sealed (+{m['request_us_added']:.2f} µs paired); 16 Out frames per write:"
          f" {m['stream_ns_per_frame_plain']:.0f} ns/frame, +{m['stream_ns_per_frame_added']:.0f} ns sealed")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(argv)
    if a.seal_micro:
        _print_sealing(sealing_micro())
        return 0
    if a.base_commit:
        return compare_commits(a)
    with ExitStack() as stack:
        nats_url = None
        if any(p.startswith("nats") for p in a.planes):
            sys.path.insert(0, str(REPO))
            try:
                from tests.services import nats_server  # installs nats-server when missing
            except ImportError as exc:
                print(f"cannot start nats-server ({exc}); run with --planes tcp", file=sys.stderr)
                return 2
            nats_url = stack.enter_context(nats_server(jetstream=False)).url
        results = _run(_bench(a, nats_url), a.loop)
    print(format_table(results, a))
    micro = None
    if a.ab:
        micro = framing_micro()
        print(f"frame reader alone (100,000 frames in 64 KiB reads): before {micro['legacy_ns_per_frame']:.0f} ns/frame,"
              f" today {micro['today_ns_per_frame']:.0f} ns/frame (×{micro['today_ns_per_frame'] / micro['legacy_ns_per_frame']:.3f});"
              f" one cluster-secret handshake, both sides: {micro['handshake_us']:.1f} µs per connection")
        print(f"one 16 MiB frame in 256 KiB reads: before {micro['big_frame_legacy_s']:.3f} s CPU,"
              f" today {micro['big_frame_today_s']:.3f} s CPU")  # fmt: skip
        micro.update(sealing_micro())
        _print_sealing(micro)
    if a.json:
        config = {k: v for k, v in vars(a).items() if k not in ("json", "quiet")}
        Path(a.json).write_text(json.dumps({"config": config, "results": results, "framing_micro": micro}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
