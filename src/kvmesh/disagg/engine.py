"""``DisaggEngine``: a worker's engine with KV that can come from, or go to, elsewhere.

Wraps any engine that supports KV block access (``kv_layout()`` not None) and adds,
in front of its ``generate``:

* **remote prefill** (mode ``decode``): reserve the prompt's blocks (prefix hits
  reused), ask :func:`~kvmesh.disagg.policy.place_prefill`, and when remote, put a
  :class:`~kvmesh.protocol.PrefillJob` on the global queue and wait for the prefill
  worker's ``done`` (the engine keeps serving other requests meanwhile); then commit
  the written tokens and generate from there. A cancelled request gives its blocks
  back and refuses the transfer; a failed or timed-out remote prefill falls back to
  a local one.
* **KV-carrying migration, receiving side** (any mode): a resumed request whose
  ``disaggregated_params`` name a ``kv_source`` gets its KV read from the draining
  worker instead of recomputed (falls back to recompute on any failure).
* **hand-off on drain, sending side** (:meth:`hand_off_all`): every in-flight
  request is detached with its blocks kept; its stream ends with one chunk carrying
  the ``kv_source`` and a migratable :class:`~kvmesh.errors.EngineShutdown`, so the
  frontend resumes it on another worker, which pulls the KV.

Everything else is the inner engine's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from kvmesh.disagg.policy import needs_queue_check, place_prefill
from kvmesh.disagg.queue import PrefillQueue
from kvmesh.disagg.transfer import KvConnector, KvTransferServer
from kvmesh.engines.base import Engine
from kvmesh.errors import EngineShutdown, KvmeshError
from kvmesh.protocol import (
    DisaggregatedParams,
    DisaggStats,
    DisaggThresholds,
    EngineConfig,
    KvDump,
    KvEndpoint,
    KvEvent,
    KvLayout,
    KvReservation,
    LoadReport,
    OutputChunk,
    PrefillJob,
    PreprocessedRequest,
    QueueStatus,
)
from kvmesh.runtime.context import Context

__all__ = ["DisaggEngine", "MODES"]

log = logging.getLogger(__name__)

MODES = ("aggregated", "prefill", "decode")


class DisaggEngine(Engine):
    def __init__(
        self,
        inner: Engine,
        *,
        worker_id: int,
        transfer: KvTransferServer,
        connector: KvConnector,
        mode: str = "aggregated",
        queue: PrefillQueue | None = None,
        thresholds: DisaggThresholds | None = None,
        remote_timeout_s: float = 30.0,
        thresholds_refresh_s: float = 1.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "decode" and queue is None:
            raise ValueError("a decode worker needs a prefill queue")
        self.inner = inner
        self.supports_guided = inner.supports_guided
        self.worker_id = worker_id
        self.transfer = transfer
        self.connector = connector
        self.mode = mode
        self.queue = queue if mode == "decode" else None
        self.thresholds = thresholds if thresholds is not None else DisaggThresholds()
        self.remote_timeout_s = remote_timeout_s
        self.thresholds_refresh_s = thresholds_refresh_s
        self._thresholds_at = -1e9  # when the queue last said what the thresholds are
        self.stats = DisaggStats(mode=mode)
        self._live: set[str] = set()
        self._handoffs: dict[str, DisaggregatedParams] = {}
        self._offers: dict[str, asyncio.Future[tuple[int, str]]] = {}
        self._decide = asyncio.Lock()
        self._done: dict[str, asyncio.Future[tuple[int, str]]] = {}  # remote prefills put, not yet awaited

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> EngineConfig:
        config = await self.inner.start()
        await self.transfer.start()
        return config

    async def abort(self, ctx: Context) -> None:
        await self.inner.abort(ctx)

    async def drain(self) -> None:
        await self.wait_handoffs()
        await self.inner.drain()

    async def cleanup(self) -> None:
        try:
            await self.inner.cleanup()
        finally:
            await self.transfer.close()
            await self.connector.close()
            if self.queue is not None:
                await self.queue.close()

    @property
    def kv_endpoint(self) -> KvEndpoint | None:
        return self.transfer.endpoint()

    def disagg_stats(self) -> DisaggStats:
        stats = self.stats
        sent, received = self.connector.stats, self.transfer.stats
        stats.kv_bytes_sent = sent.bytes_sent + received.bytes_sent
        stats.kv_bytes_received = sent.bytes_received + received.bytes_received
        stats.kv_transfer_s = round(sent.seconds, 6)
        report = self.inner.load_report()
        stats.active_blocks = report.active_blocks if report is not None else 0
        return stats

    # ------------------------------------------------------------------ requests

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        rid = request.request_id
        params = request.disaggregated_params
        if params is not None and params.kind == "kv_source":
            await self._import_migrated(request, params)
        elif self.queue is not None and not await self._prefill(request, ctx):
            yield OutputChunk.cancelled()
            return
        self._live.add(rid)
        try:
            async for chunk in self.inner.generate(request, ctx):
                if chunk.finish_reason == "cancelled" and rid in self._handoffs:
                    yield OutputChunk(disaggregated_params=self._handoffs.pop(rid))
                    raise EngineShutdown("the worker is draining: request handed off with its KV")
                yield chunk
        finally:
            self._live.discard(rid)

    # ------------------------------------------------------------------ remote prefill (decode mode)

    async def _prefill(self, request: PreprocessedRequest, ctx: Context) -> bool:
        """Prefill remotely if the policy says so; False if the request was cancelled."""
        reservation = self.inner.kv_reserve(request)
        if reservation is None:  # no room to hold the blocks now: the scheduler queues it
            self.stats.local_prefills += 1
            return True
        try:
            return await self._place(request, reservation, ctx)
        except BaseException:  # cancelled or failed before the stream started: give the blocks back
            self.inner.kv_release(request.request_id)
            raise

    async def _place(self, request: PreprocessedRequest, reservation: KvReservation, ctx: Context) -> bool:
        n, cached = len(request.token_ids), reservation.cached_tokens
        if time.monotonic() - self._thresholds_at >= self.thresholds_refresh_s:
            await self._queue_status()  # a queue that carries thresholds (embedded mode) may have new ones
        job: PrefillJob | None = None
        placement = "local"
        if needs_queue_check(n, cached, self.thresholds):
            # decisions take turns, so that concurrent ones see each other's jobs in the depth
            async with self._decide:
                status = await self._queue_status()
                placement = place_prefill(n, cached, status.depth, status.thresholds or self.thresholds)
                if placement == "remote":
                    job = await self._enqueue(request, reservation)
        if job is None:
            self.inner.kv_release(request.request_id)
            self.stats.local_prefills += 1
            self.stats.local_by_queue += placement == "local_queue_full"
            return True
        return await self._await_remote(request, job, ctx)

    async def _queue_status(self) -> QueueStatus:
        assert self.queue is not None
        try:
            status = await self.queue.status()
        except Exception as exc:  # noqa: BLE001 - queue unreachable (any backend's error): prefill here
            log.warning("prefill queue status failed: %r", exc)
            return QueueStatus(depth=1 << 30)
        if status.thresholds is not None:
            self.thresholds = status.thresholds
        self._thresholds_at = time.monotonic()
        self.stats.queue_depth = status.depth
        return status

    async def _enqueue(self, request: PreprocessedRequest, res: KvReservation) -> PrefillJob | None:
        """Put the job on the queue, expecting its transfer; None if the queue refused."""
        assert self.queue is not None
        bs = self._layout().block_size
        upto = len(request.token_ids) - 1  # the last prompt token is computed here, to sample from
        first, last = res.cached_tokens // bs, -(-upto // bs)
        job = PrefillJob(uuid.uuid4().hex, self.worker_id, _plain(request), res.block_ids, res.cached_tokens, upto)
        self._done[job.job_id] = self.transfer.expect(job.job_id, res.block_ids[:first], res.block_ids[first:last])
        try:
            await self.queue.put(job)
        except Exception as exc:  # noqa: BLE001 - any backend's error: prefill locally
            log.warning("prefill queue refused a job (%r); prefilling locally", exc)
            self.transfer.forget(job.job_id)
            del self._done[job.job_id]
            self.stats.remote_fallbacks += 1
            return None
        return job

    async def _await_remote(self, request: PreprocessedRequest, job: PrefillJob, ctx: Context) -> bool:
        done = self._done.pop(job.job_id)
        try:
            outcome = await _wait_done(done, ctx, self.remote_timeout_s)
        finally:
            self.transfer.forget(job.job_id)
        if outcome == "cancelled":
            self.inner.kv_release(request.request_id)
            return False
        if not outcome:
            try:
                self.inner.kv_commit(request.request_id, job.upto)
                self.stats.remote_prefills += 1
                return True
            except KvmeshError as exc:
                outcome = exc.message
        log.warning("remote prefill of %s failed (%s); prefilling locally", request.request_id, outcome)
        self.inner.kv_release(request.request_id)
        self.stats.remote_fallbacks += 1
        self.stats.local_prefills += 1
        return True

    def _layout(self) -> KvLayout:
        layout = self.inner.kv_layout()
        if layout is None:
            raise EngineShutdown(f"{type(self.inner).__name__} lost its KV layout")
        return layout

    # ------------------------------------------------------------------ migration, receiving side

    async def _import_migrated(self, request: PreprocessedRequest, src: DisaggregatedParams) -> None:
        """Pull a handed-off request's KV from its old worker; on any failure the
        request simply re-prefills here."""
        if src.layout is None:
            return
        peer = KvEndpoint(src.address, src.layout)
        res = self.inner.kv_reserve(request)
        if res is None:
            self.stats.kv_migration_fallbacks += 1
            await self._release_source(peer, src, "no KV room on the new worker")
            return
        bs = self._layout().block_size
        computed = min(src.num_tokens, len(request.token_ids) - 1)
        first, last = res.cached_tokens // bs, -(-computed // bs)
        try:
            if computed > res.cached_tokens:
                data = await self.connector.read(peer, src.transfer_id, src.block_ids[first:last], self._layout())
                self.inner.kv_import(res.block_ids[first:last], data)
                self.inner.kv_commit(request.request_id, computed)
            self.stats.kv_migrations_in += 1
            await self._release_source(peer, src, "")
        except KvmeshError as exc:
            log.warning("KV migration of %s failed (%s); re-prefilling", request.request_id, exc.message)
            self.inner.kv_release(request.request_id)
            self.stats.kv_migration_fallbacks += 1
            await self._release_source(peer, src, exc.message)

    async def _release_source(self, peer: KvEndpoint, src: DisaggregatedParams, error: str) -> None:
        try:
            await self.connector.done(peer, src.transfer_id, src.num_tokens, error)
        except KvmeshError as exc:  # the source is gone already: nothing to release
            log.info("could not tell %s the migration is over: %s", peer.address, exc.message)

    # ------------------------------------------------------------------ migration, sending side

    def hand_off_all(self) -> int:
        """Detach every in-flight request, keeping its KV readable for the worker that
        resumes it; returns how many were handed off."""
        layout = self.inner.kv_layout()
        if layout is None:
            return 0
        count = 0
        for rid in list(self._live):
            res = self.inner.kv_detach(rid)
            if res is None:
                continue
            tid = f"migrate-{uuid.uuid4().hex}"
            valid = -(-res.cached_tokens // layout.block_size)
            self._offers[tid] = self.transfer.offer(tid, res.block_ids[:valid])
            self._offers[tid].add_done_callback(lambda _f, rid=rid: self.inner.kv_release(rid))
            self._handoffs[rid] = DisaggregatedParams(
                kind="kv_source",
                worker_id=self.worker_id,
                block_ids=res.block_ids[:valid],
                num_tokens=res.cached_tokens,
                address=self.transfer.address,
                transfer_id=tid,
                layout=layout,
            )
            count += 1
        self.stats.kv_migrations_out += count
        return count

    async def wait_handoffs(self, timeout_s: float = 10.0) -> None:
        """Wait until the new workers pulled the handed-off KV (or ``timeout_s``)."""
        offers, self._offers = self._offers, {}
        if offers:
            await asyncio.wait(list(offers.values()), timeout=timeout_s)
        for tid in offers:
            self.transfer.forget(tid)  # releases the blocks of any still unclaimed

    # ------------------------------------------------------------------ the inner engine's

    def kv_snapshot(self) -> KvDump | None:
        return self.inner.kv_snapshot()

    def set_batch_multiplier(self, multiplier: float) -> None:
        self.inner.set_batch_multiplier(multiplier)

    def load_report(self) -> LoadReport | None:
        return self.inner.load_report()

    def kv_events_since(self, event_id: int) -> list[KvEvent] | None:
        return self.inner.kv_events_since(event_id)

    def kv_layout(self) -> KvLayout | None:
        return self.inner.kv_layout()

    def kv_reserve(self, request: PreprocessedRequest) -> KvReservation | None:
        return self.inner.kv_reserve(request)

    def kv_release(self, request_id: str) -> None:
        self.inner.kv_release(request_id)

    def kv_export(self, block_ids: Sequence[int]) -> bytes:
        return self.inner.kv_export(block_ids)

    def kv_import(self, block_ids: Sequence[int], data: bytes) -> None:
        self.inner.kv_import(block_ids, data)

    def kv_commit(self, request_id: str, computed_tokens: int) -> None:
        self.inner.kv_commit(request_id, computed_tokens)

    async def prefill_remote(
        self, request: PreprocessedRequest, prefix_kv: bytes, cached_tokens: int, upto: int
    ) -> bytes:
        return await self.inner.prefill_remote(request, prefix_kv, cached_tokens, upto)

    def kv_detach(self, request_id: str) -> KvReservation | None:
        return self.inner.kv_detach(request_id)

    def __getattr__(self, name: str) -> object:  # set_fault, fault, scheduler, ... of the inner engine
        return getattr(self.inner, name)


def _plain(request: PreprocessedRequest) -> PreprocessedRequest:
    """The request as the prefill worker needs it (no routing hints)."""
    import msgspec

    return msgspec.structs.replace(request, routing=None, disaggregated_params=None)


async def _wait_done(done: asyncio.Future[tuple[int, str]], ctx: Context, timeout_s: float) -> str:
    """"" when the prefill worker finished, "cancelled", or why it failed."""
    stop = asyncio.ensure_future(ctx.stopped())
    try:
        finished, _ = await asyncio.wait([done, stop], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if stop in finished or ctx.is_stopped():
        return "cancelled"
    if done not in finished:
        return f"no answer within {timeout_s} s"
    if done.cancelled():
        return "transfer forgotten"
    _tokens, error = done.result()
    return error
