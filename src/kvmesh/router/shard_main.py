"""One KV index shard process (``python -m kvmesh.router.shard_main CONTROL_FD QUERY_FD INDEX``),
started by :class:`~kvmesh.router.shards.ShardedKvIndex`; the protocol is in
:mod:`kvmesh.router.shards`.

It runs a :class:`~kvmesh.router.service.KvRouterService` of its own over a zmq
subscription to the workers the frontend gives it (events, sequencing, repair through
the frontend), answers overlap queries from its index between envelopes, reports its
counters, and exits when the control channel closes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import sys
from typing import Any

import msgspec

from kvmesh.router.core import RouterSettings
from kvmesh.router.service import KvRouterService
from kvmesh.router.shards import (
    STATS_INTERVAL_S,
    AddWorker,
    Call,
    CallReply,
    Down,
    FrameChannel,
    Hello,
    Matches,
    ParentClient,
    Query,
    QUERY_BUFFER,
    RemoveWorker,
    Stats,
)
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import KV_EVENTS_TOPIC
from kvmesh.runtime.tasks import cancel_and_wait

log = logging.getLogger("kvmesh.router.shard")


class _Count:
    """A counter or gauge child as the service uses it, kept in this process."""

    def __init__(self) -> None:
        self.value = 0
        self.function: Any = None

    def inc(self, n: int = 1) -> None:
        self.value += n

    def set(self, v: int) -> None:
        self.value = v

    def set_function(self, fn: Any) -> None:
        self.function = fn

    def observe(self, v: float) -> None:
        pass

    def read(self) -> int:
        return int(self.function()) if self.function is not None else self.value


class ShardMetrics:
    """What :class:`KvRouterService` records, counted here and sent up as :class:`Stats`."""

    def __init__(self) -> None:
        self.events_applied = _Count()
        self.event_gaps = _Count()
        self.repairs = {"buffer": _Count(), "dump": _Count()}
        self.block_size_mismatch = _Count()
        self.event_backlog = _Count()
        self.events_dropped = _Count()
        self.rejected: dict[str, int] = {}
        for name in ("decision_seconds", "decision_cpu_seconds", "overlap", "queue_depth"):
            setattr(self, name, _Count())

    def event_rejected(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def stats(self) -> Stats:
        return Stats(
            self.events_applied.value, self.event_gaps.value, self.repairs["buffer"].value, self.repairs["dump"].value,
            dict(self.rejected), self.event_backlog.read(), self.events_dropped.read(),
        )  # fmt: skip


class Shard:
    def __init__(self, control: FrameChannel, query: socket.socket, hello: Hello) -> None:
        self.control = control
        self.query = query
        self.hello = hello
        self.metrics = ShardMetrics()
        self._pending: dict[int, asyncio.Future[CallReply]] = {}
        self._ids = itertools.count(1)
        self._decode_query = msgspec.msgpack.Decoder(Query).decode
        self._encode = msgspec.msgpack.Encoder().encode

    async def run(self) -> None:
        from kvmesh.runtime.event_plane.zmq import ZmqEventPlane

        plane = ZmqEventPlane(self.hello.host)
        settings = RouterSettings(block_size=self.hello.block_size, max_blocks_per_worker=self.hello.max_blocks_per_worker)
        self.service = KvRouterService(settings, await plane.subscribe(KV_EVENTS_TOPIC), self.metrics)
        self.service.start()
        loop = asyncio.get_running_loop()
        self.query.setblocking(False)
        loop.add_reader(self.query.fileno(), self._on_query)
        stats = loop.create_task(self._report())
        try:
            await self._serve()
        finally:
            loop.remove_reader(self.query.fileno())
            await cancel_and_wait(stats)
            await self.service.close()
            await plane.close()

    async def _serve(self) -> None:
        while True:
            frame = await self.control.recv()
            if frame is None:
                return
            if isinstance(frame, AddWorker):
                client = ParentClient(frame.info.worker_id, self._ask, lambda: next(self._ids))
                self.service.add_worker(Instance(frame.info, client))  # type: ignore[arg-type]  # a RequestClient by shape
            elif isinstance(frame, RemoveWorker):
                self.service.remove_worker(frame.worker_id)
            elif isinstance(frame, CallReply):
                fut = self._pending.pop(frame.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(frame)

    def _ask(self, req: Call) -> asyncio.Future[CallReply]:
        fut: asyncio.Future[CallReply] = asyncio.get_running_loop().create_future()
        self._pending[req.call_id] = fut
        self.control.send(req)
        return fut

    def _on_query(self) -> None:
        """Answer every question waiting on the query socket."""
        index = self.service.core.indexer
        while True:
            try:
                data = self.query.recv(QUERY_BUFFER)
            except BlockingIOError:
                return
            except OSError:
                return
            if not data:
                return
            try:
                q = self._decode_query(data)
            except msgspec.DecodeError:
                continue
            matches = index.find_matches(q.hashes) if index is not None else {}
            try:
                self.query.send(self._encode(Matches(q.query_id, matches)))
            except OSError:
                return

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            self.control.send(self.metrics.stats())


async def main(control_fd: int, query_fd: int) -> None:
    ctl = socket.socket(fileno=control_fd)
    query = socket.socket(fileno=query_fd)
    reader, writer = await asyncio.open_unix_connection(sock=ctl, limit=1 << 20)
    control = FrameChannel(reader, writer, Down)
    hello = await control.recv()
    if not isinstance(hello, Hello):
        return
    await Shard(control, query, hello).run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s kv-shard {sys.argv[3]} %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    except KeyboardInterrupt:
        pass
