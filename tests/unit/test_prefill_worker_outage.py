"""A prefill worker's loop through a discovery outage: a job whose decode worker
cannot be looked up (etcd unreachable) is given up (the decode worker prefills
locally after its timeout) and the loop goes on pulling."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.disagg.prefill import KvMetadataCache, PrefillWorker
from kvmesh.disagg.queue import LocalPrefillQueue
from kvmesh.disagg.transfer import TcpKvConnector
from kvmesh.engines.mocker.engine import MockerEngine
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.errors import CannotConnect
from kvmesh.protocol import PrefillJob, PreprocessedRequest

pytestmark = pytest.mark.timeout(20)


def _job(n: int) -> PrefillJob:
    request = PreprocessedRequest(request_id=f"r{n}", model="m", token_ids=[5, 6, 7], eos_token_ids=[2])
    return PrefillJob(f"job{n}", worker_id=7, request=request, block_ids=[1], cached_tokens=0, upto=3)


async def test_lookup_failing_while_etcd_is_down_does_not_end_the_loop() -> None:
    etcd_down = True
    lookups = 0

    async def lookup(worker_id: int):  # type: ignore[no-untyped-def]
        nonlocal lookups
        lookups += 1
        if etcd_down:
            raise CannotConnect("etcd unreachable")
        return None  # etcd back: that decode worker has gone meanwhile

    queue = LocalPrefillQueue()
    engine = MockerEngine(MockerOptions(speedup=1e9))  # never reached: no decode worker is found
    worker = PrefillWorker(engine, queue, TcpKvConnector(), KvMetadataCache(lookup), poll_s=0.02)
    worker.start()
    try:
        await queue.put(_job(1))
        async with asyncio.timeout(5):
            while worker.stats.prefill_jobs_failed < 1:
                await asyncio.sleep(0.01)
        etcd_down = False
        await queue.put(_job(2))
        async with asyncio.timeout(5):
            while worker.stats.prefill_jobs_failed < 2:
                await asyncio.sleep(0.01)
        assert lookups == 2
        assert worker._task is not None and not worker._task.done()
    finally:
        await worker.stop(1)
