"""Disaggregation in one process over real loopback TCP: mocker engines behind
DisaggEngine, an in-process prefill queue, prefill workers, the TCP KV connector."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvmesh.disagg.engine import DisaggEngine
from kvmesh.disagg.prefill import KvMetadataCache, PrefillWorker
from kvmesh.disagg.queue import LocalPrefillQueue
from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector, block_runs
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.errors import EngineShutdown
from kvmesh.health.migration import resume_request
from kvmesh.protocol import DisaggThresholds, OutputChunk, PrefillJob, PreprocessedRequest, StopConditions
from kvmesh.runtime.context import Context

SPEEDUP = 200.0


def options(worker_id: int, **kw: object) -> MockerOptions:
    base = dict(worker_id=worker_id, speedup=SPEEDUP, num_blocks=1024, eos_token_ids=(2,), vocab_size=2048)
    base.update(kw)
    return MockerOptions(**base)  # type: ignore[arg-type]


def request(rid: str, prompt_len: int, max_tokens: int = 12, salt: int = 0) -> PreprocessedRequest:
    tokens = [(i * 7 + salt) % 1900 + 10 for i in range(prompt_len)]
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=tokens, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True)
    )


async def collect(stream: AsyncIterator[OutputChunk], ends: str = "length") -> list[int]:
    out: list[int] = []
    async for chunk in stream:
        out += chunk.token_ids
        assert chunk.finish_reason in (None, ends), chunk
    return out


class Cluster:
    """1 decode worker, N prefill workers, one in-process queue."""

    def __init__(self, prefill_workers: int, thresholds: DisaggThresholds, **decode_kw: object) -> None:
        self.queue = LocalPrefillQueue(thresholds)
        inner = MockerEngine(options(1, **decode_kw))
        self.decode = DisaggEngine(
            inner,
            worker_id=1,
            transfer=KvTransferServer(inner),
            connector=TcpKvConnector(),
            mode="decode",
            queue=self.queue,
            remote_timeout_s=10.0,
            thresholds_refresh_s=0.0,  # ask the queue for its thresholds every time
        )
        self.prefill_engines = [MockerEngine(options(10 + i)) for i in range(prefill_workers)]
        self.prefill: list[PrefillWorker] = []

    async def start(self) -> None:
        await self.decode.start()
        endpoint = self.decode.kv_endpoint

        async def lookup(worker_id: int):  # type: ignore[no-untyped-def]
            return endpoint if worker_id == 1 else None

        for engine in self.prefill_engines:
            await engine.start()
            worker = PrefillWorker(engine, self.queue, TcpKvConnector(), KvMetadataCache(lookup), poll_s=0.05)
            worker.start()
            self.prefill.append(worker)

    async def close(self) -> None:
        for worker in self.prefill:
            await worker.stop()
        for engine in self.prefill_engines:
            await engine.cleanup()
        await self.decode.cleanup()


@contextlib.asynccontextmanager
async def cluster(prefill_workers: int = 2, **kw: object) -> AsyncIterator[Cluster]:
    thresholds = kw.pop("thresholds", DisaggThresholds(max_local_prefill_length=100, max_prefill_queue_size=2))
    c = Cluster(prefill_workers, thresholds, **kw)  # type: ignore[arg-type]
    await c.start()
    try:
        yield c
    finally:
        await c.close()


async def aggregated_tokens(req: PreprocessedRequest) -> list[int]:
    engine = MockerEngine(options(99))
    await engine.start()
    try:
        return await collect(engine.generate(req, Context(req.request_id)))
    finally:
        await engine.cleanup()


def test_block_runs() -> None:
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert block_runs([]) == []


async def test_long_prompts_go_remote_short_stay_local_same_tokens() -> None:
    long_req, short_req = request("long", 700), request("short", 40, salt=3)
    async with cluster() as c:
        got_long = await collect(c.decode.generate(long_req, Context("long")))
        got_short = await collect(c.decode.generate(short_req, Context("short")))
        stats = c.decode.disagg_stats()
        assert (stats.remote_prefills, stats.local_prefills) == (1, 1)
        assert sum(w.stats.prefill_jobs_done for w in c.prefill) == 1
        assert stats.kv_bytes_received > 0 and stats.active_blocks == 0
    assert got_long == await aggregated_tokens(long_req)
    assert got_short == await aggregated_tokens(short_req)


async def test_prefix_hit_is_read_from_the_decode_worker() -> None:
    first = request("a", 400)
    second = msgspec.structs.replace(request("b", 400), token_ids=first.token_ids[:320] + request("x", 400, salt=5).token_ids[:300])
    async with cluster(prefill_workers=1) as c:
        await collect(c.decode.generate(first, Context("a")))
        got = await collect(c.decode.generate(second, Context("b")))
        assert c.decode.stats.remote_prefills == 2
        # the second job read 20 cached blocks (320 tokens) before writing the rest
        assert c.prefill[0].connector.stats.bytes_received == 20 * 16 * 4096
    assert got == await aggregated_tokens(second)


async def test_full_queue_forces_local_prefill() -> None:
    async with cluster(prefill_workers=0) as c:
        for i in range(2):  # two jobs nobody pulls: the queue is at its limit
            await c.queue.put(PrefillJob(f"stuck{i}", 1, request(f"s{i}", 10), [], 0, 5))
        req = request("long", 700)
        got = await collect(c.decode.generate(req, Context("long")))
        assert c.decode.stats.local_by_queue == 1 and c.decode.stats.remote_prefills == 0
    assert got == await aggregated_tokens(req)


async def test_thresholds_follow_the_queue() -> None:
    async with cluster() as c:
        c.queue.thresholds = DisaggThresholds(max_local_prefill_length=5000, max_prefill_queue_size=2)
        await collect(c.decode.generate(request("long", 700), Context("long")))
        assert c.decode.stats.remote_prefills == 0  # 700 < 5000 now: local
        c.queue.thresholds = DisaggThresholds(max_local_prefill_length=10, max_prefill_queue_size=2)
        await collect(c.decode.generate(request("long2", 700, salt=1), Context("long2")))
        assert c.decode.stats.remote_prefills == 1


async def test_cancel_during_transfer_frees_blocks_on_both_sides() -> None:
    # a slow link to the decode worker: writing 44 blocks of 64 KiB at 7 kB/s × speedup 200 takes 2 s
    async with cluster(prefill_workers=1, kv_bandwidth=7e3) as c:
        baseline = (c.decode.inner.active_blocks, c.prefill_engines[0].active_blocks)
        ctx = Context("cancel-me")
        task = asyncio.ensure_future(collect(c.decode.generate(request("cancel-me", 700), ctx), ends="cancelled"))
        for _ in range(200):  # until the prefill worker has the job (its blocks are held)
            await asyncio.sleep(0.01)
            if c.prefill[0].busy:
                break
        assert c.prefill[0].busy
        assert c.decode.inner.active_blocks > baseline[0]
        ctx.stop_generating()
        assert await task == []
        for _ in range(1000):
            await asyncio.sleep(0.01)
            if not c.prefill[0].busy:
                break
        assert (c.decode.inner.active_blocks, c.prefill_engines[0].active_blocks) == baseline
        assert c.decode.transfer.pending == 0
        assert c.prefill[0].stats.prefill_jobs_failed == 1  # its write was refused


async def test_drain_hands_off_requests_with_their_kv() -> None:
    engines = [MockerEngine(options(i, speedup=20.0)) for i in (1, 2)]
    workers = [
        DisaggEngine(e, worker_id=i + 1, transfer=KvTransferServer(e), connector=TcpKvConnector())
        for i, e in enumerate(engines)
    ]
    for w in workers:
        await w.start()
    req = request("mig", 300, max_tokens=40)
    try:
        got: list[int] = []
        handoff = None
        stream = workers[0].generate(req, Context("mig"))
        with pytest.raises(EngineShutdown):
            async for chunk in stream:
                got += chunk.token_ids
                if chunk.disaggregated_params is not None:
                    handoff = chunk.disaggregated_params
                if len(got) >= 10 and not workers[0]._handoffs and handoff is None:
                    assert workers[0].hand_off_all() == 1
        assert handoff is not None and handoff.kind == "kv_source"
        assert handoff.num_tokens == 300 + len(got) - 1
        resumed = msgspec.structs.replace(resume_request(req, got), disaggregated_params=handoff)
        rest = await collect(workers[1].generate(resumed, Context("mig")))
        assert workers[1].stats.kv_migrations_in == 1 and workers[1].stats.kv_migration_fallbacks == 0
        await workers[0].wait_handoffs(timeout_s=5)
        assert engines[0].active_blocks == 0
        assert got + rest == await aggregated_tokens(req)
    finally:
        for w in workers:
            await w.cleanup()


async def test_a_plain_aggregated_worker_builds_its_front_when_kv_arrives() -> None:
    """An aggregated worker without --drain-migrate/--peer-fetch starts without the
    disaggregation stack (worker/disagg.OnDemandFront); a request handed to it with its
    KV builds the front and imports the KV, as a front built at start would."""
    from kvmesh.config import WorkerConfig
    from kvmesh.worker.disagg import OnDemandFront, wire

    engines = [MockerEngine(options(i, speedup=20.0)) for i in (1, 2)]
    sender = DisaggEngine(engines[0], worker_id=1, transfer=KvTransferServer(engines[0]), connector=TcpKvConnector())
    receiver = (await wire(WorkerConfig(), engines[1], 2)).disagg
    assert isinstance(receiver, OnDemandFront)
    await sender.start()
    await engines[1].start()
    await receiver.open()
    req = request("mig", 300, max_tokens=40)
    try:
        got: list[int] = []
        handoff = None
        with pytest.raises(EngineShutdown):
            async for chunk in sender.generate(req, Context("mig")):
                got += chunk.token_ids
                if chunk.disaggregated_params is not None:
                    handoff = chunk.disaggregated_params
                if len(got) >= 10 and not sender._handoffs and handoff is None:
                    assert sender.hand_off_all() == 1
        assert handoff is not None and receiver.front is None
        resumed = msgspec.structs.replace(resume_request(req, got), disaggregated_params=handoff)
        rest = await collect(receiver.generate(resumed, Context("mig")))
        stats = receiver.disagg_stats()
        assert receiver.front is not None and stats.kv_migrations_in == 1 and stats.kv_migration_fallbacks == 0
        assert got + rest == await aggregated_tokens(req)
    finally:
        await sender.cleanup()
        await engines[1].cleanup()
        await receiver.close()
