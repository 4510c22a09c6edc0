"""Event publishing: the interface engines emit KV events and load reports through.

Engines receive an :class:`EventPublisher`; the worker decides where it goes (the
event plane backends of the runtime, or :class:`RecordingPublisher` in tests).
Publishing never blocks and never raises into the engine.

On the event plane a worker's KV events travel in batches: :class:`BatchingPublisher`
collects the events published during one turn of the event loop (one engine step of a
step-loop engine, one vLLM event batch) and sends them as one
:class:`~kvmesh.kv.events.KvEventBatch` when the turn ends, so a subscriber pays for
one envelope per step rather than one per event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import msgspec

from kvmesh.kv.events import MAX_BATCH_BLOCKS, MAX_BATCH_EVENTS, AllBlocksCleared
from kvmesh.protocol import KvEvent, KvEventBatch, KvEventData, LoadReport

__all__ = ["EventPublisher", "NullPublisher", "RecordingPublisher", "CallbackPublisher", "BatchingPublisher", "KvEventRing"]


class EventPublisher(Protocol):
    def publish_kv(self, event: KvEvent) -> None: ...

    def publish_load(self, report: LoadReport) -> None: ...


class NullPublisher:
    """Drops everything."""

    def publish_kv(self, event: KvEvent) -> None:
        pass

    def publish_load(self, report: LoadReport) -> None:
        pass


class RecordingPublisher:
    """Keeps every event and the last load report; the official fake for tests."""

    def __init__(self) -> None:
        self.kv_events: list[KvEvent] = []
        self.load_reports: list[LoadReport] = []

    def publish_kv(self, event: KvEvent) -> None:
        self.kv_events.append(event)

    def publish_load(self, report: LoadReport) -> None:
        self.load_reports.append(report)


class CallbackPublisher:
    """Forwards to two callables (used to bridge to an event plane)."""

    def __init__(self, on_kv: Callable[[KvEvent], None], on_load: Callable[[LoadReport], None]) -> None:
        self.publish_kv = on_kv
        self.publish_load = on_load


class BatchingPublisher:
    """KV events to ``send_kv`` as encoded :class:`~kvmesh.kv.events.KvEventBatch`
    payloads, load reports to ``send_load`` one by one, as they come.

    Contract: the first event published after a flush asks ``schedule(flush)`` once
    (``loop.call_soon``: the batch leaves when the current turn of the loop ends);
    events published meanwhile join the batch. A batch is sent early, and a new one
    started, when the next event would not follow it (another worker id, or an id that
    is not the next one: a batch's ids are consecutive), or would take it past
    ``max_events`` events or ``max_blocks`` block hashes in all (an event over
    ``max_blocks`` alone goes alone). ``flush()`` sends what is pending now (a no-op
    when nothing is). ``batches`` and ``events`` count what was sent.
    """

    __slots__ = ("_send_kv", "_send_load", "_schedule", "_encode", "_pending", "_blocks", "_scheduled", "max_events",
                 "max_blocks", "batches", "events")  # fmt: skip

    def __init__(
        self,
        send_kv: Callable[[bytes], None],
        send_load: Callable[[bytes], None],
        schedule: Callable[[Callable[[], None]], object],
        max_events: int = MAX_BATCH_EVENTS,
        max_blocks: int = MAX_BATCH_BLOCKS,
    ) -> None:
        if max_events < 1 or max_blocks < 1:
            raise ValueError(f"max_events and max_blocks must be at least 1, got {max_events}, {max_blocks}")
        self._send_kv = send_kv
        self._send_load = send_load
        self._schedule = schedule
        self._encode = msgspec.msgpack.Encoder().encode
        self._pending: list[KvEvent] = []
        self._blocks = 0
        self._scheduled = False
        self.max_events = max_events
        self.max_blocks = max_blocks
        self.batches = 0
        self.events = 0

    def publish_kv(self, event: KvEvent) -> None:
        pending = self._pending
        data = event.data
        blocks = 0 if isinstance(data, AllBlocksCleared) else len(data.block_hashes)
        if pending:
            last = pending[-1]
            if (
                event.worker_id != last.worker_id
                or event.event_id != last.event_id + 1
                or len(pending) >= self.max_events
                or self._blocks + blocks > self.max_blocks
            ):
                self.flush()
        self._pending.append(event)
        self._blocks += blocks
        if not self._scheduled:
            self._scheduled = True
            self._schedule(self._tick)

    def publish_load(self, report: LoadReport) -> None:
        self._send_load(self._encode(report))

    def _tick(self) -> None:
        self._scheduled = False
        self.flush()

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending, self._blocks = [], 0
        data: list[KvEventData] = [e.data for e in pending]
        self.batches += 1
        self.events += len(data)
        self._send_kv(self._encode(KvEventBatch(pending[0].worker_id, pending[0].event_id, data)))


class KvEventRing:
    """The last ``capacity`` KV events of one worker, for subscribers repairing a gap."""

    def __init__(self, capacity: int = 1024) -> None:
        self._events: deque[KvEvent] = deque(maxlen=capacity)

    def append(self, event: KvEvent) -> None:
        self._events.append(event)

    def since(self, event_id: int) -> list[KvEvent] | None:
        """Events with id > ``event_id``, or None if some of them fell out of the ring."""
        if not self._events:
            return []
        first = self._events[0].event_id
        if event_id + 1 < first:
            return None
        return [e for e in self._events if e.event_id > event_id]
