"""vLLM's KV event stream (its ZMQ publisher) into kvmesh's event plane.

vLLM's engine core publishes KV cache events on a ZMQ PUB socket as multipart
``(topic, seq as 8-byte big-endian, msgpack batch)``. :class:`VllmKvEventBridge`
owns a SUB socket connected to that publisher and one reader task; for each batch it

1. checks ``seq`` (a gap means vLLM dropped batches, or we subscribed late: the
   blocks chained to what was lost cannot be translated, see
   :mod:`kvmesh.engines.vllm.kv_events`; they are counted in ``gaps``);
2. converts the payload with :class:`~kvmesh.engines.vllm.kv_events.VllmEventConverter`
   (vLLM hashes → kvmesh's chained xxh3 hashes of the same tokens);
3. numbers the resulting events with this worker's event ids (from 0, one per event)
   and hands each to the worker's :class:`~kvmesh.runtime.events.EventPublisher`,
   keeping them in a :class:`~kvmesh.runtime.events.KvEventRing` and the set of
   cached hashes for :meth:`snapshot`, so the router's gap repair works as with the
   mocker (``kv_events_since``, ``kv_snapshot``).

The endpoint is an ``ipc://`` path in a private temporary folder: vLLM binds its
publisher there (its rule: wildcard, ipc and inproc endpoints bind; tcp host
endpoints connect), nothing listens on a network address, and the SUB socket can
connect before vLLM binds (ZMQ retries), so no batch is missed at startup.
Everything runs on the worker's event loop (``zmq.asyncio``); no threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile

import zmq
import zmq.asyncio

from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvDump, KvEvent, KvEventData
from kvmesh.engines.vllm.kv_events import VllmEventConverter
from kvmesh.runtime.events import EventPublisher, KvEventRing, NullPublisher
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = ["VllmKvEventBridge"]

log = logging.getLogger(__name__)


class VllmKvEventBridge:
    """Subscribes to one vLLM publisher and republishes its events as kvmesh events.

    Lifecycle: :meth:`start` (makes ``endpoint``, to pass to vLLM's ``KVEventsConfig``;
    connects; publishes ``AllBlocksCleared`` so subscribers drop what an earlier
    incarnation of this worker published; starts the reader) → :meth:`close`
    (idempotent; publishes ``AllBlocksCleared`` again: this worker's cache is gone).
    """

    def __init__(
        self,
        worker_id: int,
        block_size: int,
        publisher: EventPublisher | None = None,
        *,
        ring_capacity: int = 4096,
    ) -> None:
        self.worker_id = worker_id
        self._converter = VllmEventConverter(block_size)
        self._publisher: EventPublisher = publisher if publisher is not None else NullPublisher()
        self._ring = KvEventRing(ring_capacity)
        self._cached: set[int] = set()
        self._next_id = 0
        self._next_seq: int | None = None
        self._dir: str | None = None
        self.endpoint = ""  # set by start(): ipc://<private temp folder>/kv.sock
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # batches received
        self.gaps = 0  # times vLLM's sequence numbers skipped ahead

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="kvmesh-vllm-events-")  # 0700: only this user
        self.endpoint = f"ipc://{os.path.join(self._dir, 'kv.sock')}"
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._sock = sock
        self._emit(AllBlocksCleared())
        self._task = asyncio.get_running_loop().create_task(self._read(sock), name="vllm-kv-events")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
            self._emit(AllBlocksCleared())
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ------------------------------------------------------------------ repair helpers

    @property
    def last_event_id(self) -> int:
        return self._next_id - 1

    @property
    def skipped_blocks(self) -> int:
        """vLLM blocks left out of the index (see the converter's limits)."""
        return self._converter.skipped_blocks

    def snapshot(self) -> KvDump:
        return KvDump(self.worker_id, self.last_event_id, sorted(self._cached))

    def events_since(self, event_id: int) -> list[KvEvent] | None:
        return self._ring.since(event_id)

    # ------------------------------------------------------------------ reading

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self.handle(frames)
            except Exception:  # noqa: BLE001 - one bad batch must not stop the stream
                log.exception("dropped an undecodable vLLM KV event batch")

    def handle(self, frames: list[bytes]) -> list[KvEvent]:
        """Process one multipart message ``(topic, seq, payload)``; returns the events
        published for it. Public so tests can drive the bridge without vLLM."""
        if len(frames) != 3:
            raise ValueError(f"expected (topic, seq, payload), got {len(frames)} frames")
        _topic, seq_bytes, payload = frames
        self._check_seq(int.from_bytes(seq_bytes, "big", signed=True))
        self.batches += 1
        return [self._emit(data) for data in self._converter.convert(payload)]

    def _check_seq(self, seq: int) -> None:
        expected = self._next_seq
        if expected is not None and seq > expected:
            self.gaps += 1
            log.warning("vLLM KV events %d..%d were lost; blocks chained to them stay unindexed", expected, seq - 1)
        self._next_seq = seq + 1

    def _emit(self, data: KvEventData) -> KvEvent:
        if isinstance(data, BlockStored):
            self._cached.update(data.block_hashes)
        elif isinstance(data, BlockRemoved):
            self._cached.difference_update(data.block_hashes)
        else:
            self._cached.clear()
        event = KvEvent(self.worker_id, self._next_id, data)
        self._next_id += 1
        self._ring.append(event)
        self._publisher.publish_kv(event)
        return event
