"""Attacks on the KV-transfer server: writes it does not expect, with sizes it must
not read, and peers without the cluster secret."""

from __future__ import annotations

import asyncio
import struct

import msgspec
import pytest

from kvmesh.disagg.transfer import KvOp, KvReply, KvTransferServer, TcpKvConnector
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.errors import CannotConnect
from kvmesh.protocol import KvEndpoint
from kvmesh.runtime.auth import ClusterSecret

pytestmark = pytest.mark.timeout(60)

_LEN = struct.Struct("<I")
SECRET = ClusterSecret(b"v" * 32)
HUGE = 6 * 1024 * 1024 * 1024


@pytest.fixture
async def kv_server(request):
    secret = getattr(request, "param", None)
    engine = MockerEngine(MockerOptions(worker_id=1, speedup=100.0, num_blocks=64, eos_token_ids=(2,), vocab_size=512))
    await engine.start()
    server = KvTransferServer(engine, secret=secret)
    await server.start()
    try:
        yield server
    finally:
        await server.close()
        await engine.cleanup()


async def _raw_op(server: KvTransferServer, op: KvOp) -> tuple[KvReply | None, bytes]:
    """Send only ``op``'s header (never its payload); the reply and what follows it."""
    r, w = await asyncio.open_connection(server.host, server.port)
    try:
        header = msgspec.msgpack.encode(op)
        w.write(_LEN.pack(len(header)) + header)
        await w.drain()
        data = await asyncio.wait_for(r.read(), 10)  # the server answers and closes
    finally:
        w.close()
    if len(data) < 4:
        return None, data
    (n,) = _LEN.unpack_from(data)
    return msgspec.msgpack.decode(data[4 : 4 + n], type=KvReply), data[4 + n :]


async def test_a_write_with_an_unknown_id_and_a_huge_size_is_refused_before_any_read(kv_server):
    reply, rest = await _raw_op(kv_server, KvOp("write", "nobody-expects-this", [(0, 1)], nbytes=HUGE))
    assert reply is not None and not reply.ok and "no transfer" in reply.error
    assert rest == b"" and kv_server.refused == 1


async def test_a_write_over_the_reservation_is_refused_before_any_read(kv_server):
    done = kv_server.expect("t1", readable=[], writable=[5, 6])
    layout = kv_server.engine.kv_layout()
    cases = [
        KvOp("write", "t1", [(5, 2**40)], nbytes=HUGE),  # block count
        KvOp("write", "t1", [(5, -3)], nbytes=0),  # nonsense run
        KvOp("write", "t1", [(5, 2)], nbytes=HUGE),  # bytes for 2 blocks
        KvOp("write", "t1", [(5, 2)], nbytes=2 * layout.wire_bytes_per_block + 1),
    ]
    for op in cases:
        reply, _ = await _raw_op(kv_server, op)
        assert reply is not None and not reply.ok, op
    assert kv_server.refused == len(cases)
    assert not done.done() and kv_server.pending == 1  # the real transfer is untouched


@pytest.mark.parametrize("kv_server", [SECRET], indirect=True)
async def test_a_rogue_without_the_secret_cannot_write_kv(kv_server, caplog):
    done = kv_server.expect("t2", readable=[], writable=[3])
    layout = kv_server.engine.kv_layout()
    peer = KvEndpoint(kv_server.address, layout)
    rogue = TcpKvConnector(secret=None, connect_timeout_s=5)
    with pytest.raises(Exception):
        await rogue.write(peer, "t2", [3], b"\x00" * layout.wire_bytes_per_block, layout)
    with pytest.raises(Exception):
        await rogue.done(peer, "t2", 99, "")
    await rogue.close()
    assert "did not start the cluster-secret handshake" in caplog.text
    assert not done.done()
    wrong = TcpKvConnector(secret=ClusterSecret(b"w" * 32), connect_timeout_s=5)
    with pytest.raises(CannotConnect, match="cluster secret mismatch"):
        await wrong.done(peer, "t2", 99, "")
    await wrong.close()
    real = TcpKvConnector(secret=SECRET)
    await real.done(peer, "t2", 7, "")
    await real.close()
    assert await done == (7, "")


async def test_a_reader_takes_no_more_bytes_than_the_blocks_it_asked_for():
    """A KV-transfer server (rogue, or broken) that announces a huge answer to a read is
    refused before a byte of it is read."""
    from kvmesh.errors import Disconnected
    from kvmesh.protocol import KvLayout

    async def rogue(reader, writer):
        try:
            await reader.read(1024)
            header = msgspec.msgpack.encode(KvReply(True, nbytes=HUGE))
            writer.write(_LEN.pack(len(header)) + header + b"x" * 1024)
            await writer.drain()
            await reader.read()  # until the connector hangs up
        finally:
            writer.close()

    server = await asyncio.start_server(rogue, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    layout = KvLayout("mocker", 16, 64, (1,), "u8", 4096, 8)
    connector = TcpKvConnector(secret=None)
    try:
        with pytest.raises(Disconnected, match="over the limit of 16"):
            await connector.read(KvEndpoint(f"127.0.0.1:{port}", layout), "t", [1, 2], layout)
    finally:
        await connector.close()
        server.close()
        await server.wait_closed()
