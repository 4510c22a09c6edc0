"""``DisaggEngine``: what a worker puts in front of its engine's ``generate`` when its KV
can come from, or go to, elsewhere.

For any engine with KV block access (:class:`~kvmesh.engines.base.KvBlockAccess`; the
constructor refuses another with :class:`~kvmesh.errors.InvalidArgument`), a
:class:`~kvmesh.engines.base.GenerateFront` that adds, before the engine's ``generate``:

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
* **a prefix from a peer** (any mode but ``prefill``; issue 33): a request whose routing
  hints carry :class:`~kvmesh.protocol.PeerPrefix` (the router saw another worker
  holding more of its prefix, and reading it costs less than prefilling it:
  :mod:`kvmesh.router.peer`) gets those blocks read from that worker's KV-transfer
  server (``prefix``) and adopted into its prefix cache before it is admitted. Fewer
  blocks found (evicted meanwhile), a failed or slow read, blocks holding other
  tokens: the rest is prefilled here, nothing lost.
* **hand-off, sending side** (:meth:`hand_off`; on drain, and when the frontend's
  health checks eject this worker while it still answers: the worker's ``handoff``
  endpoint): every in-flight request is detached with its blocks kept, premium first
  (:func:`~kvmesh.health.migration.handoff_order`); its stream ends with one chunk
  carrying the ``kv_source`` and a migratable :class:`~kvmesh.errors.EngineShutdown`,
  so the frontend resumes it on another worker, which pulls the KV.

Everything else (load reports, KV dumps and events, faults, batch tuning) the worker
asks of the engine itself: this class forwards nothing. ``open``/``drain``/``close``
are the front's lifecycle around the engine's; ``start``/``cleanup`` run both, for
using it alone (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.disagg.policy import needs_queue_check, place_prefill
from kvmesh.disagg.queue import PrefillQueue
from kvmesh.disagg.transfer import KvConnector, KvTransferServer, TransferStats
from kvmesh.engines.base import Engine, LoadReporting, kv_blocks
from kvmesh.errors import EngineShutdown, KvmeshError
from kvmesh.health.migration import HandedOff, HandOffReport, handoff_order
from kvmesh.observability import tracing
from kvmesh.protocol import (
    DisaggregatedParams,
    DisaggStats,
    DisaggThresholds,
    EngineConfig,
    KvEndpoint,
    KvLayout,
    KvReservation,
    OutputChunk,
    PeerPrefix,
    PrefillJob,
    PreprocessedRequest,
    QueueStatus,
)
from kvmesh.runtime.context import Context

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["DisaggEngine", "MODES"]

log = logging.getLogger(__name__)

MODES = ("aggregated", "prefill", "decode")


class DisaggEngine:
    def __init__(
        self,
        inner: Engine,
        *,
        worker_id: int,
        transfer: KvTransferServer | None,
        connector: KvConnector,
        mode: str = "aggregated",
        queue: PrefillQueue | None = None,
        thresholds: DisaggThresholds | None = None,
        remote_timeout_s: float = 30.0,
        thresholds_refresh_s: float = 1.0,
        peer_fetch_timeout_s: float = 10.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.kv = kv_blocks(inner, f"the disaggregation front of a {mode} worker (remote prefill, KV migration)")
        if mode == "decode" and queue is None:
            raise ValueError("a decode worker needs a prefill queue")
        if mode == "decode" and transfer is None:
            raise ValueError("a decode worker needs a KV-transfer server (prefill workers write into it)")
        self.inner = inner
        self.supports_guided = inner.supports_guided
        self.worker_id = worker_id
        self.transfer = transfer  # None: KV comes in (migrations), never goes out, no port
        self.connector = connector
        self.mode = mode
        self.queue = queue if mode == "decode" else None
        self.thresholds = thresholds if thresholds is not None else DisaggThresholds()
        self.remote_timeout_s = remote_timeout_s
        self.thresholds_refresh_s = thresholds_refresh_s
        self.peer_fetch_timeout_s = peer_fetch_timeout_s
        self._thresholds_at = -1e9  # when the queue last said what the thresholds are
        self.stats = DisaggStats(mode=mode)
        self._live: dict[str, str | None] = {}  # in-flight request id -> its priority
        self._handoffs: dict[str, DisaggregatedParams] = {}
        self._offers: dict[str, asyncio.Future[tuple[int, str]]] = {}
        self._done: dict[str, asyncio.Future[tuple[int, str]]] = {}  # remote prefills put, not yet awaited

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """After the engine started: serve its KV blocks to other workers (if it does)."""
        if self.transfer is not None:
            await self.transfer.start()

    async def drain(self) -> None:
        """Before the engine drains: let the new workers pull the handed-off KV."""
        await self.wait_handoffs()

    async def close(self) -> None:
        """After the engine's cleanup."""
        if self.transfer is not None:
            await self.transfer.close()
        await self.connector.close()
        if self.queue is not None:
            await self.queue.close()

    async def start(self) -> EngineConfig:
        """The engine, then the front (used alone; a worker starts its engine itself)."""
        config = await self.inner.start()
        await self.open()
        return config

    async def cleanup(self) -> None:
        """The engine's cleanup, then the front's (used alone)."""
        try:
            await self.inner.cleanup()
        finally:
            await self.close()

    @property
    def kv_endpoint(self) -> KvEndpoint | None:
        return self.transfer.endpoint() if self.transfer is not None else None

    def disagg_stats(self) -> DisaggStats:
        stats = self.stats
        sent = self.connector.stats
        received = self.transfer.stats if self.transfer is not None else TransferStats()
        stats.kv_bytes_sent = sent.bytes_sent + received.bytes_sent
        stats.kv_bytes_received = sent.bytes_received + received.bytes_received
        stats.kv_transfer_s = round(sent.seconds, 6)
        stats.peer_prefixes_served = self.transfer.prefixes_served if self.transfer is not None else 0
        report = self.inner.load_report() if isinstance(self.inner, LoadReporting) else None
        stats.active_blocks = report.active_blocks if report is not None else 0
        return stats

    # ------------------------------------------------------------------ requests

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        rid = request.request_id
        params = request.disaggregated_params
        peer = request.routing.peer if request.routing is not None else None
        fetched = 0  # prompt tokens read from a peer: the usage counts them as cached
        if params is not None and params.kind == "kv_source":
            await self._import_migrated(request, params)
        elif peer is not None and (fetched := await self._fetch_peer_prefix(request, peer)):
            pass  # the prefix is here now: the rest is a short local prefill
        elif self.queue is not None and not await self._prefill(request, ctx):
            yield OutputChunk.cancelled()
            return
        self._live[rid] = request.routing.priority if request.routing is not None else None
        try:
            async for chunk in self.inner.generate(request, ctx):
                if chunk.finish_reason == "cancelled" and rid in self._handoffs:
                    yield OutputChunk(disaggregated_params=self._handoffs.pop(rid))
                    raise EngineShutdown("the worker is draining: request handed off with its KV")
                if fetched and chunk.usage is not None:
                    chunk.usage.cached_tokens = max(chunk.usage.cached_tokens, fetched)
                yield chunk
        finally:
            self._live.pop(rid, None)

    # ------------------------------------------------------------------ remote prefill (decode mode)

    async def _prefill(self, request: PreprocessedRequest, ctx: Context) -> bool:
        """Prefill remotely if the policy says so; False if the request was cancelled."""
        reservation = self.kv.kv_reserve(request)
        if reservation is None:  # no room to hold the blocks now: the scheduler queues it
            self.stats.local_prefills += 1
            return True
        try:
            return await self._place(request, reservation, ctx)
        except BaseException:  # cancelled or failed before the stream started: give the blocks back
            self.kv.kv_release(request.request_id)
            raise

    async def _place(self, request: PreprocessedRequest, reservation: KvReservation, ctx: Context) -> bool:
        n, cached = len(request.token_ids), reservation.cached_tokens
        if time.monotonic() - self._thresholds_at >= self.thresholds_refresh_s:
            await self._queue_status()  # a queue that carries thresholds (embedded mode) may have new ones
        job: PrefillJob | None = None
        placement = "local"
        span = None  # tracing: the remote_prefill span (under engine.generate)
        if needs_queue_check(n, cached, self.thresholds):
            status = await self._queue_status()
            limits = status.thresholds or self.thresholds
            placement = place_prefill(n, cached, status.depth, limits, status.tokens)
            if placement == "remote":
                # the queue re-checks the bound atomically as it takes the job: every
                # decode worker racing for the last place sees the others' jobs
                span = _remote_prefill_span(n, cached, status.depth)
                job, refused = await self._enqueue(request, reservation, limits, span)
                if refused:
                    placement = "local_queue_full"
        if job is None:
            if span is not None:
                span.set_attribute("outcome", "queue_refused")
                span.end()
            self.kv.kv_release(request.request_id)
            self.stats.local_prefills += 1
            self.stats.local_by_queue += placement == "local_queue_full"
            return True
        if span is None:
            return await self._await_remote(request, job, ctx)
        started = time.perf_counter()
        try:
            return await self._await_remote(request, job, ctx)
        finally:
            _end_remote_prefill(span, started, self._server().trace_links.pop(job.job_id, None))

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
        self.stats.queue_tokens = status.tokens
        return status

    async def _enqueue(
        self, request: PreprocessedRequest, res: KvReservation, limits: DisaggThresholds, span: Span | None = None
    ) -> tuple[PrefillJob | None, bool]:
        """Offer the job to the queue, expecting its transfer: (the job, False) when
        queued, (None, True) when the queue is full, (None, False) when it failed."""
        assert self.queue is not None
        bs = self._layout().block_size
        upto = len(request.token_ids) - 1  # the last prompt token is computed here, to sample from
        first, last = res.cached_tokens // bs, -(-upto // bs)
        plain = _plain(request)
        if span is not None:  # the prefill worker's span continues this one
            plain = msgspec.structs.replace(plain, trace_context=tracing.span_traceparent(span))
        job = PrefillJob(
            uuid.uuid4().hex, self.worker_id, plain, res.block_ids, res.cached_tokens, upto, enqueued_at=time.time()
        )
        self._done[job.job_id] = self._server().expect(job.job_id, res.block_ids[:first], res.block_ids[first:last])
        try:
            accepted = await self.queue.offer(job, limits)
        except Exception as exc:  # noqa: BLE001 - any backend's error: prefill locally
            log.warning("prefill queue refused a job (%r); prefilling locally", exc)
            accepted = None
        if not accepted:
            self._server().forget(job.job_id)
            del self._done[job.job_id]
            self.stats.remote_fallbacks += accepted is None
            return None, accepted is False
        return job, False

    async def _await_remote(self, request: PreprocessedRequest, job: PrefillJob, ctx: Context) -> bool:
        done = self._done.pop(job.job_id)
        try:
            outcome = await _wait_done(done, ctx, self.remote_timeout_s)
        finally:
            self._server().forget(job.job_id)
        if outcome == "cancelled":
            self.kv.kv_release(request.request_id)
            return False
        if not outcome:
            try:
                self.kv.kv_commit(request.request_id, job.upto)
                self.stats.remote_prefills += 1
                return True
            except KvmeshError as exc:
                outcome = exc.message
        log.warning("remote prefill of %s failed (%s); prefilling locally", request.request_id, outcome)
        self.kv.kv_release(request.request_id)
        self.stats.remote_fallbacks += 1
        self.stats.local_prefills += 1
        return True

    def _server(self) -> KvTransferServer:
        if self.transfer is None:  # checked in __init__ for decode workers, the only users
            raise EngineShutdown("this worker has no KV-transfer server")
        return self.transfer

    def _layout(self) -> KvLayout:
        layout = self.kv.kv_layout()
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
        res = self.kv.kv_reserve(request)
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
                self.kv.kv_import(res.block_ids[first:last], data)
                self.kv.kv_commit(request.request_id, computed)
            self.stats.kv_migrations_in += 1
            await self._release_source(peer, src, "")
        except KvmeshError as exc:
            log.warning("KV migration of %s failed (%s); re-prefilling", request.request_id, exc.message)
            self.kv.kv_release(request.request_id)
            self.stats.kv_migration_fallbacks += 1
            await self._release_source(peer, src, exc.message)

    async def _release_source(self, peer: KvEndpoint, src: DisaggregatedParams, error: str) -> None:
        try:
            await self.connector.done(peer, src.transfer_id, src.num_tokens, error)
        except KvmeshError as exc:  # the source is gone already: nothing to release
            log.info("could not tell %s the migration is over: %s", peer.address, exc.message)

    # ------------------------------------------------------------------ a prefix from a peer

    async def _fetch_peer_prefix(self, request: PreprocessedRequest, peer: PeerPrefix) -> int:
        """Read the prompt's leading blocks that ``peer`` holds and this engine lacks,
        and commit them: the prompt tokens now computed (0 when nothing was adopted:
        the request prefills)."""
        layout = self._layout()
        bs = layout.block_size
        want = min(peer.blocks, (len(request.token_ids) - 1) // bs)
        if want < 1 or peer.kv.layout.block_size != bs:
            return 0
        res = self.kv.kv_reserve(request)
        if res is None:  # no room to hold them now: the scheduler queues it
            self.stats.peer_fetch_fallbacks += 1
            return 0
        first = res.cached_tokens // bs
        if first >= want:  # it holds them itself now
            self.kv.kv_release(request.request_id)
            return 0
        try:
            got = await self._read_peer(request, peer, res, first, want)
        except BaseException:
            self.kv.kv_release(request.request_id)
            raise
        if got < want:
            self.stats.peer_fetch_fallbacks += 1
        if got <= first:
            self.kv.kv_release(request.request_id)
            return 0
        self.stats.peer_fetches += 1
        self.stats.peer_fetch_blocks += got - first
        return got * bs

    async def _read_peer(
        self, request: PreprocessedRequest, peer: PeerPrefix, res: KvReservation, first: int, want: int
    ) -> int:
        """Blocks ``[first, found)`` read and committed: ``found`` (``first`` on failure)."""
        layout = self._layout()
        try:
            reading = self.connector.read_prefix(peer.kv, request, want, layout)
            found, data = await asyncio.wait_for(reading, self.peer_fetch_timeout_s)
            found = min(found, want)
            if found > first:
                wire = layout.wire_bytes_per_block
                self.kv.kv_import(res.block_ids[first:found], data[first * wire : found * wire])
                self.kv.kv_commit(request.request_id, found * layout.block_size)
            return found
        except (KvmeshError, TimeoutError) as exc:
            why = exc.message if isinstance(exc, KvmeshError) else f"no answer within {self.peer_fetch_timeout_s} s"
            log.warning("prefix of %s from worker %x failed (%s); prefilling it", request.request_id, peer.worker_id, why)
            return first

    # ------------------------------------------------------------------ migration, sending side

    def hand_off_all(self) -> int:
        """Detach every in-flight request, keeping its KV readable for the worker that
        resumes it; returns how many were handed off."""
        return len(self.hand_off().moved)

    def hand_off(self) -> HandOffReport:
        """:meth:`hand_off_all`, premium first; what left (in order) and how many
        in-flight requests had no KV to leave with (queued: they stay)."""
        layout = self.kv.kv_layout()
        transfer = self.transfer
        if layout is None or transfer is None:
            return HandOffReport(kept=len(self._live))
        moved: list[HandedOff] = []
        for rid, priority in handoff_order(list(self._live.items()), lambda item: item[1]):
            res = self.kv.kv_detach(rid)
            if res is None:
                continue
            tid = f"migrate-{uuid.uuid4().hex}"
            valid = -(-res.cached_tokens // layout.block_size)
            self._offers[tid] = transfer.offer(tid, res.block_ids[:valid])
            self._offers[tid].add_done_callback(functools.partial(self._release_after_offer, rid))
            self._handoffs[rid] = DisaggregatedParams(
                kind="kv_source",
                worker_id=self.worker_id,
                block_ids=res.block_ids[:valid],
                num_tokens=res.cached_tokens,
                address=transfer.address,
                transfer_id=tid,
                layout=layout,
            )
            moved.append(HandedOff(rid, priority or "standard", res.num_tokens))
        self.stats.kv_migrations_out += len(moved)
        return HandOffReport(moved[:4096], kept=len(self._live) - len(moved))

    def _release_after_offer(self, request_id: str, _offer: asyncio.Future[tuple[int, str]]) -> None:
        self.kv.kv_release(request_id)

    async def wait_handoffs(self, timeout_s: float = 10.0) -> None:
        """Wait until the new workers pulled the handed-off KV (or ``timeout_s``)."""
        offers, self._offers = self._offers, {}
        if offers:
            await asyncio.wait(list(offers.values()), timeout=timeout_s)
        if self.transfer is not None:
            for tid in offers:
                self.transfer.forget(tid)  # releases the blocks of any still unclaimed


def _remote_prefill_span(prompt_tokens: int, cached: int, depth: int) -> Span | None:
    """A ``remote_prefill`` span under this request's ``engine.generate`` (tracing on)."""
    parent = tracing.current_generate()
    if parent is None:
        return None
    attributes = {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "queue_depth": depth}
    return tracing.start_span("remote_prefill", parent.span, "producer", attributes)


def _end_remote_prefill(span: Span, started: float, link: str | None) -> None:
    """Wait time, and the link from engine.generate to the prefill worker's span."""
    span.set_attribute("wait_ms", (time.perf_counter() - started) * 1000.0)
    span.set_attribute("outcome", "remote" if link else "fallback_or_cancelled")
    parent = tracing.current_generate()
    if parent is not None and link:
        tracing.add_link(parent.span, link)
    span.end()


def _plain(request: PreprocessedRequest) -> PreprocessedRequest:
    """The request as the prefill worker needs it (no routing hints)."""
    import msgspec

    return msgspec.structs.replace(request, routing=None, disaggregated_params=None)


async def _wait_done(done: asyncio.Future[tuple[int, str]], ctx: Context, timeout_s: float) -> str:
    """"" when the prefill worker finished, "cancelled", or why it failed."""
    stop = asyncio.ensure_future(ctx.stopped())
    try:
        waiting: list[asyncio.Future[Any]] = [done, stop]
        finished, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
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
