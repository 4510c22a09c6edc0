"""The KV index sharded by worker over processes: ``kvmesh frontend --router-shards S``.

One router process ingests ~0.8 M KV events per CPU-second (``bench/fleet.py``), about
what 1,000 busy mocker workers publish (0.83 M/s; 1.4 M/s with an earlier timing model):
no margin. With ``S`` > 1 the frontend keeps the decisions (load
booking, cost, selection: :class:`~kvmesh.router.core.KvRouterCore`) and ``S`` shard
processes (:mod:`kvmesh.router.shard_main`) keep the index, each for its own workers:

* **ingest**: a shard subscribes to the KV events of the workers it was given (its
  own zmq SUB socket), applies them with a :class:`~kvmesh.router.service.KvRouterService`
  of its own (sequencing, gap repair), and reports its counters every
  :data:`STATS_INTERVAL_S` (the frontend adds them to its metrics);
* **repair**: the shard has no request plane; its repair calls (``kv_dump``,
  ``kv_events``) come up to the frontend, which makes them with the worker's client
  and sends the answer down (:class:`Call` / :class:`CallReply`);
* **queries**: for each decision the frontend sends the prompt's block hashes to every
  shard at once and merges the answers (disjoint workers); a shard answers between
  envelopes (its reader yields every two), and one that has not answered within
  :data:`QUERY_TIMEOUT_S` counts as no overlap for its workers this time (the
  decision is still made, on load alone for them; counted in ``late``).

A worker goes to the shard with the fewest workers when it is attached. Channels (one
pair of Unix sockets per shard, inherited by the child): *control*, length-prefixed
msgpack frames of :data:`Down` / :data:`Up` (at most :data:`MAX_CONTROL_FRAME` bytes),
read by one task on each side; *query*, ``SOCK_SEQPACKET`` datagrams of :class:`Query`
/ :class:`Matches`, strictly one answer per question, matched by id (a late answer is
dropped). A shard exits when its control channel closes (the frontend went away); a
shard that ends on its own is started again and given its workers back (their caches
reloaded from their dumps), with a doubling back-off.

Only the zmq event plane is supported (NATS subjects carry every worker's events to
every subscriber: a shard would decode them all).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Union

import msgspec

from kvmesh.errors import CannotConnect, KvmeshError
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.context import Context
from kvmesh.runtime.distributed import call
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = [
    "ShardedKvIndex",
    "Hello",
    "AddWorker",
    "RemoveWorker",
    "Call",
    "CallReply",
    "Stats",
    "Query",
    "Matches",
    "Down",
    "Up",
    "FrameChannel",
    "QUERY_TIMEOUT_S",
    "MAX_CONTROL_FRAME",
]

log = logging.getLogger("kvmesh.router.shards")

QUERY_TIMEOUT_S = 0.002
STATS_INTERVAL_S = 0.2
MAX_CONTROL_FRAME = 128 * 1024 * 1024  # a dump of 4 Mi blocks (the index's cap per worker) is ~40 MiB
QUERY_BUFFER = 4 * 1024 * 1024  # a query of 64 Ki blocks is ~600 KiB; an answer of 10,000 workers ~100 KiB
_LEN = struct.Struct("<I")


# ---------------------------------------------------------------------------- wire


class Hello(msgspec.Struct, tag="hello"):
    """The first frame down: what the shard serves."""

    model: str
    block_size: int
    max_blocks_per_worker: int
    host: str


class AddWorker(msgspec.Struct, tag="add"):
    info: InstanceInfo


class RemoveWorker(msgspec.Struct, tag="remove"):
    worker_id: int


class CallReply(msgspec.Struct, tag="reply", omit_defaults=True):
    """The answer to a :class:`Call`: the raw last item (None: none), or a typed error."""

    call_id: int
    payload: bytes | None = None
    error_kind: str = ""
    error: str = ""


class Call(msgspec.Struct, tag="call"):
    """A repair call the shard wants made to one of its workers."""

    call_id: int
    worker_id: int
    endpoint: str
    payload: bytes


class Stats(msgspec.Struct, tag="stats"):
    """The shard's counters since it started (totals), and its inbox now."""

    applied: int
    gaps: int
    buffer_repairs: int
    dump_repairs: int
    rejected: dict[str, int]
    backlog: int
    dropped: int


class Query(msgspec.Struct, array_like=True):
    query_id: int
    hashes: list[int]


class Matches(msgspec.Struct, array_like=True):
    query_id: int
    matches: dict[int, int]


Down = Union[Hello, AddWorker, RemoveWorker, CallReply]
Up = Union[Call, Stats]


class FrameChannel:
    """Length-prefixed msgpack frames of one tagged union over an asyncio stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: Any) -> None:
        self._reader = reader
        self._writer = writer
        self._decode = msgspec.msgpack.Decoder(kind).decode
        self._encode = msgspec.msgpack.Encoder().encode

    def send(self, message: msgspec.Struct) -> None:
        data = self._encode(message)
        self._writer.write(_LEN.pack(len(data)) + data)

    async def recv(self) -> Any:
        """The next frame, or None when the other side closed."""
        try:
            head = await self._reader.readexactly(_LEN.size)
            (size,) = _LEN.unpack(head)
            if size > MAX_CONTROL_FRAME:
                raise ValueError(f"control frame of {size} bytes is over {MAX_CONTROL_FRAME}")
            return self._decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


def query_socketpair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, QUERY_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, QUERY_BUFFER)
    return a, b


# ---------------------------------------------------------------------------- the frontend's side


class _Shard:
    """One shard process as the frontend sees it."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, control: FrameChannel, query: socket.socket) -> None:
        self.index = index
        self.proc = proc
        self.control = control
        self.query = query
        self.workers: set[int] = set()
        self.stats = Stats(0, 0, 0, 0, {}, 0, 0)
        self.reader: asyncio.Task[None] | None = None


class ShardedKvIndex:
    """The frontend's handle on ``shards`` index processes (see the module docstring).

    Lifecycle: ``await start(hello, clients)`` → ``add_worker(instance)`` /
    ``remove_worker(worker_id)`` as discovery says → ``find_matches(hashes)`` per
    decision (synchronous: a bounded wait on the shards' answers) → ``await close()``.
    ``metrics`` (the model's RouterMetrics) receives the shards' counters.
    """

    def __init__(self, shards: int, metrics: Any) -> None:
        if shards < 2:
            raise ValueError(f"a sharded index needs at least 2 shards, got {shards}")
        self.n = shards
        self.metrics = metrics
        self._shards: list[_Shard] = []
        self._of: dict[int, _Shard] = {}
        self._instances: dict[int, Instance] = {}
        self._ids = itertools.count(1)
        self._calls: set[asyncio.Task[None]] = set()
        self.late = 0  # queries a shard did not answer in time
        self.respawns = 0  # shards started again after they ended on their own
        self._hello: Hello | None = None
        self.timeout_s = QUERY_TIMEOUT_S
        self._closing = False

    async def start(self, hello: Hello) -> None:
        self._hello = hello
        for i in range(self.n):
            self._shards.append(await self._spawn(i, hello))
        if hasattr(self.metrics, "event_backlog"):
            self.metrics.event_backlog.set_function(lambda: sum(s.stats.backlog for s in self._shards))
            self.metrics.events_dropped.set_function(lambda: sum(s.stats.dropped for s in self._shards))

    async def _spawn(self, i: int, hello: Hello) -> _Shard:
        parent_ctl, child_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent_q, child_q = query_socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvmesh.router.shard_main", str(child_ctl.fileno()), str(child_q.fileno()), str(i),
                pass_fds=(child_ctl.fileno(), child_q.fileno()), stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            child_ctl.close()
            child_q.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent_ctl, limit=1 << 20)
        control = FrameChannel(reader, writer, Up)
        control.send(hello)
        parent_q.setblocking(True)
        shard = _Shard(i, proc, control, parent_q)
        shard.reader = asyncio.get_running_loop().create_task(self._read(shard), name=f"kv-shard-{i}")
        return shard

    # ------------------------------------------------------------------ workers

    def add_worker(self, instance: Instance) -> None:
        w = instance.worker_id
        if w in self._of:
            self.remove_worker(w)
        shard = min(self._shards, key=lambda s: len(s.workers))
        shard.workers.add(w)
        self._of[w] = shard
        self._instances[w] = instance
        shard.control.send(AddWorker(instance.info))

    def remove_worker(self, worker_id: int) -> None:
        shard = self._of.pop(worker_id, None)
        self._instances.pop(worker_id, None)
        if shard is not None:
            shard.workers.discard(worker_id)
            shard.control.send(RemoveWorker(worker_id))

    def shard_of(self, worker_id: int) -> int | None:
        shard = self._of.get(worker_id)
        return None if shard is None else shard.index

    # ------------------------------------------------------------------ queries

    def find_matches(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """``{worker: leading blocks held}`` from every shard (see the module docstring)."""
        if not block_hashes:
            return {}
        qid = next(self._ids)
        data = msgspec.msgpack.encode(Query(qid, list(block_hashes)))
        asked = []
        for shard in self._shards:
            if shard.workers:
                try:
                    shard.query.send(data)
                    asked.append(shard)
                except OSError:
                    self.late += 1
        out: dict[int, int] = {}
        deadline = time.monotonic() + self.timeout_s
        for shard in asked:
            answer = self._answer(shard, qid, deadline)
            if answer is None:
                self.late += 1
                late = getattr(self.metrics, "shard_late", None)
                if late is not None:
                    late.inc()
            else:
                out.update(answer)
        return out

    def _answer(self, shard: _Shard, qid: int, deadline: float) -> dict[int, int] | None:
        sock = shard.query
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
            try:
                data = sock.recv(QUERY_BUFFER)
            except (TimeoutError, OSError):
                return None
            try:
                answer = msgspec.msgpack.decode(data, type=Matches)
            except msgspec.DecodeError:
                continue
            if answer.query_id == qid:
                return answer.matches
            # an answer to an earlier, timed-out question: dropped

    # ------------------------------------------------------------------ the shards' frames

    async def _read(self, shard: _Shard) -> None:
        while True:
            frame = await shard.control.recv()
            if frame is None:
                if not self._closing:
                    await self._respawn(shard)
                return
            if isinstance(frame, Stats):
                self._account(shard, frame)
            else:
                task = asyncio.get_running_loop().create_task(self._call(shard, frame))
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)

    async def _respawn(self, old: _Shard) -> None:
        """A shard ended on its own: a new process takes its place and its workers (each
        loaded from its dump again). Back-off: 0.1 s doubling per respawn, at most 5 s."""
        await old.proc.wait()
        log.warning("KV index shard %d ended (exit status %s); starting it again", old.index, old.proc.returncode)
        old.control.close()
        old.query.close()
        await asyncio.sleep(min(5.0, 0.1 * 2**self.respawns))
        self.respawns += 1
        if self._closing or self._hello is None:
            return
        new = await self._spawn(old.index, self._hello)
        new.workers = old.workers
        self._shards[old.index] = new
        for w in new.workers:
            self._of[w] = new
            new.control.send(AddWorker(self._instances[w].info))

    async def _call(self, shard: _Shard, req: Call) -> None:
        instance = self._instances.get(req.worker_id)
        try:
            if instance is None:
                raise CannotConnect(f"worker {req.worker_id:x} left")
            raw = await call(instance.client, req.endpoint, req.payload)
            reply = CallReply(req.call_id, None if raw is None else bytes(raw))
        except KvmeshError as exc:
            reply = CallReply(req.call_id, error_kind=exc.kind, error=exc.message)
        shard.control.send(reply)

    def _account(self, shard: _Shard, new: Stats) -> None:
        old, shard.stats = shard.stats, new
        m = self.metrics
        if new.applied > old.applied:
            m.events_applied.inc(new.applied - old.applied)
        if new.gaps > old.gaps:
            m.event_gaps.inc(new.gaps - old.gaps)
        for kind, now, before in (("buffer", new.buffer_repairs, old.buffer_repairs), ("dump", new.dump_repairs, old.dump_repairs)):
            if now > before:
                m.repairs[kind].inc(now - before)
        for reason, n in new.rejected.items():
            for _ in range(max(0, n - old.rejected.get(reason, 0))):
                m.event_rejected(reason)

    @property
    def applied(self) -> int:
        return sum(s.stats.applied for s in self._shards)

    async def close(self) -> None:
        self._closing = True
        for task in list(self._calls):
            task.cancel()
        for shard in self._shards:
            shard.control.close()
            shard.query.close()
        for shard in self._shards:
            try:
                await asyncio.wait_for(shard.proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    shard.proc.kill()
                await shard.proc.wait()
            await cancel_and_wait(shard.reader)
        self._shards.clear()


# ---------------------------------------------------------------------------- the shard's side


class ParentClient:
    """The request-plane client a shard's router uses for one worker: each call goes up
    to the frontend (a :class:`Call`) and its answer comes back (:class:`CallReply`)."""

    def __init__(self, worker_id: int, ask: Callable[[Call], asyncio.Future[CallReply]], ids: Callable[[], int]) -> None:
        self.worker_id = worker_id
        self._ask = ask
        self._ids = ids

    async def stream(
        self, endpoint: str, payload: bytes, ctx: Context, decode: Callable[[msgspec.Raw], Any] | None = None, merge: Any = None
    ) -> AsyncIterator[Any]:
        reply = await self._ask(Call(self._ids(), self.worker_id, endpoint, payload))
        if reply.error_kind:
            from kvmesh.errors import from_wire

            raise from_wire(reply.error_kind, reply.error)
        if reply.payload is not None:
            raw = msgspec.Raw(reply.payload)
            yield raw if decode is None else decode(raw)

    async def close(self) -> None:
        pass

