"""KV transfer: moving blocks between workers' engines over TCP.

The **server** runs on every worker that holds KV others may read or write (decode
workers, and any worker that hands requests off when it drains). It only touches
blocks it was told to expect: :meth:`KvTransferServer.expect` (a remote prefill: the
prefill worker may read the prefix-hit blocks and write the rest) and
:meth:`KvTransferServer.offer` (a migration source: the new worker may read them).
An operation naming an unknown transfer (cancelled, timed out) is refused, so a
late write can never land in blocks that were given back and reused. One operation
needs no transfer: ``prefix`` (a **peer fetch**, issue 33; only with ``serve_prefixes``,
``--peer-fetch``) names a prompt's first tokens, and the server answers with the KV of
the leading blocks of them its engine holds at that moment (pinned by a reservation of
its own while they are exported; none when they were evicted meanwhile).

The **connector** (:class:`TcpKvConnector`, behind :class:`KvConnector`) is the
client: ``read``, ``write`` and ``done`` against a worker's :class:`KvEndpoint`.
Contiguous block ids travel as runs ``(first, count)``, and all runs of one
operation as one payload. A layout-conversion hook runs after reads and before
writes when the two engines' layouts differ. For engines that simulate their KV
(the mocker: ``simulated_bytes_per_s`` > 0) the connector adds the modelled transfer
time of the real bytes.

Wire format, both directions: ``u32 little-endian header length``, a msgpack
:class:`KvOp` (request) or :class:`KvReply` (answer), then ``nbytes`` of raw KV.

Bounds: a header is at most ``MAX_HEADER`` (1 MiB). A write is checked against its
reservation *before* its payload is read: the transfer id must be expected here, its
runs must be positive and add up to no more blocks than the reservation allows, every
block must be one it may write, and ``nbytes`` must be exactly
``blocks × wire_bytes_per_block`` of this engine's layout. A refused write is answered
and the connection closed (its payload is never read). With a cluster secret
(:mod:`kvmesh.runtime.auth`) each connection starts with the handshake (channel ``kv``)
and, without TLS, everything after it travels in authenticated records
(:class:`~kvmesh.runtime.auth.SealedStream`): headers and payloads are sealed in chunks of
at most ``MAX_RECORD`` bytes, written as views of the payload (never copied to be sealed),
and each chunk is checked before a byte of it is used; one that fails closes the
connection.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

from kvmesh.engines.base import KvBlockAccess
from kvmesh.errors import CannotConnect, Disconnected, InvalidArgument, KvmeshError
from kvmesh.protocol import KvEndpoint, KvLayout, PreprocessedRequest, StopConditions
from kvmesh.runtime import auth
from kvmesh.runtime.auth import (
    HANDSHAKE_TIMEOUT_S,
    AuthError,
    ClusterSecret,
    Handshake,
    SealedStream,
    TlsContexts,
    handshake_streams,
)

__all__ = [
    "KvOp",
    "KvReply",
    "block_runs",
    "LayoutConverter",
    "convert_layout",
    "KvTransferServer",
    "KvConnector",
    "TcpKvConnector",
    "TransferStats",
    "MAX_HEADER",
]

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_HEADER = 1024 * 1024
_MAX_PAYLOAD = 8 * 1024 * 1024 * 1024  # what a connector accepts from a read it asked for


class KvOp(msgspec.Struct, frozen=True, omit_defaults=True):
    op: Literal["read", "write", "done", "prefix"]
    transfer_id: str
    runs: list[tuple[int, int]] = []
    nbytes: int = 0
    num_tokens: int = 0
    error: str = ""
    trace_link: str = ""  # done: the prefill worker's span (tracing), for the decode side's link
    # prefix (a peer fetch, issue 33): the prompt's first tokens, and what salts their hashes
    tokens: list[int] = []
    adapter: str | None = None
    cache_salt: str | None = None


class KvReply(msgspec.Struct, frozen=True, omit_defaults=True):
    ok: bool
    error: str = ""
    nbytes: int = 0


_encode = msgspec.msgpack.encode
_decode_op = msgspec.msgpack.Decoder(KvOp).decode
_decode_reply = msgspec.msgpack.Decoder(KvReply).decode


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ids as ``(first, count)`` runs, in order: [3, 4, 5, 9] → [(3, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _expand(runs: Sequence[tuple[int, int]]) -> list[int]:
    return [b for first, count in runs for b in range(first, first + count)]


LayoutConverter = Callable[[bytes, KvLayout, KvLayout], bytes]


def convert_layout(data: bytes, src: KvLayout, dst: KvLayout) -> bytes:
    """The default layout hook: same layouts pass as they are; simulated (digest) KV
    passes between engines of the same block size; anything else needs a converter."""
    if src.block_size != dst.block_size:
        raise InvalidArgument(f"cannot move KV between block sizes {src.block_size} and {dst.block_size}")
    same = (src.block_shape, src.dtype, src.wire_bytes_per_block) == (dst.block_shape, dst.dtype, dst.wire_bytes_per_block)
    digests = src.simulated_bytes_per_s > 0 and dst.simulated_bytes_per_s > 0
    if same or (digests and src.wire_bytes_per_block == dst.wire_bytes_per_block):
        return data
    raise InvalidArgument(
        f"KV layouts differ ({src.engine} {src.block_shape} {src.dtype} → {dst.engine} {dst.block_shape} {dst.dtype});"
        " pass a LayoutConverter to the connector"
    )


@dataclass(slots=True)
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Expected:
    readable: frozenset[int]
    writable: frozenset[int]
    done: asyncio.Future[tuple[int, str]]
    touched: set[str] = field(default_factory=set)


@dataclass(eq=False)
class KvTransferServer:
    """A worker's KV-transfer endpoint; see the module docstring. ``secret`` and ``tls``
    default to the process's (:mod:`kvmesh.runtime.auth`)."""

    engine: KvBlockAccess  # the engine whose blocks it serves
    host: str = "127.0.0.1"
    serve_prefixes: bool = False  # answer peers' prefix reads (--peer-fetch; issue 33)
    port: int = 0
    secret: ClusterSecret | None = field(default_factory=auth.process_secret)
    tls: TlsContexts | None = field(default_factory=auth.process_tls)
    refused: int = field(init=False, default=0)  # operations refused before their payload was read
    prefixes_served: int = field(init=False, default=0)  # prefix reads answered (blocks found or not)
    stats: TransferStats = field(init=False, default_factory=TransferStats)
    _expected: dict[str, _Expected] = field(init=False, default_factory=dict)
    # tracing: transfer id → the peer's span (bounded below)
    trace_links: dict[str, str] = field(init=False, default_factory=dict)
    _server: asyncio.AbstractServer | None = field(init=False, default=None)
    _conns: dict[asyncio.StreamWriter, asyncio.Task[None] | None] = field(init=False, default_factory=dict)

    async def start(self) -> None:
        tls = self.tls.server if self.tls is not None else None
        timeout = HANDSHAKE_TIMEOUT_S if tls is not None else None
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=tls, ssl_handshake_timeout=timeout)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def endpoint(self) -> KvEndpoint | None:
        layout = self.engine.kv_layout()
        return None if layout is None else KvEndpoint(self.address, layout, self.serve_prefixes)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            for writer in list(self._conns):
                writer.close()
            tasks = [t for t in self._conns.values() if t is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=5)
            await server.wait_closed()
        for exp in self._expected.values():
            if not exp.done.done():
                exp.done.set_result((0, "the worker's KV-transfer server closed"))
        self._expected.clear()

    # ------------------------------------------------------------------ transfers

    def expect(self, transfer_id: str, readable: Sequence[int], writable: Sequence[int]) -> asyncio.Future[tuple[int, str]]:
        """Allow reads of ``readable`` and writes of ``writable`` under ``transfer_id``
        until ``done``; the future gets ``(num_tokens, error)`` from the peer's done."""
        done: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        self._expected[transfer_id] = _Expected(frozenset(readable), frozenset(writable), done)
        return done

    def offer(self, transfer_id: str, readable: Sequence[int]) -> asyncio.Future[tuple[int, str]]:
        """Let a peer read ``readable`` (a migration source) until it says done."""
        return self.expect(transfer_id, readable, ())

    def forget(self, transfer_id: str) -> None:
        """Refuse every later operation on ``transfer_id`` (cancelled, timed out)."""
        exp = self._expected.pop(transfer_id, None)
        if exp is not None and not exp.done.done():
            exp.done.cancel()

    @property
    def pending(self) -> int:
        return len(self._expected)

    # ------------------------------------------------------------------ connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns[writer] = asyncio.current_task()
        peer = writer.get_extra_info("peername")
        peer_name = f"KV-transfer peer {peer[0]}:{peer[1]}" if peer else "KV-transfer peer"
        wire: _Wire = _Plain(reader, writer)
        try:
            if self.secret is not None:
                hs = Handshake(self.secret, "kv", client=False, peer=peer_name)
                await handshake_streams(reader, writer, hs)
                wire = _wire(reader, writer, hs)
            while True:
                try:
                    header = await wire.readexactly(_LEN.size)
                except asyncio.IncompleteReadError:
                    return
                if self.secret is None and auth.looks_like_handshake(header):
                    log.warning("refusing %s: it sent a cluster-secret handshake but this process has no cluster secret", peer_name)
                    return
                if self.tls is None and auth.looks_like_tls(header):
                    log.warning("refusing %s: it speaks TLS but this process has no --tls-cert/--tls-key/--tls-ca", peer_name)
                    return
                op = _decode_op(await _read_sized(wire, _LEN.unpack(header)[0], MAX_HEADER))
                refusal = self._check(op)
                if refusal is not None:
                    # Answer, then close: the payload it announced is never read.
                    self.refused += 1
                    _send(wire, _encode(KvReply(False, refusal)), b"")
                    await writer.drain()
                    return
                payload = await wire.readexactly(op.nbytes) if op.op == "write" else b""
                reply, data = self._handle(op, payload)
                _send(wire, _encode(reply), data)
                await writer.drain()
        except AuthError as exc:
            # the handshake's messages name the peer; a record's does not
            log.warning("refusing connection: %s", exc.message if isinstance(wire, _Plain) else f"{peer_name}: {exc.message}")
        except (ConnectionError, asyncio.IncompleteReadError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.warning("KV-transfer connection dropped: %s", exc)
        finally:
            self._conns.pop(writer, None)
            writer.close()

    def _check(self, op: KvOp) -> str | None:
        """Why ``op`` is refused before anything more is read (None: go ahead)."""
        if op.op == "prefix":
            return self._check_prefix(op)
        exp = self._expected.get(op.transfer_id)
        if exp is None:
            return f"no transfer {op.transfer_id!r} here (cancelled or finished)"
        if op.op == "done":
            return None
        allowed = exp.readable if op.op == "read" else exp.writable
        if any(count < 1 or first < 0 for first, count in op.runs):
            return f"transfer {op.transfer_id!r}: block runs must be (first >= 0, count >= 1)"
        blocks = sum(count for _, count in op.runs)
        if blocks > len(allowed):
            return f"transfer {op.transfer_id!r} may {op.op} {len(allowed)} blocks, not {blocks}"
        if op.op == "write":
            layout = self.engine.kv_layout()
            want = blocks * layout.wire_bytes_per_block if layout is not None else op.nbytes
            if op.nbytes != want:
                return f"transfer {op.transfer_id!r}: {blocks} blocks are {want} bytes, not {op.nbytes}"
        elif op.nbytes:
            return f"transfer {op.transfer_id!r}: a {op.op} carries no payload"
        return None

    def _check_prefix(self, op: KvOp) -> str | None:
        if not self.serve_prefixes:
            return "this worker does not serve prefixes to peers (start it with --peer-fetch)"
        layout = self.engine.kv_layout()
        most = layout.num_blocks * layout.block_size + 1 if layout is not None else 0
        if not 2 <= len(op.tokens) <= most or op.nbytes or op.runs:
            return f"a prefix read names 2..{most} tokens and carries nothing else, not {len(op.tokens)} tokens"
        return None

    def _serve_prefix(self, op: KvOp) -> tuple[KvReply, bytes]:
        """The leading blocks of ``op.tokens`` this engine holds now, read under a
        reservation of their own (pinned while they are exported, given back at once):
        nothing to expect, nothing left behind; blocks evicted meanwhile are not found."""
        layout = self.engine.kv_layout()
        if layout is None:
            return KvReply(False, "the engine has no KV layout"), b""
        rid = f"peer-prefix-{uuid.uuid4().hex}"
        probe = PreprocessedRequest(
            rid, "", list(op.tokens), stop=StopConditions(max_tokens=1), adapter=op.adapter, cache_salt=op.cache_salt
        )
        res = self.engine.kv_reserve(probe)
        self.prefixes_served += 1
        if res is None:  # no room to pin them now: found nothing
            return KvReply(True), b""
        try:
            found = res.cached_tokens // layout.block_size
            data = self.engine.kv_export(res.block_ids[:found]) if found else b""
        finally:
            self.engine.kv_release(rid)
        self.stats.bytes_sent += self._real(found, len(data))
        return KvReply(True, nbytes=len(data)), data

    def _handle(self, op: KvOp, payload: bytes) -> tuple[KvReply, bytes]:
        if op.op == "prefix":
            try:
                return self._serve_prefix(op)
            except KvmeshError as exc:
                return KvReply(False, exc.message), b""
        exp = self._expected.get(op.transfer_id)
        if exp is None:
            return KvReply(False, f"no transfer {op.transfer_id!r} here (cancelled or finished)"), b""
        blocks = _expand(op.runs)
        try:
            if op.op == "read":
                if not exp.readable.issuperset(blocks):
                    raise InvalidArgument(f"transfer {op.transfer_id!r} may not read blocks {sorted(set(blocks) - exp.readable)}")
                data = b"".join(self.engine.kv_export(range(first, first + n)) for first, n in op.runs)
                self.stats.bytes_sent += self._real(len(blocks), len(data))
                return KvReply(True, nbytes=len(data)), data
            if op.op == "write":
                if not exp.writable.issuperset(blocks):
                    raise InvalidArgument(f"transfer {op.transfer_id!r} may not write blocks {sorted(set(blocks) - exp.writable)}")
                self.engine.kv_import(blocks, payload)
                self.stats.bytes_received += self._real(len(blocks), len(payload))
                return KvReply(True), b""
            del self._expected[op.transfer_id]
            if op.trace_link and len(op.trace_link) <= 64:
                if len(self.trace_links) >= 1024:
                    del self.trace_links[next(iter(self.trace_links))]
                self.trace_links[op.transfer_id] = op.trace_link
            if not exp.done.done():
                exp.done.set_result((op.num_tokens, op.error))
            return KvReply(True), b""
        except KvmeshError as exc:
            return KvReply(False, exc.message), b""


    def _real(self, blocks: int, wire: int) -> int:
        layout = self.engine.kv_layout()
        return wire if layout is None else _real_bytes(layout, blocks, wire)


class _Wire(Protocol):
    """One KV-transfer connection's bytes: as they are (:class:`_Plain`), or in
    authenticated records (:class:`~kvmesh.runtime.auth.SealedStream`)."""

    async def readexactly(self, n: int) -> bytes: ...
    def write(self, *parts: bytes) -> None: ...


class _Plain:
    """No records: no cluster secret, or TLS (which authenticates the bytes itself)."""

    __slots__ = ("_reader", "_writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def readexactly(self, n: int) -> bytes:
        return await self._reader.readexactly(n)

    def write(self, *parts: bytes) -> None:
        for part in parts:
            if part:
                self._writer.write(part)


def _wire(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hs: Handshake) -> _Wire:
    """What follows a finished handshake ``hs``: records, unless the connection is TLS."""
    if writer.get_extra_info("ssl_object") is not None:
        return _Plain(reader, writer)
    return SealedStream(reader, writer, hs.keys())


async def _read_sized(wire: _Wire, n: int, limit: int) -> bytes:
    if n > limit:
        raise ValueError(f"frame of {n} bytes over the limit of {limit}")
    return await wire.readexactly(n)


def _send(wire: _Wire, header: bytes, data: bytes) -> None:
    wire.write(_LEN.pack(len(header)) + header, data)


class KvConnector(abc.ABC):
    """Moves KV blocks to and from another worker (see :class:`TcpKvConnector`)."""

    stats: TransferStats

    @abc.abstractmethod
    async def read(self, peer: KvEndpoint, transfer_id: str, block_ids: Sequence[int], into: KvLayout) -> bytes:
        """The peer's blocks, converted to layout ``into``."""

    @abc.abstractmethod
    async def write(self, peer: KvEndpoint, transfer_id: str, block_ids: Sequence[int], data: bytes, src: KvLayout) -> None:
        """Write ``data`` (layout ``src``) into the peer's blocks."""

    async def read_prefix(self, peer: KvEndpoint, request: PreprocessedRequest, blocks: int, into: KvLayout) -> tuple[int, bytes]:
        """The KV of the peer's leading blocks of ``request``'s prompt (at most
        ``blocks``), converted to ``into``: ``(blocks found, data)``; (0, b"") when it
        holds none of them any more."""
        raise InvalidArgument(f"{type(self).__name__} does not read prefixes from peers")

    @abc.abstractmethod
    async def done(self, peer: KvEndpoint, transfer_id: str, num_tokens: int, error: str = "", trace_link: str = "") -> None:
        """Tell the peer the transfer is over (``error`` if it failed; ``trace_link``: the
        sender's span, when tracing)."""

    async def close(self) -> None:
        return None


class _Link:
    """One TCP connection to a peer; operations on it take turns."""

    def __init__(self, wire: _Wire, writer: asyncio.StreamWriter) -> None:
        self.wire = wire
        self.writer = writer
        self.lock = asyncio.Lock()

    async def call(self, op: KvOp, data: bytes = b"", max_reply: int = 0) -> tuple[KvReply, bytes]:
        """Send ``op`` (+ ``data``); the reply and at most ``max_reply`` bytes of payload
        (a bigger announced payload is a ValueError, before it is read)."""
        async with self.lock:
            _send(self.wire, _encode(op), data)
            await self.writer.drain()
            header = await self.wire.readexactly(_LEN.size)
            reply = _decode_reply(await _read_sized(self.wire, _LEN.unpack(header)[0], MAX_HEADER))
            payload = await _read_sized(self.wire, reply.nbytes, max_reply) if reply.nbytes else b""
            return reply, payload


@dataclass(eq=False)
class TcpKvConnector(KvConnector):
    """Bulk KV transfer over TCP, one connection per peer, reused. ``secret`` and ``tls``
    default to the process's (:mod:`kvmesh.runtime.auth`)."""

    convert: LayoutConverter = convert_layout
    connect_timeout_s: float = 5.0
    secret: ClusterSecret | None = field(default_factory=auth.process_secret)
    tls: TlsContexts | None = field(default_factory=auth.process_tls)
    stats: TransferStats = field(init=False, default_factory=TransferStats)
    _links: dict[str, _Link] = field(init=False, default_factory=dict)

    async def _link(self, address: str) -> _Link:
        link = self._links.get(address)
        if link is not None and not link.writer.is_closing():
            return link
        host, _, port = address.rpartition(":")
        try:
            tls = self.tls.client if self.tls is not None else None
            opening = asyncio.open_connection(host, int(port), ssl=tls, server_hostname=host if tls is not None else None)
            reader, writer = await asyncio.wait_for(opening, self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise CannotConnect(f"cannot reach the KV-transfer server at {address}: {exc}") from None
        wire: _Wire = _Plain(reader, writer)
        if self.secret is not None:
            hs = Handshake(self.secret, "kv", client=True, peer=f"KV-transfer server {address}")
            try:
                await handshake_streams(reader, writer, hs, self.connect_timeout_s)
            except AuthError as exc:
                writer.close()
                log.warning("cannot connect: %s", exc.message)
                raise CannotConnect(f"cannot use the KV-transfer server at {address}: {exc.message}") from None
            wire = _wire(reader, writer, hs)
        link = self._links[address] = _Link(wire, writer)
        return link

    async def _call(self, peer: KvEndpoint, op: KvOp, data: bytes = b"", max_reply: int = 0) -> bytes:
        link = await self._link(peer.address)
        try:
            reply, payload = await link.call(op, data, max_reply)
        except AuthError as exc:  # a record that failed its check: nothing more from there is trusted
            self._links.pop(peer.address, None)
            link.writer.close()
            log.warning("closing the KV-transfer connection to %s: %s", peer.address, exc.message)
            raise Disconnected(f"KV-transfer connection to {peer.address} closed: {exc.message}") from None
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError) as exc:
            self._links.pop(peer.address, None)
            link.writer.close()
            raise Disconnected(f"KV-transfer connection to {peer.address} lost: {exc}") from None
        except asyncio.CancelledError:  # a timeout mid-call: the connection's bytes are out of step
            if self._links.get(peer.address) is link:
                del self._links[peer.address]
            link.writer.close()
            raise
        if not reply.ok:
            # a refusal may have closed the connection (a write refused before its payload)
            if self._links.pop(peer.address, None) is not None:
                link.writer.close()
            raise InvalidArgument(f"KV transfer {op.op} at {peer.address} refused: {reply.error}")
        return payload

    async def read(self, peer: KvEndpoint, transfer_id: str, block_ids: Sequence[int], into: KvLayout) -> bytes:
        if not block_ids:
            return b""
        started = time.perf_counter()
        # what the blocks can be in the peer's layout, and not a byte more
        expected = len(block_ids) * peer.layout.wire_bytes_per_block
        data = await self._call(peer, KvOp("read", transfer_id, block_runs(block_ids)), max_reply=min(expected, _MAX_PAYLOAD))
        await _simulate(peer.layout, len(block_ids))
        self._account(started, received=_real_bytes(peer.layout, len(block_ids), len(data)))
        return self.convert(data, peer.layout, into)

    async def write(self, peer: KvEndpoint, transfer_id: str, block_ids: Sequence[int], data: bytes, src: KvLayout) -> None:
        if not block_ids:
            return
        started = time.perf_counter()
        data = self.convert(data, src, peer.layout)
        await _simulate(peer.layout, len(block_ids))  # simulated bytes land when they would have arrived
        await self._call(peer, KvOp("write", transfer_id, block_runs(block_ids), nbytes=len(data)), data)
        self._account(started, sent=_real_bytes(peer.layout, len(block_ids), len(data)))

    async def read_prefix(self, peer: KvEndpoint, request: PreprocessedRequest, blocks: int, into: KvLayout) -> tuple[int, bytes]:
        bs = peer.layout.block_size
        tokens = request.token_ids[: blocks * bs + 1]
        if blocks < 1 or len(tokens) < 2:
            return 0, b""
        started = time.perf_counter()
        op = KvOp("prefix", "", tokens=tokens, adapter=request.adapter, cache_salt=request.cache_salt)
        wire = peer.layout.wire_bytes_per_block
        data = await self._call(peer, op, max_reply=min(blocks * wire, _MAX_PAYLOAD))
        found = len(data) // wire if wire else 0
        if found > blocks or found * wire != len(data):
            raise InvalidArgument(f"the prefix read from {peer.address} returned {len(data)} bytes, not whole blocks")
        await _simulate(peer.layout, found)
        self._account(started, received=_real_bytes(peer.layout, found, len(data)))
        return found, self.convert(data, peer.layout, into)

    async def done(self, peer: KvEndpoint, transfer_id: str, num_tokens: int, error: str = "", trace_link: str = "") -> None:
        await self._call(peer, KvOp("done", transfer_id, num_tokens=num_tokens, error=error, trace_link=trace_link))

    def _account(self, started: float, sent: int = 0, received: int = 0) -> None:
        stats = self.stats
        stats.bytes_sent += sent
        stats.bytes_received += received
        stats.seconds += time.perf_counter() - started

    async def close(self) -> None:
        links, self._links = self._links, {}
        for link in links.values():
            link.writer.close()


async def _simulate(layout: KvLayout, blocks: int) -> None:
    """Engines without real tensors: take the time the real bytes would take."""
    if layout.simulated_bytes_per_s > 0:
        await asyncio.sleep(blocks * layout.bytes_per_block / layout.simulated_bytes_per_s)


def _real_bytes(layout: KvLayout, blocks: int, wire: int) -> int:
    """What a transfer moved: the wire bytes, or the modelled ones for simulated KV."""
    return blocks * layout.bytes_per_block if layout.simulated_bytes_per_s > 0 else wire
