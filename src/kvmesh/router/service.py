"""The KV-aware router's async glue for one model: workers' KV events in, routing
decisions out. The decisions themselves are made by the pure
:class:`~kvmesh.router.core.KvRouterCore`.

* Events: one event-plane subscription (one that can ``serve``, zmq's, hands the router
  each envelope as it reads it, 2 per loop turn: :meth:`~kvmesh.runtime.event_plane.memory.Inbox.serve`;
  others are read by a task); each envelope carries a
  :class:`~kvmesh.kv.events.KvEventBatch` (the events of one engine step; a single
  ``KvEvent``, the older form, is a batch of one), decoded once and given to
  ``core.apply_batch``. A gap in a worker's event ids is repaired from the worker's
  event buffer (``kv_events`` endpoint) or, if that no longer reaches back, from a full
  dump (``kv_dump``); the rest of the batch after the gap, and events arriving during
  a repair, are held (up to ``MAX_HELD_EVENTS`` per worker; past that they are dropped
  and the gap they leave is repaired next) and applied after it. A repair that fails
  drops what it held, and the worker's next repair waits ``REPAIR_BACKOFF_S``; so does
  one whose held events still find a gap (a worker's answer that does not close it).
* A new worker's cache is loaded from its dump when it appears; a removed worker's
  blocks are dropped.
* Events are data from the network: each envelope that cannot be decoded, names a
  worker other than its publisher, names no worker of this model, or carries an
  invalid payload (a hash outside u64, too many blocks in an event, too many events,
  over ``MAX_PAYLOAD_BYTES``) is skipped whole and counted (once per envelope) in
  ``kvmesh_router_kv_events_rejected_total{reason}``; the reader never stops on one.
  Bounds are checked before the payload is decoded (its size) or while it is (list
  lengths from their headers), so a hostile envelope cannot make the router allocate
  more than ~10× ``MAX_PAYLOAD_BYTES`` (see :mod:`kvmesh.kv.events`).
  A worker of another model of the same frontend (``fleet``) is not a rejection: its
  envelopes are skipped uncounted (on NATS every model's router hears every worker).
  Reasons: ``malformed``, ``too_large``, ``publisher_mismatch``, ``unknown_worker``,
  ``bad_hash``, ``too_many_blocks``, ``too_many_events``, ``not_applicable``.
* Sharded index (optional, ``index``: a :class:`~kvmesh.router.shards.ShardedKvIndex`):
  the events go to the shard processes instead (no subscription here); workers are
  handed to it as they come and go, and each decision asks it for the overlaps.
* LoRA adapters (:class:`~kvmesh.router.adapters.AdapterAffinity`): which worker holds
  which adapter, from the router's own decisions and the workers' answers; once a
  request has named an adapter, every ``ADAPTER_REFRESH_S`` the workers that take
  adapters are asked for their load report, whose ``adapters`` replace the guess
  (another frontend's requests move adapters too). Nothing is asked in a fleet whose
  requests never named one.
* Admission (optional): when every worker's in-flight prefill tokens are over
  ``threshold`` × its batch token budget, requests wait, leaving in weighted fair
  order across tenants (on tokens, inside each priority tier: :mod:`kvmesh.router.fair`); past
  ``max_queue`` waiting requests, a new one is refused with 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import msgspec

from kvmesh.errors import InvalidArgument, KvmeshError, ResourceExhausted
from kvmesh.kv.events import KvEventView, PayloadTooLarge, decode_kv_view
from kvmesh.kv.hashing import block_hashes as hash_blocks
from kvmesh.kv.hashing import hash_salt
from kvmesh.protocol import KvDump, KvEndpoint, KvEvent, KvEventsSince, LoadReport, PreprocessedRequest, RoutingHints
from kvmesh.router.adapters import AdapterAffinity
from kvmesh.router.core import Decision, KvRouterCore, RouterSettings
from kvmesh.router.fair import FairQueue
from kvmesh.router.indexer import check_event_data
from kvmesh.router.peer import PeerFetchSettings, plan_peer_fetch
from kvmesh.runtime.distributed import call
from kvmesh.runtime.event_plane.base import Subscription
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import KV_DUMP, KV_EVENTS, LOAD

__all__ = ["KvRouterService", "KvPolicy", "AdmissionSettings"]

log = logging.getLogger("kvmesh.router")

# after a failed repair, a worker's next one waits this long (its events meanwhile are dropped)
REPAIR_BACKOFF_S = 1.0
# events held per worker while its repair runs, at most (a busy worker sends ~1,400/s)
MAX_HELD_EVENTS = 16 * 1024
# seconds between two refreshes of the workers' resident adapters (LoadReport.adapters)
ADAPTER_REFRESH_S = 5.0
_decode_load = msgspec.msgpack.Decoder(LoadReport).decode
# envelopes applied before the reader lets the loop run other tasks: a busy mocker's batch
# (one engine step, ~130 events) takes ~0.1 ms to apply, and a decision must not wait for a backlog
_ENVELOPES_PER_TURN = 2
_decode_dump = msgspec.msgpack.Decoder(KvDump).decode
_decode_since = msgspec.msgpack.Decoder(KvEventsSince).decode
_encode = msgspec.msgpack.encode


def _decode_reason(exc: Exception) -> str:
    """The rejection reason of a payload that did not decode: which bound it broke
    (msgspec names the path: ``$[2]`` is a batch's event list), else ``malformed``."""
    text = str(exc)
    if "length <=" in text:
        return "too_many_blocks" if "_hashes`" in text else "too_many_events"
    if ">= 0" in text and "_hashes[" in text:
        return "bad_hash"
    return "malformed"


class AdmissionSettings(msgspec.Struct, frozen=True):
    threshold: float | None = None  # fraction of each worker's max_num_batched_tokens; None = off
    max_queue: int = 1024
    retry_after_s: float = 1.0


class KvRouterService:
    def __init__(
        self,
        settings: RouterSettings,
        subscription: Subscription | None,
        metrics: Any,
        admission: AdmissionSettings | None = None,
        index: Any = None,
        fleet: Container[int] = (),
    ) -> None:
        self.settings = settings
        self.index = index  # a ShardedKvIndex, or None: this core's own index
        # every worker this frontend routes to, of any model: another model's events (one
        # topic on NATS) are skipped without counting them as rejected
        self.fleet = fleet
        self.core = KvRouterCore(settings)
        self.adapters = AdapterAffinity()  # which worker holds which LoRA adapter (adapter requests only)
        self.adapter_refresh_s = ADAPTER_REFRESH_S
        self._refresher: asyncio.Task[None] | None = None  # started by the first adapter request
        self.subscription = subscription
        self.metrics = metrics
        self.admission = admission or AdmissionSettings()
        self.workers: dict[int, Instance] = {}
        self._last_applied: dict[int, int] = {}
        self._repairing: dict[int, list[tuple[int, KvEventView]]] = {}  # worker -> its held (event id, event)
        self._failed_at: dict[int, float] = {}  # worker -> when its last repair failed
        self.repair_backoff_s = REPAIR_BACKOFF_S
        self._replaying: int | None = None  # the worker whose held events are being applied after its repair
        self._waiting: FairQueue[asyncio.Future[None]] = FairQueue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self.rejected_events = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.subscription is not None and self.settings.mode == "kv":
            serve = getattr(self.subscription, "serve", None)
            if serve is not None:  # (zmq) envelopes applied as they are read: no task, no wake-up each
                serve(self._take, _ENVELOPES_PER_TURN)
            else:
                self._reader = asyncio.get_running_loop().create_task(self._read())
            inbox = getattr(self.subscription, "inbox", None)
            if inbox is not None:  # the event backlog, read at scrape time
                self.metrics.event_backlog.set_function(lambda: len(inbox))
                self.metrics.events_dropped.set_function(lambda: inbox.dropped)

    async def close(self) -> None:
        tasks = list(self._tasks) + [t for t in (self._reader, self._refresher) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.subscription is not None:
            await self.subscription.close()
        if self.index is not None:
            await self.index.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ workers
    def add_worker(self, instance: Instance) -> None:
        """Route to ``instance`` from now on; load its warm cache in the background."""
        block_size = instance.info.engine.kv_block_size
        if block_size != self.settings.block_size:
            self.metrics.block_size_mismatch.inc()
            raise InvalidArgument(
                f"worker {instance.worker_id:x} uses KV blocks of {block_size} tokens but the router hashes "
                f"{self.settings.block_size}-token blocks; run all workers of a model with one --block-size"
            )
        self.workers[instance.worker_id] = instance
        self.core.add_worker(instance.worker_id)
        self.adapters.add_worker(instance.worker_id, instance.info.engine.max_adapters)
        if self.index is not None:
            self.index.add_worker(instance)
            self._admit_waiting()
            return
        address = instance.info.event_address
        if self.subscription is not None and address:
            self.subscription.connect(address)
        if self.settings.mode == "kv":
            self._begin_repair(instance.worker_id, full=True)
        self._admit_waiting()

    def remove_worker(self, worker_id: int) -> None:
        instance = self.workers.pop(worker_id, None)
        if instance is None:
            return
        self.core.remove_worker(worker_id)
        self.adapters.remove_worker(worker_id)
        if self.index is not None:
            self.index.remove_worker(worker_id)
        self._last_applied.pop(worker_id, None)
        self._repairing.pop(worker_id, None)
        self._failed_at.pop(worker_id, None)
        if self.subscription is not None and instance.info.event_address:
            self.subscription.disconnect(instance.info.event_address)

    # ------------------------------------------------------------------ events
    async def _read(self) -> None:
        assert self.subscription is not None
        turn = 0
        async for envelope in self.subscription:
            self._take(envelope)
            turn += 1
            if turn == _ENVELOPES_PER_TURN:
                # a backlog must not hold the loop: requests waiting for a decision go first
                turn = 0
                await asyncio.sleep(0)

    def _take(self, envelope: Any) -> None:
        reason = self._on_envelope(envelope)
        if reason is not None:
            self._reject(reason, envelope.publisher_id)

    def _on_envelope(self, envelope: Any) -> str | None:
        """Apply one envelope's events; the reason it was skipped, or None."""
        try:
            batch = decode_kv_view(envelope.payload)  # (a stored event's token hashes are skipped)
        except PayloadTooLarge:
            return "too_large"
        except (ValueError, UnicodeDecodeError) as exc:  # msgspec's DecodeError and ValidationError included
            return _decode_reason(exc)
        worker, events = batch.worker_id, batch.events
        if worker != envelope.publisher_id:
            return "publisher_mismatch"
        if worker not in self.workers:
            return None if worker in self.fleet else "unknown_worker"
        # NOTE: no check of the events here: decoding checked every hash and list length
        try:
            self._on_events(worker, batch.first_event_id, events)
        except (ValueError, TypeError, OverflowError) as exc:  # NOTE: checked above; a last guard
            log.warning("KV events of worker %x not applied: %s", worker, exc)
            return "not_applicable"
        return None

    def _reject(self, reason: str, publisher_id: int) -> None:
        self.rejected_events += 1
        self.metrics.event_rejected(reason)
        if self.rejected_events & (self.rejected_events - 1) == 0:  # 1st, 2nd, 4th, ...: the log stays small
            log.warning("skipping a KV event from publisher %x (%s); %d skipped so far", publisher_id, reason, self.rejected_events)

    def _on_events(self, worker: int, first_id: int, events: list[KvEventView]) -> None:
        held = self._repairing.get(worker)
        if held is not None:
            if len(held) + len(events) <= MAX_HELD_EVENTS:
                held.extend(enumerate(events, first_id))
            # else: dropped; after the repair the next event shows a gap, repaired in turn
            return
        applied, stop = self.core.apply_batch(worker, first_id, events)
        if applied:
            last = self.core.last_event_id(worker)
            if last is not None:
                self._last_applied[worker] = last
            self.metrics.events_applied.inc(applied)
        if stop < len(events):
            self.metrics.event_gaps.inc()
            rest = list(enumerate(events[stop:], first_id + stop))
            self._begin_repair(worker, full=False, held=rest)

    def _apply(self, worker: int, event_id: int, data: KvEventView) -> None:
        status = self.core.apply_one(worker, event_id, data)
        if status == "apply":
            self._last_applied[worker] = event_id
            self.metrics.events_applied.inc()
        elif status == "gap":
            self.metrics.event_gaps.inc()
            self._begin_repair(worker, full=False, held=[(event_id, data)])

    def _begin_repair(self, worker_id: int, full: bool, held: list[tuple[int, KvEventView]] | None = None) -> None:
        if worker_id in self._repairing:
            self._repairing[worker_id].extend(held or ())
            return
        if worker_id == self._replaying:  # the repair just done left the gap open (a worker's bad answer)
            self._failed_at[worker_id] = time.monotonic()
            return
        failed = self._failed_at.get(worker_id)
        if failed is not None and time.monotonic() - failed < self.repair_backoff_s and not full:
            return  # its last repair failed just now: these events wait for the next attempt's repair
        self._repairing[worker_id] = held or []
        self._spawn(self._repair(worker_id, full))

    async def _repair(self, worker_id: int, full: bool) -> None:
        ok = False
        try:
            if not full and await self._repair_from_buffer(worker_id):
                self.metrics.repairs["buffer"].inc()
            else:
                await self._repair_from_dump(worker_id)
                self.metrics.repairs["dump"].inc()
            ok = True
        except KvmeshError as exc:
            log.warning("KV state of worker %x not repaired: %s", worker_id, exc.message)
        except (ValueError, TypeError, OverflowError) as exc:  # a dump with invalid hashes
            log.warning("KV state of worker %x not repaired: invalid dump: %s", worker_id, exc)
        finally:
            held = self._repairing.pop(worker_id, None) or []
            if ok:
                self._failed_at.pop(worker_id, None)
            else:
                # the held events follow a gap that is still there: dropped; the first event
                # after REPAIR_BACKOFF_S starts the next repair (no storm of failing calls)
                self._failed_at[worker_id] = time.monotonic()
                held = []
            if worker_id in self.workers:
                self._replaying = worker_id
                try:
                    for event_id, data in held:
                        self._apply(worker_id, event_id, data)
                finally:
                    self._replaying = None

    async def _call(self, worker_id: int, endpoint: str, payload: bytes, decode: Any) -> Any:
        instance = self.workers.get(worker_id)
        if instance is None:
            raise InvalidArgument(f"worker {worker_id:x} left")
        return await call(instance.client, endpoint, payload, decode)

    async def _repair_from_buffer(self, worker_id: int) -> bool:
        last = self._last_applied.get(worker_id)
        if last is None:
            return False
        since: KvEventsSince = await self._call(worker_id, KV_EVENTS, _encode(last), _decode_since)
        if since is None or not since.complete:
            return False
        for event in since.events:
            self._apply_repaired(event, worker_id)
        return True

    def _apply_repaired(self, event: KvEvent, worker_id: int) -> None:
        if event.worker_id != worker_id or worker_id not in self.workers or check_event_data(event.data) is not None:
            return
        if self.core.apply_event(event) == "apply":
            self._last_applied[event.worker_id] = event.event_id
            self.metrics.events_applied.inc()

    async def _repair_from_dump(self, worker_id: int) -> None:
        dump: KvDump = await self._call(worker_id, KV_DUMP, b"\xc0", _decode_dump)
        if dump is None or worker_id not in self.workers:
            return
        self.core.load_dump(worker_id, dump.block_hashes, dump.last_event_id)
        self._last_applied[worker_id] = dump.last_event_id

    # ------------------------------------------------------------------ admission
    def _over_budget(self, worker_id: int) -> bool:
        threshold = self.admission.threshold
        instance = self.workers.get(worker_id)
        if threshold is None or instance is None:
            return False
        budget = instance.info.engine.max_num_batched_tokens * threshold
        return self.core.load.prefill_tokens(worker_id) > budget

    def _all_busy(self) -> bool:
        return bool(self.workers) and all(self._over_budget(w) for w in self.workers)

    async def admit(self, request: PreprocessedRequest | None = None) -> None:
        """Wait while every worker is over the admission threshold; waiters leave in
        weighted fair order across tenants on tokens, by tier (:mod:`kvmesh.router.fair`)."""
        if self.admission.threshold is None or (not self._waiting and not self._all_busy()):
            return
        if len(self._waiting) >= self.admission.max_queue:
            self.metrics.rejected.inc()
            raise ResourceExhausted(
                f"every worker is busy and {len(self._waiting)} requests are already waiting; retry shortly",
                retry_after=self.admission.retry_after_s,
            )
        fut = asyncio.get_running_loop().create_future()
        hints = request.routing if request is not None else None
        cost = len(request.token_ids) + (request.stop.max_tokens or 0) if request is not None else 1
        if hints is None:
            self._waiting.push(fut, cost=cost)
        else:
            self._waiting.push(fut, hints.tenant or "", hints.tenant_weight, cost, hints.priority)
        self.metrics.queue_depth.set(len(self._waiting))
        try:
            await fut
        finally:
            if not fut.done():
                fut.cancel()
            self._waiting.remove(fut)
            self.metrics.queue_depth.set(len(self._waiting))

    def _admit_waiting(self) -> None:
        while self._waiting and not self._all_busy():
            fut = self._waiting.pop()
            if not fut.done():
                fut.set_result(None)
                # one at a time: the admitted request books its load before the next check
                return

    # ------------------------------------------------------------------ requests
    def route(
        self, request: PreprocessedRequest, candidates: Sequence[int], health: Mapping[int, float] | None = None
    ) -> Decision:
        hints = request.routing
        weights = None
        if len(candidates) != len(self.workers) or health is not None:
            allowed = set(candidates)
            weights = {w: (health.get(w, 1.0) if health else 1.0) if w in allowed else 0.0 for w in self.workers}
        start, cpu = time.perf_counter(), time.thread_time()
        hashes = matches = salt = holders = None
        adapter = request.adapter
        if adapter is not None or request.cache_salt is not None:  # (never for plain requests)
            salt = hash_salt(adapter, request.cache_salt)
            if adapter is not None:
                holders, weights = self._adapter_candidates(adapter, weights)
                if self._refresher is None:
                    self._refresher = asyncio.get_running_loop().create_task(self._refresh_adapters())
        if self.index is not None:
            hashes = hash_blocks(request.token_ids, self.settings.block_size, salt)
            matches = self.index.find_matches(hashes)
        decision = self.core.route(
            request.request_id,
            request.token_ids,
            time.monotonic(),
            weights=weights,
            overlap_weight=hints.overlap_weight if hints is not None else None,
            temperature=hints.router_temperature if hints is not None else None,
            block_hashes=hashes,
            matches=matches,
            salt=salt,
            holders=holders,
        )
        if adapter is not None:
            self.adapters.routed(decision.worker_id, adapter)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - start  # (the observations are not timed)
        self.metrics.decision_cpu_seconds.observe(cpu)
        self.metrics.decision_seconds.observe(wall)
        if request.token_ids:
            cached = decision.overlap_blocks * self.settings.block_size
            self.metrics.overlap.observe(min(1.0, cached / len(request.token_ids)))
        return decision

    def _adapter_candidates(
        self, adapter: str, weights: dict[int, float] | None
    ) -> tuple[set[int], dict[int, float] | None]:
        """The workers holding ``adapter``, and the weights with the workers that cannot
        load it (they do not know its folder) left out, unless none can."""
        knows = self.adapters.knows(adapter)
        unable = [w for w in self.workers if w not in knows]
        if unable and len(unable) < len(self.workers):
            weights = dict(weights) if weights is not None else {w: 1.0 for w in self.workers}
            weights.update(dict.fromkeys(unable, 0.0))
        return self.adapters.holders(adapter), weights

    async def _refresh_adapters(self) -> None:
        """Every ``adapter_refresh_s``: each adapter-taking worker's resident adapters,
        from its load report (a worker that does not answer keeps the guess)."""
        while True:
            await asyncio.sleep(self.adapter_refresh_s)
            await self.refresh_adapters_once()

    async def refresh_adapters_once(self) -> None:
        able = [w for w in self.workers if self.adapters.capable(w)]

        async def one(worker_id: int) -> None:
            try:
                report = await asyncio.wait_for(self._call(worker_id, LOAD, b"\xc0", _decode_load), self.adapter_refresh_s)
            except (KvmeshError, asyncio.TimeoutError, OSError):
                return
            if report is not None and worker_id in self.workers:
                self.adapters.observe(worker_id, report.adapters)

        await asyncio.gather(*(one(w) for w in able))

    def first_token(self, request_id: str) -> None:
        self.core.first_token(request_id, time.monotonic())
        self._admit_waiting()

    def finished(self, request_id: str) -> None:
        self.core.finished(request_id, time.monotonic())
        self._admit_waiting()


class KvPolicy:
    """The push router's policy for ``kv`` / ``kv-approx``: delegates to the service
    and keeps the decision of requests that asked for an explanation."""

    def __init__(
        self,
        service: KvRouterService,
        peer_fetch: tuple[PeerFetchSettings, Callable[[int], KvEndpoint | None]] | None = None,
    ) -> None:
        self.service = service
        # issue 33: (settings, worker id → its KV endpoint) when workers serve prefixes
        self.peer_fetch = peer_fetch
        self.explained: dict[str, Decision] = {}
        # observability: the last decisions (a route span's overlap, the /dashboard page)
        self.recent: collections.deque[tuple[str, Decision]] = collections.deque(maxlen=32)

    def select(self, ids: Sequence[int], request: PreprocessedRequest, weights: Mapping[int, float] | None = None) -> int:
        decision = self.service.route(request, ids, weights)
        if self.peer_fetch is not None:
            self._hint_peer(request, decision)
        self.recent.append((request.request_id, decision))
        if request.routing is not None and request.routing.explain:
            self.explained[request.request_id] = decision
        return decision.worker_id

    def _hint_peer(self, request: PreprocessedRequest, decision: Decision) -> None:
        """Tell the chosen worker where to read a longer prefix (router/peer.py)."""
        assert self.peer_fetch is not None
        settings, endpoint_of = self.peer_fetch
        block_size = self.service.settings.block_size
        hint = plan_peer_fetch(decision.candidates, decision.worker_id, endpoint_of, block_size, settings)
        hints = request.routing
        if hint is not None or (hints is not None and hints.peer is not None):  # (a retry: a new decision)
            request.routing = msgspec.structs.replace(hints or RoutingHints(), peer=hint)

    async def admit(self, request: PreprocessedRequest) -> None:
        await self.service.admit(request)

    def first_token(self, request_id: str) -> None:
        self.service.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.service.finished(request_id)
        self.explained.pop(request_id, None)

    def explain(self, request_id: str) -> Decision | None:
        return self.explained.pop(request_id, None)
