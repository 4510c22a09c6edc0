"""Attacks on the KV-transfer server's prefix reads (a peer fetch, issue 33): a server
that does not serve prefixes (no --peer-fetch) answers none, a read naming more tokens
than the engine could hold is refused before anything is reserved, and with a cluster
secret a peer without it reads nothing."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvmesh.disagg.transfer import KvOp, KvReply, KvTransferServer, TcpKvConnector
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.errors import KvmeshError
from kvmesh.protocol import OutputChunk, PreprocessedRequest, StopConditions
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context

pytestmark = pytest.mark.timeout(60)

_LEN = struct.Struct("<I")
SECRET = ClusterSecret(b"w" * 32)
TOKENS = [(i * 7) % 500 + 10 for i in range(64)]  # 4 blocks of 16, then one token


async def _serve(serve: bool, secret: ClusterSecret | None) -> tuple[MockerEngine, KvTransferServer]:
    engine = MockerEngine(MockerOptions(worker_id=1, speedup=100.0, num_blocks=64, eos_token_ids=(2,), vocab_size=512))
    await engine.start()
    req = PreprocessedRequest("warm", "m", TOKENS + [3], stop=StopConditions(max_tokens=1, ignore_eos=True))
    chunks: list[OutputChunk] = [c async for c in engine.generate(req, Context("warm"))]  # the engine holds the prefix
    assert chunks
    server = KvTransferServer(engine, serve_prefixes=serve, secret=secret, tls=None)
    await server.start()
    return engine, server


@pytest.fixture
async def plain_server() -> AsyncIterator[KvTransferServer]:
    engine, server = await _serve(True, None)
    try:
        yield server
    finally:
        await server.close()
        await engine.cleanup()


async def _raw_op(server: KvTransferServer, op: KvOp) -> tuple[KvReply | None, bytes]:
    r, w = await asyncio.open_connection(server.host, server.port)
    try:
        header = msgspec.msgpack.encode(op)
        w.write(_LEN.pack(len(header)) + header)
        await w.drain()
        data = await asyncio.wait_for(r.read(), 10)  # a refusal: answered, then closed
    finally:
        w.close()
    if len(data) < 4:
        return None, data
    (n,) = _LEN.unpack_from(data)
    return msgspec.msgpack.decode(data[4 : 4 + n], type=KvReply), data[4 + n :]


async def test_a_server_without_peer_fetch_serves_no_prefix() -> None:
    engine, server = await _serve(False, None)
    try:
        reply, rest = await _raw_op(server, KvOp("prefix", "", tokens=TOKENS + [1]))
        assert reply is not None and not reply.ok and "--peer-fetch" in reply.error
        assert rest == b"" and server.refused == 1 and server.prefixes_served == 0
    finally:
        await server.close()
        await engine.cleanup()


async def test_a_prefix_read_of_more_tokens_than_the_pool_holds_is_refused_unread(plain_server: KvTransferServer) -> None:
    too_many = [5] * (64 * 16 + 2)  # one token past what 64 blocks of 16 (and the one to compute) allow
    reply, _ = await _raw_op(plain_server, KvOp("prefix", "", tokens=too_many))
    assert reply is not None and not reply.ok and "tokens" in reply.error
    assert plain_server.refused == 1 and plain_server.prefixes_served == 0


async def test_a_prefix_read_carrying_a_payload_is_refused(plain_server: KvTransferServer) -> None:
    reply, _ = await _raw_op(plain_server, KvOp("prefix", "", tokens=TOKENS + [1], nbytes=1 << 30))
    assert reply is not None and not reply.ok
    assert plain_server.refused == 1 and plain_server.prefixes_served == 0


async def test_the_prefix_is_served_to_a_peer_that_asks_properly(plain_server: KvTransferServer) -> None:
    """The control: the same server answers a proper read with the 4 blocks it holds."""
    kv = plain_server.endpoint()
    assert kv is not None
    connector = TcpKvConnector(secret=None, tls=None)
    try:
        req = PreprocessedRequest("r", "m", TOKENS + [9, 9])
        found, data = await connector.read_prefix(kv, req, 4, kv.layout)
        assert found == 4 and len(data) == 4 * kv.layout.wire_bytes_per_block
    finally:
        await connector.close()


@pytest.mark.parametrize("secret", [None, ClusterSecret(b"x" * 32)], ids=["no secret", "another secret"])
async def test_without_the_cluster_secret_no_prefix_is_read(secret: ClusterSecret | None) -> None:
    engine, server = await _serve(True, SECRET)
    connector = TcpKvConnector(secret=secret, tls=None, connect_timeout_s=2.0)
    try:
        kv = server.endpoint()
        assert kv is not None
        with pytest.raises(KvmeshError):
            await asyncio.wait_for(connector.read_prefix(kv, PreprocessedRequest("r", "m", TOKENS + [9]), 4, kv.layout), 5)
        assert server.prefixes_served == 0
    finally:
        await connector.close()
        await server.close()
        await engine.cleanup()
