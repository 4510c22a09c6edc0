"""A prefix from a peer (issue 33), in one process over real loopback TCP: two mocker
engines behind DisaggEngine fronts whose KV-transfer servers serve prefixes. Worker A
holds a long prefix; a request sent to B with the router's PeerPrefix hint reads it from
A (B's cached tokens cover it) and generates the same tokens as a plain prefill. A that
evicted the blocks between the decision and the read, a wrong cluster secret, a peer
that does not serve prefixes: B prefills, same tokens, nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvmesh.disagg.engine import DisaggEngine
from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.protocol import OutputChunk, PeerPrefix, PreprocessedRequest, RoutingHints, StopConditions
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context

pytestmark = pytest.mark.timeout(60)

BS = 16
SECRET = ClusterSecret(b"p" * 32)


def options(worker_id: int, **kw: object) -> MockerOptions:
    base = dict(worker_id=worker_id, speedup=200.0, num_blocks=256, block_size=BS, eos_token_ids=(2,), vocab_size=2048)
    base.update(kw)
    return MockerOptions(**base)  # type: ignore[arg-type]


def request(rid: str, prompt_len: int, salt: int = 0, tail: int = 0) -> PreprocessedRequest:
    """``prompt_len`` tokens of prefix ``salt``, then ``tail`` tokens of their own."""
    tokens = [(i * 7 + salt) % 1900 + 10 for i in range(prompt_len)] + [(i * 13 + rid.__len__()) % 1900 + 10 for i in range(tail)]
    return PreprocessedRequest(rid, "m", tokens, stop=StopConditions(max_tokens=8, ignore_eos=True))


def hinted(req: PreprocessedRequest, peer: PeerPrefix) -> PreprocessedRequest:
    return msgspec.structs.replace(req, routing=RoutingHints(peer=peer))


async def run(front: DisaggEngine, req: PreprocessedRequest) -> tuple[list[int], int]:
    """The tokens and the cached tokens the engine reported."""
    out: list[int] = []
    cached = 0
    async for chunk in front.generate(req, Context(req.request_id)):
        out += chunk.token_ids
        cached = chunk.cached_tokens or cached
        if chunk.usage is not None:
            cached = chunk.usage.cached_tokens or cached
        assert chunk.finish_reason in (None, "length"), chunk
    return out, cached


def front(worker_id: int, secret: ClusterSecret | None, serve: bool = True, **kw: object) -> DisaggEngine:
    inner = MockerEngine(options(worker_id, **kw))
    server = KvTransferServer(inner, serve_prefixes=serve, secret=secret, tls=None)
    return DisaggEngine(inner, worker_id=worker_id, transfer=server, connector=TcpKvConnector(secret=secret, tls=None))


@contextlib.asynccontextmanager
async def pair(
    secret_a: ClusterSecret | None = SECRET, secret_b: ClusterSecret | None = SECRET, serve_a: bool = True, **kw: object
) -> AsyncIterator[tuple[DisaggEngine, DisaggEngine]]:
    a, b = front(1, secret_a, serve_a, **kw), front(2, secret_b, **kw)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await b.cleanup()
        await a.cleanup()


async def plain(req: PreprocessedRequest) -> list[int]:
    """The tokens of a plain prefill on a fresh engine."""
    engine = MockerEngine(options(99))
    await engine.start()
    try:
        out: list[int] = []
        async for chunk in engine.generate(req, Context(req.request_id)):
            out += chunk.token_ids
        return out
    finally:
        await engine.cleanup()


def peer_of(a: DisaggEngine, blocks: int) -> PeerPrefix:
    kv = a.kv_endpoint
    assert kv is not None and kv.serves_prefixes
    return PeerPrefix(1, kv, blocks)


async def test_b_reads_the_prefix_a_holds_same_tokens() -> None:
    async with pair() as (a, b):
        await run(a, request("warm", 320, tail=5))  # A holds 20 blocks of prefix 0
        req = request("second", 320, tail=9)
        got, cached = await run(b, hinted(req, peer_of(a, 20)))
        assert got == await plain(req)
        assert cached == 320  # the 20 blocks came from A: not prefilled here
        stats = b.disagg_stats()
        assert (stats.peer_fetches, stats.peer_fetch_blocks, stats.peer_fetch_fallbacks) == (1, 20, 0)
        assert stats.kv_bytes_received == 20 * a.kv.kv_layout().bytes_per_block  # type: ignore[union-attr]
        assert a.disagg_stats().peer_prefixes_served == 1
        # adopted into B's prefix cache: a third request with the prefix hits there
        _, again = await run(b, request("third", 320, tail=3))
        assert again == 320


async def test_b_fetches_only_what_it_lacks() -> None:
    async with pair() as (a, b):
        await run(a, request("warm", 320, tail=5))
        await run(b, request("b-warm", 160, tail=1))  # B holds the first 10 blocks itself
        got, cached = await run(b, hinted(request("r", 320, tail=4), peer_of(a, 20)))
        assert cached == 320 and got == await plain(request("r", 320, tail=4))
        assert b.disagg_stats().peer_fetch_blocks == 10


async def test_owner_evicted_meanwhile_prefills_same_tokens() -> None:
    # A's pool holds 24 blocks: the router saw its 20-block prefix, then other prompts evict it
    async with pair(num_blocks=24) as (a, b):
        await run(a, request("warm", 320, tail=5))
        hint = peer_of(a, 20)  # the router's decision
        for i in range(3):  # A's pool turns over before B reads
            await run(a, request(f"other{i}", 340, salt=500 + i))
        req = request("late", 320, tail=9)
        got, cached = await run(b, hinted(req, hint))
        assert got == await plain(req) and cached == 0
        stats = b.disagg_stats()
        assert (stats.peer_fetches, stats.peer_fetch_fallbacks) == (0, 1)


async def test_partly_evicted_prefix_fetches_what_is_left() -> None:
    async with pair() as (a, b):
        await run(a, request("warm", 160, tail=5))  # A holds 10 of the 20 blocks the hint names
        req = request("r", 320, tail=9)
        got, cached = await run(b, hinted(req, peer_of(a, 20)))
        assert got == await plain(req) and cached == 160
        stats = b.disagg_stats()
        assert (stats.peer_fetches, stats.peer_fetch_blocks, stats.peer_fetch_fallbacks) == (1, 10, 1)


@pytest.mark.parametrize("case", ["wrong secret", "no secret", "peer does not serve prefixes"])
async def test_unauthenticated_or_refused_fetch_fails_closed_to_prefill(case: str) -> None:
    kw: dict[str, object] = {
        "wrong secret": {"secret_b": ClusterSecret(b"q" * 32)},
        "no secret": {"secret_b": None},
        "peer does not serve prefixes": {"serve_a": False},
    }[case]
    async with pair(**kw) as (a, b):  # type: ignore[arg-type]
        await run(a, request("warm", 320, tail=5))
        kv = a.kv_endpoint
        assert kv is not None
        req = request("r", 320, tail=9)
        got, cached = await run(b, hinted(req, PeerPrefix(1, kv, 20)))
        assert got == await plain(req) and cached == 0
        assert b.disagg_stats().peer_fetch_fallbacks == 1
        assert a.disagg_stats().peer_prefixes_served == 0


async def test_a_peer_that_never_answers_times_out_to_prefill() -> None:
    held: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)  # accepts, reads nothing, answers nothing

    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        async with pair(secret_a=None, secret_b=None) as (a, b):
            b.peer_fetch_timeout_s = 0.3
            kv = a.kv_endpoint
            assert kv is not None
            address = "127.0.0.1:%d" % mute.sockets[0].getsockname()[1]
            req = request("r", 320, tail=9)
            got, cached = await run(b, hinted(req, PeerPrefix(1, msgspec.structs.replace(kv, address=address), 20)))
            assert got == await plain(req) and cached == 0
            assert b.disagg_stats().peer_fetch_fallbacks == 1
            assert b.connector._links == {}  # type: ignore[attr-defined]  # the out-of-step connection was dropped
    finally:
        for w in held:
            w.close()
        mute.close()
        await mute.wait_closed()
