"""The prefill queue's depth and token bounds hold across many decode workers racing
for the last places: embedded mode's queue over the real TCP request plane, and
JetStream on a real nats-server (issue 16, item 1a)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvmesh.disagg.engine import DisaggEngine
from kvmesh.disagg.prefill import KvMetadataCache, PrefillWorker
from kvmesh.disagg.queue import JetStreamPrefillQueue, LocalPrefillQueue, RemotePrefillQueue, serve_queue
from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.protocol import DisaggThresholds, KvEndpoint, PrefillJob, PreprocessedRequest, StopConditions
from kvmesh.runtime.context import Context
from kvmesh.runtime.tcp_server import TcpServer

RACERS = 16


def _request(rid: str, prompt_len: int, salt: int = 0) -> PreprocessedRequest:
    tokens = [(i * 7 + salt) % 1900 + 10 for i in range(prompt_len)]
    return PreprocessedRequest(request_id=rid, model="m", token_ids=tokens, stop=StopConditions(max_tokens=4, ignore_eos=True))


def _job(i: int, tokens: int) -> PrefillJob:
    return PrefillJob(f"job{i}", i, _request(f"r{i}", tokens + 1), [0], 0, tokens)


async def _until(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _served(queue: LocalPrefillQueue):  # type: ignore[no-untyped-def]
    server = TcpServer("127.0.0.1", 0)
    endpoints: dict[int, KvEndpoint] = {}

    async def metadata(worker_id: int) -> KvEndpoint | None:
        return endpoints.get(worker_id)

    serve_queue(server, queue, metadata)
    await server.start()
    try:
        yield server.address, endpoints
    finally:
        await server.close()


async def test_embedded_queue_offers_race_over_tcp_and_the_bound_holds() -> None:
    queue = LocalPrefillQueue(DisaggThresholds(max_local_prefill_length=0, max_prefill_queue_size=3))
    async with _served(queue) as (address, _):
        clients = [RemotePrefillQueue(address) for _ in range(RACERS)]
        try:
            accepted = await asyncio.gather(*(c.offer(_job(i, 100)) for i, c in enumerate(clients)))
            assert sum(accepted) == 3 and queue.max_depth == 3 and queue.refused == RACERS - 3
            status = await clients[0].status()
            assert (status.depth, status.tokens) == (3, 300)
            # a pull frees one place, which exactly one of the next racers gets
            delivery = await clients[0].pull(1.0)
            assert delivery is not None
            accepted = await asyncio.gather(*(c.offer(_job(100 + i, 100)) for i, c in enumerate(clients)))
            assert sum(accepted) == 1 and queue.max_depth == 3
        finally:
            for c in clients:
                await c.close()


async def test_embedded_token_bound_counts_the_work_ahead() -> None:
    queue = LocalPrefillQueue(DisaggThresholds(max_prefill_queue_size=100, max_prefill_queue_tokens=1000))
    async with _served(queue) as (address, _):
        clients = [RemotePrefillQueue(address) for _ in range(RACERS)]
        try:
            accepted = await asyncio.gather(*(c.offer(_job(i, 400)) for i, c in enumerate(clients)))
            # 0, 400, 800 tokens ahead are below 1000: three jobs; 1200 ahead is not
            assert sum(accepted) == 3
            assert (await clients[0].status()).tokens == 1200
        finally:
            for c in clients:
                await c.close()


async def test_many_decode_workers_racing_put_no_more_than_the_bound() -> None:
    """Decode workers, each with its own connection to embedded mode's queue, all
    deciding at once: exactly ``max_prefill_queue_size`` prefills go remote."""
    limit, n = 2, 10
    queue = LocalPrefillQueue(DisaggThresholds(max_local_prefill_length=10, max_prefill_queue_size=limit))
    async with _served(queue) as (address, endpoints):
        decode = []
        for i in range(n):
            inner = MockerEngine(MockerOptions(worker_id=i, speedup=200.0, num_blocks=512))
            engine = DisaggEngine(
                inner, worker_id=i, transfer=KvTransferServer(inner), connector=TcpKvConnector(), mode="decode",
                queue=RemotePrefillQueue(address), remote_timeout_s=60.0, thresholds_refresh_s=0.0,
            )  # fmt: skip
            await engine.start()
            endpoints[i] = engine.kv_endpoint  # type: ignore[assignment]
            decode.append(engine)
        prefill_engine = MockerEngine(MockerOptions(worker_id=99, speedup=200.0, num_blocks=512))
        worker: PrefillWorker | None = None
        try:

            async def one(i: int) -> int:
                got = 0
                async for chunk in decode[i].generate(_request(f"q{i}", 300, salt=i), Context(f"q{i}")):
                    got += len(chunk.token_ids)
                return got

            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            # every decision made: the refused prefilled locally, the accepted wait in the queue
            await _until(lambda: queue.put_count + sum(d.stats.local_by_queue for d in decode) == n)
            assert queue.put_count == limit and queue.max_depth == limit
            await prefill_engine.start()
            lookup = RemotePrefillQueue(address)
            worker = PrefillWorker(prefill_engine, lookup, TcpKvConnector(), KvMetadataCache(lookup.kv_metadata), poll_s=0.05)
            worker.start()
            assert await asyncio.gather(*tasks) == [4] * n
            assert sum(d.stats.remote_prefills for d in decode) == limit
            assert sum(d.stats.local_by_queue for d in decode) == n - limit
        finally:
            if worker is not None:
                await worker.stop()
                await worker.queue.close()
            await prefill_engine.cleanup()
            for engine in decode:
                await engine.cleanup()


async def _nats_queues(url: str, n: int, namespace: str) -> tuple[list[object], list[JetStreamPrefillQueue]]:
    from kvmesh.runtime.nats import connect_nats

    conns = [await connect_nats(url) for _ in range(n)]
    return conns, [JetStreamPrefillQueue(nc, namespace, secret=None) for nc in conns]


async def test_jetstream_bound_holds_across_racing_connections(nats) -> None:  # type: ignore[no-untyped-def]
    conns, queues = await _nats_queues(nats.url, RACERS, "race")
    limits = DisaggThresholds(max_prefill_queue_size=3)
    try:
        await queues[0].status()  # the stream and the counter exist before the race
        accepted = await asyncio.gather(*(q.offer(_job(i, 100), limits) for i, q in enumerate(queues)))
        assert sum(accepted) == 3
        status = await queues[0].status()
        assert (status.depth, status.tokens) == (3, 300)
        delivery = await queues[1].pull(5.0)
        assert delivery is not None
        await delivery.ack()
        assert (await queues[0].status()).depth == 2
        accepted = await asyncio.gather(*(q.offer(_job(100 + i, 100), limits) for i, q in enumerate(queues)))
        assert sum(accepted) == 1
        assert (await queues[2].status()).depth == 3
        # the jobs themselves are all there, each pulled once
        pulled = []
        for _ in range(3):
            d = await queues[3].pull(5.0)
            assert d is not None
            pulled.append(d.job.job_id)
            await d.ack()
        assert len(set(pulled)) == 3 and (await queues[0].status()) .depth == 0
    finally:
        for q in queues:
            await q.close()
        for nc in conns:
            await nc.close()  # type: ignore[attr-defined]


async def test_jetstream_token_bound(nats) -> None:  # type: ignore[no-untyped-def]
    conns, queues = await _nats_queues(nats.url, 8, "tokens")
    limits = DisaggThresholds(max_prefill_queue_size=100, max_prefill_queue_tokens=1000)
    try:
        accepted = await asyncio.gather(*(q.offer(_job(i, 400), limits) for i, q in enumerate(queues)))
        assert sum(accepted) == 3
        assert (await queues[0].status()).tokens == 1200
    finally:
        for q in queues:
            await q.close()
        for nc in conns:
            await nc.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("pipeline", [True, False])
async def test_prefill_worker_pipelines_its_writes(pipeline: bool) -> None:
    """With a slow link, a pipelined prefill worker computes the next job while the
    previous one's KV is still being written; unpipelined it never does."""
    queue = LocalPrefillQueue(DisaggThresholds(max_local_prefill_length=10, max_prefill_queue_size=8))
    # 5 blocks × 16 tokens × 64 KiB at 2 MB/s × speedup 200 ≈ 13 ms of write; compute ~1 ms
    kw = dict(speedup=200.0, num_blocks=512, kv_bytes_per_token=65536, kv_bandwidth=2e6)
    inner = MockerEngine(MockerOptions(worker_id=1, **kw))  # type: ignore[arg-type]
    decode = DisaggEngine(inner, worker_id=1, transfer=KvTransferServer(inner), connector=TcpKvConnector(),
                          mode="decode", queue=queue, remote_timeout_s=60.0)  # fmt: skip
    prefill_engine = MockerEngine(MockerOptions(worker_id=2, **kw))  # type: ignore[arg-type]
    await decode.start()
    await prefill_engine.start()
    endpoint = decode.kv_endpoint

    async def lookup(worker_id: int) -> KvEndpoint | None:
        return endpoint

    worker = PrefillWorker(prefill_engine, queue, TcpKvConnector(), KvMetadataCache(lookup), poll_s=0.05, pipeline=pipeline)
    overlaps = 0
    compute = worker.compute

    async def watched(job: PrefillJob):  # type: ignore[no-untyped-def]
        nonlocal overlaps
        overlaps += worker._writing is not None and not worker._writing.done()
        return await compute(job)

    worker.compute = watched  # type: ignore[method-assign]
    try:

        async def one(i: int) -> int:
            got = 0
            async for chunk in decode.generate(_request(f"p{i}", 80, salt=i), Context(f"p{i}")):
                got += len(chunk.token_ids)
            return got

        tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
        await _until(lambda: queue.put_count == 4)
        worker.start()
        assert await asyncio.gather(*tasks) == [4] * 4
        assert decode.stats.remote_prefills == 4 and worker.stats.prefill_jobs_done == 4
        assert (overlaps > 0) == pipeline
    finally:
        await worker.stop()
        await decode.cleanup()
        await prefill_engine.cleanup()


async def test_jetstream_counter_leak_is_reconciled_from_the_stream(nats) -> None:  # type: ignore[no-untyped-def]
    """A decode worker that dies between counting a job (its compare-and-set) and
    publishing it leaves the counter a job high for good: the bounded queue shrinks.
    The leak is simulated exactly (the compare-and-set without the publish). A holder
    of the queue reconciles it by itself (its periodic loop), from the stream's count
    before any prefill worker pulled; then, by hand, from the consumer's pending count
    once one did: a round sets the counter only when two rounds in a row agree."""
    conns, queues = await _nats_queues(nats.url, 3, "leak")
    decode, prefill, holder = queues
    for q in (decode, prefill):
        q.reconcile_s = 0  # no loop: their rounds are called by hand below
    holder.reconcile_s = 0.1
    limits = DisaggThresholds(max_prefill_queue_size=3)

    async def counted() -> tuple[int, int]:
        status = await decode.status()
        return status.depth, status.tokens

    async def until_counted(want: tuple[int, int]) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(20):
                while await counted() != want:
                    await asyncio.sleep(0.05)
        assert await counted() == want, "the leaked counter was never reconciled"

    try:
        assert await decode.offer(_job(1, 100), limits) and await decode.offer(_job(2, 100), limits)
        assert await decode._add(1, 500, None)  # the dying worker's compare-and-set; no publish
        assert await counted() == (3, 700)
        assert not await decode.offer(_job(3, 100), limits)  # the leak takes a place
        await holder.status()  # the holder uses the queue: its loop runs
        await until_counted((2, 200))
        assert holder.repairs >= 1
        await holder.close()  # by hand from here on
        assert await decode.offer(_job(3, 100), limits)  # the place is back
        delivery = await prefill.pull(5.0)  # a consumer exists from here on
        assert delivery is not None and delivery.job.job_id == "job1"
        await delivery.ack()
        assert await counted() == (2, 200)
        assert await decode._add(2, 50, None)  # two leaked at once
        assert not await prefill.reconcile()  # one round: maybe puts on their way
        assert await prefill.reconcile()  # two: a leak
        assert await counted() == (2, 200) and prefill.repairs == 1
        assert not await decode.reconcile() and not await decode.reconcile()  # nothing left to repair
        # the jobs are all there and the counter follows them to 0
        for want in ("job2", "job3"):
            d = await prefill.pull(5.0)
            assert d is not None and d.job.job_id == want
            await d.ack()
        assert await counted() == (0, 0)
    finally:
        for q in queues:
            await q.close()
        for nc in conns:
            await nc.close()  # type: ignore[attr-defined]


def test_a_reconcile_round_acts_on_a_difference_seen_twice_in_a_row() -> None:
    from kvmesh.disagg.queue import _confirmed

    assert _confirmed(0, 1) == 0 and _confirmed(1, 0) == 0  # once: maybe a put on its way
    assert _confirmed(1, 1) == 1 and _confirmed(3, 2) == 2 and _confirmed(2, 5) == 2  # the part seen both times
    assert _confirmed(-2, -1) == -1 and _confirmed(-1, 1) == 0 and _confirmed(1, -1) == 0
