"""The prefill worker's loop: pull one job, prefill it into the decode worker's blocks.

For each job (one computation at a time: a prefill runs alone, for a fast TTFT):

1. look up the decode worker's :class:`~kvmesh.protocol.KvEndpoint` (loaded from
   discovery the first time this worker serves that decode worker, then cached);
2. read the prefix-hit blocks from it, compute the rest (``engine.prefill_remote``),
   write the new blocks into the blocks the decode worker allocated;
3. tell it done (or the error, so it falls back to a local prefill at once), ack.

**Pipelined** (``pipeline=True``, the default): once a job's KV is computed, its write
and ``done`` go on in the background while the worker pulls and computes the next
job; the link carries one job's write at a time, in order (a write waits for the one
before it), and at most one write is outstanding when a computation finishes, so the
worker never holds more than two jobs. Unpipelined, step 3 ends before the next pull.

:meth:`PrefillWorker.stop` stops pulling and lets the current job finish its writes:
removing a prefill worker needs nothing else. Adding one needs nothing at all: it
starts pulling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvmesh.disagg.queue import Delivery, PrefillQueue
from kvmesh.disagg.transfer import KvConnector
from kvmesh.engines.base import Engine, KvBlockAccess, LoadReporting, kv_blocks
from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.observability import tracing
from kvmesh.protocol import DisaggStats, KvEndpoint, PrefillJob
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = ["PrefillWorker", "KvMetadataCache"]

log = logging.getLogger(__name__)


class KvMetadataCache:
    """Decode workers' KV endpoints, each loaded once (``lookup``) and kept until a
    transfer to it fails."""

    def __init__(self, lookup: Callable[[int], Awaitable[KvEndpoint | None]]) -> None:
        self._lookup = lookup
        self._cache: dict[int, KvEndpoint] = {}
        self.loads = 0

    async def get(self, worker_id: int) -> KvEndpoint | None:
        endpoint = self._cache.get(worker_id)
        if endpoint is None:
            self.loads += 1
            endpoint = await self._lookup(worker_id)
            if endpoint is not None:
                self._cache[worker_id] = endpoint
        return endpoint

    def forget(self, worker_id: int) -> None:
        self._cache.pop(worker_id, None)


@dataclass(eq=False)
class PrefillWorker:
    """Pulls jobs from ``queue`` and prefills them into decode workers' blocks; see the
    module docstring."""

    engine: Engine
    queue: PrefillQueue
    connector: KvConnector
    metadata: KvMetadataCache
    poll_s: float = 0.5
    pipeline: bool = True
    stats: DisaggStats = field(init=False, default_factory=lambda: DisaggStats(mode="prefill"))
    _writing: asyncio.Task[None] | None = field(init=False, default=None)  # the previous job's write and ack
    _stopping: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = field(init=False, default=None)
    _computing: bool = field(init=False, default=False)
    kv: KvBlockAccess = field(init=False, repr=False)  # the engine's KV block access

    def __post_init__(self) -> None:
        self.kv = kv_blocks(self.engine, "a prefill worker")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="prefill-worker")

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop pulling; wait for the job in hand to finish its writes."""
        self._stopping.set()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=timeout_s)
            if not self._task.done():
                await cancel_and_wait(self._task)
        await self.connector.close()

    @property
    def busy(self) -> bool:
        """Holding a job: computing one, or writing one's KV."""
        return self._computing or (self._writing is not None and not self._writing.done())

    def disagg_stats(self) -> DisaggStats:
        sent = self.connector.stats
        self.stats.kv_bytes_sent = sent.bytes_sent
        self.stats.kv_bytes_received = sent.bytes_received
        self.stats.kv_transfer_s = round(sent.seconds, 6)
        report = self.engine.load_report() if isinstance(self.engine, LoadReporting) else None
        self.stats.active_blocks = report.active_blocks if report is not None else 0
        return self.stats

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                delivery = await self.queue.pull(self.poll_s)
            except KvmeshError as exc:
                log.warning("pulling from the prefill queue failed: %s", exc)
                await asyncio.sleep(self.poll_s)
                continue
            if delivery is None:
                continue
            self._computing = True
            try:
                await self._serve_delivery(delivery)
            finally:
                self._computing = False
        await self._flush()

    async def _serve_delivery(self, delivery: Delivery) -> None:
        try:
            finish = await self.compute(delivery.job)
        except Exception:  # noqa: BLE001 - one job must not end the loop
            self.stats.prefill_jobs_failed += 1
            log.exception("prefill job %s failed", delivery.job.job_id)
            await _quietly(delivery.ack())
            return
        previous = self._writing
        self._writing = asyncio.get_running_loop().create_task(self._deliver(previous, finish, delivery))
        if not self.pipeline:
            await self._flush()

    async def _deliver(
        self, previous: asyncio.Task[None] | None, finish: Callable[[], Awaitable[bool]] | None, delivery: Delivery
    ) -> None:
        """Wait for the previous job's write (one at a time, in order), then this one's."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        try:
            if finish is not None and await finish():
                self.stats.prefill_jobs_done += 1
        except Exception:  # noqa: BLE001 - one job must not end the loop
            self.stats.prefill_jobs_failed += 1
            log.exception("prefill job %s failed", delivery.job.job_id)
        finally:
            await _quietly(delivery.ack())

    async def _flush(self) -> None:
        """Wait for the outstanding write (stop, unpipelined mode)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            await asyncio.gather(writing, return_exceptions=True)

    async def serve(self, job: PrefillJob) -> bool:
        """Run one job to the end; True when its KV reached the decode worker."""
        finish = await self.compute(job)
        if finish is None:
            return False
        if await finish():
            self.stats.prefill_jobs_done += 1
            return True
        return False

    async def compute(self, job: PrefillJob) -> Callable[[], Awaitable[bool]] | None:
        """Read the prefix and compute the job's KV; returns what writes it to the
        decode worker and tells it done (True when the KV got there), or None when the
        job failed already (counted; the decode worker told where it can be)."""
        try:
            peer = await self.metadata.get(job.worker_id)
        except KvmeshError as exc:
            # discovery out of reach (an etcd outage): give the job up; the decode
            # worker prefills locally when its remote-prefill timeout passes
            self.stats.prefill_jobs_failed += 1
            log.warning("prefill job %s: decode worker %x's KV endpoint unknown: %s", job.job_id, job.worker_id, exc.message)
            return None
        if peer is None:  # the decode worker is gone: nothing to fill
            self.stats.prefill_jobs_failed += 1
            log.info("prefill job %s: decode worker %x not found", job.job_id, job.worker_id)
            return None
        tracing.set_log_trace_id(tracing.trace_id_of(job.request.trace_context))
        span = tracing.GenerateSpan.start(job.request, "prefill") if tracing.enabled() else None
        try:
            write = await self._compute(peer, job)
        except KvmeshError as exc:
            await self._failed(peer, job, span, exc)
            return None

        async def finish() -> bool:
            try:
                await write(span)
            except KvmeshError as exc:
                await self._failed(peer, job, span, exc)
                return False
            return True

        return finish

    async def _failed(self, peer: KvEndpoint, job: PrefillJob, span: tracing.GenerateSpan | None, exc: KvmeshError) -> None:
        self.stats.prefill_jobs_failed += 1
        self.metadata.forget(job.worker_id)
        log.info("prefill job %s failed: %s", job.job_id, exc.message)
        if span is not None:
            span.failed(exc.kind, exc.message)
            span.end(False)
        await _quietly(self.connector.done(peer, job.job_id, 0, exc.message))

    async def _compute(self, peer: KvEndpoint, job: PrefillJob) -> Callable[[tracing.GenerateSpan | None], Awaitable[None]]:
        """The compute half of a job; returns its write half."""
        layout = self.kv.kv_layout()
        if layout is None:
            raise InvalidArgument(f"{type(self.engine).__name__} is not started: no KV layout")
        bs = peer.layout.block_size
        first, last = job.cached_tokens // bs, -(-job.upto // bs)
        started, waited = time.perf_counter(), (time.time() - job.enqueued_at if job.enqueued_at else 0.0)
        prefix = await self.connector.read(peer, job.job_id, job.block_ids[:first], layout)
        data = await self.kv.prefill_remote(job.request, prefix, job.cached_tokens, job.upto)
        computed = time.perf_counter()

        async def write(span: tracing.GenerateSpan | None) -> None:
            await self.connector.write(peer, job.job_id, job.block_ids[first:last], data, layout)
            link = ""
            if span is not None:  # tracing: queue wait, compute, KV transfer
                s = span.span
                s.set_attribute("queue_wait_ms", max(0.0, waited * 1000.0))
                s.set_attribute("prefill_ms", (computed - started) * 1000.0)
                s.set_attribute("kv_transfer_bytes", _real_bytes_of(peer, last - first, len(data)))
                s.set_attribute("kv_transfer_ms", (time.perf_counter() - computed) * 1000.0)
                s.set_attribute("cached_tokens", job.cached_tokens)
                span.finish_reason = "stop"
                span.output_tokens = 0
                link = tracing.span_link(s)
                span.end(False)
            await self.connector.done(peer, job.job_id, job.upto, trace_link=link)

        return write


def _real_bytes_of(peer: KvEndpoint, blocks: int, wire: int) -> int:
    """The bytes a transfer stands for (the mocker sends digests: the layout's real size)."""
    return max(wire, blocks * peer.layout.bytes_per_block)


async def _quietly(op: Awaitable[None]) -> None:
    try:
        await op
    except Exception as exc:  # noqa: BLE001 - best effort (peer or queue gone)
        log.debug("ignored: %s", exc)
