"""Mutual TLS on the internal TCP planes (stdlib ssl): the request plane, the NATS
call-home and KV transfer serve peers with a certificate of the fleet's CA and refuse
plaintext peers and certificates from another CA, with one clear line each."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.errors import CannotConnect, KvmeshError
from kvmesh.protocol import KvEndpoint
from kvmesh.runtime.auth import ClusterSecret, TlsContexts
from kvmesh.runtime.context import Context
from kvmesh.runtime.nats import CallHomeServer, NatsRequestClient, NatsRequestServer, connect_nats
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer
from tests.security.certs import make_certs

pytestmark = pytest.mark.timeout(90)

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
SECRET = ClusterSecret(b"t" * 32)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    fleet = make_certs(d, ("server", "client"), "ca")
    other = make_certs(d, ("stranger",), "otherca")
    return {
        "server": TlsContexts.from_files(fleet["server.pem"], fleet["server.key"], fleet["ca.pem"]),
        "client": TlsContexts.from_files(fleet["client.pem"], fleet["client.key"], fleet["ca.pem"]),
        "stranger": TlsContexts.from_files(other["stranger.pem"], other["stranger.key"], fleet["ca.pem"]),
    }


async def count(payload, ctx):
    for i in range(dec(payload)):
        yield i


async def _collect(client, n=3):
    return [x async for x in client.stream("count", enc(n), Context("t"), decode=dec)]


async def test_request_plane_over_mutual_tls_with_the_secret(tls, caplog):
    server = TcpServer(secret=SECRET, tls=tls["server"])
    server.register("count", count)
    await server.start()
    good = TcpClient(server.address, secret=SECRET, tls=tls["client"])
    plain = TcpClient(server.address, secret=SECRET, tls=None, connect_timeout=5)
    stranger = TcpClient(server.address, secret=SECRET, tls=tls["stranger"], connect_timeout=5)
    try:
        assert await _collect(good, 5) == [0, 1, 2, 3, 4]
        assert good._conn.transport.get_extra_info("ssl_object") is not None
        with pytest.raises(KvmeshError):
            await _collect(plain)
        with pytest.raises(KvmeshError):
            await _collect(stranger)
        assert await _collect(good, 2) == [0, 1]  # still serving
    finally:
        for c in (good, plain, stranger):
            await c.close()
        await server.close()


async def test_a_tls_client_against_a_plain_server_is_one_clear_line(tls, caplog):
    server = TcpServer(secret=None, tls=None)
    server.register("count", count)
    await server.start()
    client = TcpClient(server.address, secret=None, tls=tls["client"], connect_timeout=5)
    try:
        with pytest.raises(CannotConnect):
            await _collect(client)
        for _ in range(100):
            if "it speaks TLS but this process has no --tls-cert" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "it speaks TLS but this process has no --tls-cert" in caplog.text
    finally:
        await client.close()
        await server.close()


async def test_kv_transfer_over_mutual_tls(tls):
    engine = MockerEngine(MockerOptions(worker_id=1, speedup=100.0, num_blocks=64, eos_token_ids=(2,), vocab_size=512))
    await engine.start()
    server = KvTransferServer(engine, secret=SECRET, tls=tls["server"])
    await server.start()
    try:
        done = server.expect("t", readable=[], writable=[])
        peer = KvEndpoint(server.address, engine.kv_layout())
        plain = TcpKvConnector(secret=SECRET, tls=None, connect_timeout_s=3)
        with pytest.raises(KvmeshError):
            await plain.done(peer, "t", 1)
        await plain.close()
        good = TcpKvConnector(secret=SECRET, tls=tls["client"])
        await good.done(peer, "t", 3)
        await good.close()
        assert await done == (3, "")
    finally:
        await server.close()
        await engine.cleanup()


async def test_nats_call_home_over_mutual_tls(tls, nats):
    worker_nc, caller_nc = await connect_nats(nats.url), await connect_nats(nats.url)
    server = NatsRequestServer(worker_nc, "ns", "w", 0xAB, secret=SECRET, tls=tls["client"])
    server.register("count", count)
    await server.start()
    home = CallHomeServer(secret=SECRET, tls=tls["server"])
    client = NatsRequestClient(caller_nc, home, "ns", "w", 0xAB, connect_timeout=3)
    try:
        assert await _collect(client, 4) == [0, 1, 2, 3]
        # a worker without TLS cannot call this caller home
        plain = NatsRequestServer(worker_nc, "ns", "w", 0xAC, secret=SECRET, tls=None)
        plain.register("count", count)
        await plain.start()
        try:
            other = NatsRequestClient(caller_nc, home, "ns", "w", 0xAC, connect_timeout=2)
            with pytest.raises(KvmeshError):
                await _collect(other)
        finally:
            await plain.close()
    finally:
        await server.close()
        await home.close()
        await worker_nc.close()
        await caller_nc.close()
