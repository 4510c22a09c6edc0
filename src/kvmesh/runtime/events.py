"""Event publishing: the interface engines emit KV events and load reports through.

Engines receive an :class:`EventPublisher`; the worker decides where it goes (the
event plane backends of the runtime, or :class:`RecordingPublisher` in tests).
Publishing never blocks and never raises into the engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvmesh.protocol import KvEvent, LoadReport

__all__ = ["EventPublisher", "NullPublisher", "RecordingPublisher", "CallbackPublisher", "KvEventRing"]


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
