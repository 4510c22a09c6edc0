"""One frontend in ``kv`` mode in front of 10 / 100 / 1,000 mocker workers, in one run.

    python bench/fleet.py                                   # arms 10, 100, 1000 (= 4 processes x 250)
    python bench/fleet.py --arms 10x1,100x4,1000x4,1000x4s2 # and 1,000 with the index in 2 shard processes
    python bench/fleet.py --arms 10x1,100x4 --requests 300 --json out.json

Real processes on 127.0.0.1 only: an etcd and a nats-server (tests/services.py), one
``kvmesh frontend --router-mode kv`` per arm and ``kvmesh worker --replicas K`` worker
processes (``NxP``: N workers in P processes). Every process is started here and
stopped here, by its PID. Per arm:

* **discovery**: from starting the worker processes to every READY line (all
  registered) and to the frontend routing to all N (``/health`` counts them; in kv mode
  a worker is attached after its KV dump was asked for);
* **idle cost**: RSS and CPU of the worker processes over an idle window, divided by N;
  discovery keys (``etcdctl``), etcd leases, sockets per worker (listening + connected),
  connections to etcd and NATS per process;
* **load**: a closed loop of ``--concurrency`` streaming clients on a shared-prefix
  workload (``--prefix-groups`` prompts of ``--prefix-tokens`` shared + ``--suffix-tokens``
  unique tokens, ``--output-tokens`` out), bounded by ``--requests`` and ``--max-seconds``;
  throughput, errors, frontend CPU per request and peak RSS;
* **router**, from the frontend's own metrics over the load: decision time p50/p99
  (``kvmesh_router_decision_seconds``, interpolated within its buckets), KV events
  applied per second, gaps (events lost on the way, then repaired), events dropped at the
  router's inbox, the event backlog (received, not yet applied; sampled every second:
  a GET /metrics of 1,000 workers costs the frontend ~0.2 s of CPU, taken out of its
  CPU per request), and how long after the load the router still applied events.

Priorities (``--background idle``, the default): the worker processes and this process,
the load client, run in the ``SCHED_IDLE`` class during the arms; the frontend (and its
index shards), etcd and nats-server in ``SCHED_OTHER`` at niceness 0 (``--frontend-nice``).
Workers and clients stand for other machines: on this 2-core box they would otherwise
preempt the frontend in the middle of a decision. Measured (1,000 workers, workers at
nice 10 and the client at nice 5, the former default): 531 of the 532 decisions over
1 ms had one involuntary context switch inside them and no other frontend thread held
the GIL (py-spy --gil), so the wall p99 (~2 ms, CPU p99 0.35 ms) was the time another
process held the core; a ``SCHED_IDLE`` task never preempts a normal one and runs only
where no normal task wants the core, as if the frontend had a core of its own.
``--background nice`` runs them at ``--worker-nice`` (10) / ``--client-nice`` (5)
instead. Other users of the machine are not under the bench's control. Decision times are
reported as wall and as CPU time of the deciding thread (CPU is what the router costs;
wall minus CPU is time the thread was not running).

Before the arms, measurements on the same machine:

* **event rate of a busy worker**: a mocker scheduler at its modelled speed (speedup 1,
  virtual clock) kept full (``max_num_seqs`` requests in flight) with the shared-prefix
  workload and ``--busy-output-tokens`` per request, its events sent by the worker's
  own :class:`~kvmesh.runtime.events.BatchingPublisher` (one batch per engine step):
  KV events and envelopes per second of one busy worker, times 1,000 = the rate 1,000
  busy workers produce;
* **router ingest capacity** (one core, CPU time of the thread): 1,000 workers'
  batches, interleaved, through the service's decode and the core, in two arms fed the
  same events in alternating rounds: batched (what workers send) and one event per
  envelope (the older form); plus the zmq subscription's own cost per envelope; and
  decision p50/p99 on that index. The ratio busy rate / one core's rate says whether
  one router keeps up;
* **the frontend's own index at the busy rate** (``--one-core``): one
  :class:`~kvmesh.router.service.KvRouterService` with its real zmq subscription (one
  PUB socket per worker in a forked feeder) fed 1,000 busy workers'
  batches at the busy rate while the same thread decides (``service.route``) every
  2 ms: events applied per second, the thread's busy share, the backlog (envelopes
  received and not yet applied), drops, gaps, decision p50/p99 wall and CPU;
* **sharded index** (``--shards``): the product's ``--router-shards`` processes, fed by
  a forked process with one zmq PUB socket per worker at the busy rate, while this
  process makes decisions (queries to every shard + selection) every 2 ms: events
  applied per second and per shard CPU-second, backlog, decision p50/p99.

The machine is shared and small (2 cores): all figures are loaded figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402

from _lib import free_port, measure_cpu, percentile, read_mem, run_load_async  # noqa: E402
from tests.helpers import stop_process  # noqa: E402

MODEL = "kvmesh-tiny"
BUSY_WORKERS = 1000


# ---------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def http_get(url: str, timeout: float = 5.0) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read().decode()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$")


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` → value, from the frontend's /metrics."""
    out: dict[str, float] = {}
    for line in http_get(url + "/metrics", timeout=120.0).splitlines():  # ~0.2 s of CPU per 1,000 workers
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(sample: dict[str, float], name: str) -> float:
    return sum(v for k, v in sample.items() if k == name or k.startswith(name + "{"))


def histogram_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The q-quantile of the observations between two scrapes of histogram ``name``,
    linear within its bucket (as Prometheus does)."""
    buckets: dict[float, float] = {}
    for k, v in after.items():
        if k.startswith(name + "_bucket{"):
            le = re.search(r'le="([^"]+)"', k)
            if le:
                bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
                buckets[bound] = buckets.get(bound, 0.0) + v - before.get(k, 0.0)
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return lower
            width = buckets[b] - below
            return lower + (b - lower) * ((rank - below) / width if width > 0 else 1.0)
        lower, below = b, buckets[b]
    return None


def socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def tcp_table() -> dict[int, tuple[int, int, str]]:
    """inode → (local port, remote port, state) of every IPv4/IPv6 TCP socket."""
    table: dict[int, tuple[int, int, str]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            next(f)
            for line in f:
                parts = line.split()
                local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
                table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


def connections(pids: list[int], ports: dict[str, int]) -> dict[str, int]:
    """Sockets of ``pids``: all, listening, and established to each of ``ports``."""
    table = tcp_table()
    counts = {"sockets": 0, "listening": 0, **{name: 0 for name in ports}}
    for pid in pids:
        for inode in socket_inodes(pid):
            counts["sockets"] += 1
            entry = table.get(inode)
            if entry is None:
                continue
            if entry[2] == "0A":
                counts["listening"] += 1
            for name, port in ports.items():
                if entry[2] == "01" and entry[1] == port:
                    counts[name] += 1
    return counts


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Shape:
    prefix_tokens: int
    suffix_tokens: int
    groups: int
    output_tokens: int


def _prefixes(shape: Shape, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 2000) for _ in range(shape.prefix_tokens)] for _ in range(shape.groups)]


def prompts(shape: Shape, n: int, seed: int) -> Iterator[list[int]]:
    """Shared-prefix prompts: one of ``groups`` prefixes (fixed by ``seed``) + unique tokens."""
    prefixes = _prefixes(shape, seed)
    rng = random.Random(seed + 1)
    for _ in range(n):
        yield prefixes[rng.randrange(shape.groups)] + [rng.randrange(100, 2000) for _ in range(shape.suffix_tokens)]


# ---------------------------------------------------------------------------- in-process measurements


def busy_worker_rate(shape: Shape, sim_s: float) -> tuple[dict[str, float], list[object]]:
    """KV events per second of one mocker worker kept full, on its modelled clock, as the
    worker's :class:`~kvmesh.runtime.events.BatchingPublisher` sends them (one batch per
    engine step: the sim's steps are its loop turns); and the batches (a stream to replay)."""
    from kvmesh.engines.mocker.options import MockerOptions
    from kvmesh.engines.mocker.sim import VirtualWorker
    from kvmesh.kv.events import decode_kv_payload
    from kvmesh.protocol import PreprocessedRequest, StopConditions
    from kvmesh.runtime.events import BatchingPublisher

    batches: list[object] = []
    sizes: list[int] = []
    loads = [0]
    turn: list[object] = []  # the flush the publisher scheduled for the end of this turn

    def sent(payload: bytes) -> None:
        batches.append(decode_kv_payload(payload))
        sizes.append(len(payload))

    publisher = BatchingPublisher(sent, lambda _r: loads.__setitem__(0, loads[0] + 1), turn.append)
    options = MockerOptions()
    worker = VirtualWorker(options, publisher)
    warmup_ms = 0.25 * sim_s * 1000  # the first quarter fills the batch and the cache: not counted
    source = prompts(shape, 10**9, seed=7)
    done = [0]
    ids = iter(range(10**12))

    def submit(now: float) -> None:
        stop = StopConditions(max_tokens=shape.output_tokens, ignore_eos=True)
        worker.submit(PreprocessedRequest(f"r{next(ids)}", MODEL, next(source), stop=stop), now)

    for _ in range(options.max_num_seqs):
        submit(0.0)
    mark: tuple[float, int, int, int, int] | None = None
    while worker.now_ms < sim_s * 1000:
        t = worker.next_event_time()
        assert t is not None
        for ev in worker.advance_to(t):
            if ev.finish_reason is not None:
                done[0] += 1
                submit(worker.now_ms)
        while turn:  # the turn of the loop ends: the step's events leave in one batch
            turn.pop()()  # type: ignore[operator]
        if mark is None and worker.now_ms >= warmup_ms:
            mark = (worker.now_ms, publisher.events, len(batches), loads[0], done[0])
    assert mark is not None
    seconds = (worker.now_ms - mark[0]) / 1000
    envelopes = len(batches) - mark[2]
    events = publisher.events - mark[1]
    rate = {
        "kv_events_per_s": events / seconds,
        "kv_envelopes_per_s": envelopes / seconds,
        "events_per_envelope": events / envelopes if envelopes else 0.0,
        "payload_bytes_mean": sum(sizes[mark[2]:]) / envelopes if envelopes else 0.0,
        "load_reports_per_s": (loads[0] - mark[3]) / seconds,
        "requests_per_s": (done[0] - mark[4]) / seconds,
        "max_num_seqs": options.max_num_seqs,
    }
    return rate, batches


class WireStream:
    """What a router receives from ``workers``, each replaying ``stream`` (one busy
    worker's batches) under its own id: every worker caches the shared prefixes (same
    hashes); the rest of its blocks are its own (hashes salted per worker, chains kept).
    Interleaved batch by batch across workers, as they would arrive. ``batched`` False:
    the same events one per envelope (the older wire form), for the A/B.

    ``chunk`` gives encoded envelopes (what a socket carries); ``opened`` the envelopes
    the subscription hands the router (decoded, as its :class:`Opener` does: that part
    of the cost is the subscription's, measured by :func:`zmq_ingest`)."""

    def __init__(self, stream: list[object], workers: list[int], shape: Shape, batched: bool = True) -> None:
        from kvmesh.kv.hashing import block_hashes
        from kvmesh.runtime.event_plane.base import Envelope

        self._decode_env = msgspec.msgpack.Decoder(Envelope).decode
        self._encode = msgspec.msgpack.Encoder().encode
        self.batches = stream
        self.workers = workers
        self.batched = batched
        self.shared = {h for p in _prefixes(shape, seed=7) for h in block_hashes(p, 16)}
        self.pos = 0

    def _salted(self, data: object, salt: int) -> object:
        from kvmesh.protocol import BlockRemoved, BlockStored

        shared = self.shared
        if isinstance(data, BlockStored):
            parent = data.parent_hash
            if parent is not None and parent not in shared:
                parent ^= salt
            salted = [h if h in shared else h ^ salt for h in data.block_hashes]
            return BlockStored(salted, data.token_hashes, parent)
        if isinstance(data, BlockRemoved):
            return BlockRemoved([h if h in shared else h ^ salt for h in data.block_hashes])
        return data

    def chunk(self, size: int) -> tuple[list[bytes], int]:
        """The next ``size`` envelopes or so (whole rounds over the workers) and the
        events in them; ([], 0) at the end."""
        out: list[bytes] = []
        events = 0
        while len(out) < size and self.pos < len(self.batches):
            batched, single, n = self._round()
            out += batched if self.batched else single
            events += n
        return out, events

    def _round(self) -> tuple[list[bytes], list[bytes], int]:
        """The next batch of every worker, encoded both ways (batched, one event per envelope)."""
        from kvmesh.protocol import KvEvent, KvEventBatch
        from kvmesh.runtime.event_plane.base import Envelope

        encode = self._encode
        b = self.batches[self.pos]
        self.pos += 1
        first = b.first_event_id  # type: ignore[attr-defined]
        batched: list[bytes] = []
        single: list[bytes] = []
        events = 0
        for w in self.workers:
            salt = (w * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)
            datas = [self._salted(d, salt) for d in b.events]  # type: ignore[attr-defined]
            batched.append(encode(Envelope(w, first + 1, "kv_events", encode(KvEventBatch(w, first, datas)))))  # type: ignore[arg-type]
            for i, d in enumerate(datas):
                single.append(encode(Envelope(w, first + i + 1, "kv_events", encode(KvEvent(w, first + i, d)))))  # type: ignore[arg-type]
            events += len(datas)
        return batched, single, events

    def opened(self, size: int) -> tuple[list[object], int]:
        raw, events = self.chunk(size)
        return [self._decode_env(r) for r in raw], events

    def opened_round(self) -> tuple[list[object], list[object], int]:
        """The next batch of every worker as the subscription hands it to the router,
        both ways; ([], [], 0) at the end."""
        if self.pos >= len(self.batches):
            return [], [], 0
        batched, single, events = self._round()
        decode = self._decode_env
        return [decode(r) for r in batched], [decode(r) for r in single], events


def apply_envelopes(core: object, envelopes: list[object]) -> int:
    """What the router's service does per envelope the subscription hands it
    (:meth:`~kvmesh.router.service.KvRouterService._on_envelope`): decode the payload
    once (the decoder checks the events), check the publisher, apply the batch; returns
    the events applied."""
    from kvmesh.kv.events import decode_kv_view

    apply_batch = core.apply_batch  # type: ignore[attr-defined]
    applied = 0
    for env in envelopes:
        batch = decode_kv_view(env.payload)  # type: ignore[attr-defined]
        worker, events = batch.worker_id, batch.events
        if worker == env.publisher_id:  # type: ignore[attr-defined]
            applied += apply_batch(worker, batch.first_event_id, events)[0]
    return applied


def _bind_publishers(ctx, count: int, hwm: int) -> list:  # type: ignore[no-untyped-def,type-arg]
    """``count`` zmq PUB sockets on free loopback ports, send high-water mark ``hwm``."""
    import zmq

    socks = []
    for _ in range(count):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.bind("tcp://127.0.0.1:*")
        socks.append(sock)
    return socks


def _zmq_producer(addresses_out, wire_chunk: list[bytes], publishers: int, go, seconds: float) -> None:  # type: ignore[no-untyped-def]
    """Forked: ``publishers`` zmq PUB sockets (as many workers would have) sending the
    prepared envelopes round-robin, as fast as they go, for ``seconds``."""
    import zmq

    ctx = zmq.Context()
    socks = _bind_publishers(ctx, publishers, 100_000)
    addresses_out.send([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks])
    go.wait()
    deadline = time.perf_counter() + seconds
    i = 0
    n = len(wire_chunk)
    while time.perf_counter() < deadline:
        for sock in socks:
            for _ in range(16):
                try:
                    sock.send(wire_chunk[i % n], zmq.NOBLOCK)
                except zmq.Again:
                    pass
                i += 1
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def zmq_ingest(stream: list[object], shape: Shape, publishers: int, seconds: float) -> dict[str, float]:
    """The live path's own cost per envelope before the router: a real
    :class:`~kvmesh.runtime.event_plane.zmq.ZmqSubscription` (SUB socket, asyncio reader,
    envelope decode, inbox) connected to ``publishers`` PUB sockets of a forked producer
    that sends batched envelopes as fast as it can; CPU time of this thread per envelope
    taken out of the inbox, and per event (envelopes × events per envelope)."""
    import multiprocessing as mp

    from kvmesh.runtime.event_plane.zmq import ZmqEventPlane

    wire, events = WireStream(stream, list(range(1, 101)), shape).chunk(20_000)
    per_envelope = events / len(wire) if wire else 0.0
    ctx = mp.get_context("fork")
    go = ctx.Event()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_zmq_producer, args=(child, wire, publishers, go, seconds + 1.0), daemon=True)
    proc.start()
    try:
        addresses = parent.recv()

        async def consume() -> tuple[int, float, int]:
            plane = ZmqEventPlane("127.0.0.1", secret=None)
            sub = await plane.subscribe("kv_events")
            for address in addresses:
                sub.connect(address)
            await asyncio.sleep(0.5)  # zmq's connections and subscriptions settle before the clock starts
            go.set()
            got = 0
            c0 = time.thread_time()
            deadline = time.perf_counter() + seconds
            async for _ in sub:
                got += 1
                if got & 1023 == 0 and time.perf_counter() > deadline:
                    break
            cpu = time.thread_time() - c0
            dropped = sub.inbox.dropped
            await plane.close()
            return got, cpu, dropped

        got, cpu, dropped = asyncio.run(consume())
    finally:
        proc.join(seconds + 5)
        if proc.is_alive():
            proc.kill()
    rate = got / cpu if cpu else 0.0
    return {
        "envelopes": got,
        "envelopes_per_cpu_s": rate,
        "events_per_envelope": per_envelope,
        "events_per_cpu_s": rate * per_envelope,
        "inbox_dropped": dropped,
    }


def router_capacity(stream: list[object], workers: int, max_seconds: float, shape: Shape, positions: int = 10**9) -> dict[str, float]:
    """One router's ingest rate on this core (CPU time of this thread, so other load on
    the machine does not count): ``workers`` workers' envelopes (:class:`WireStream`)
    through the service's decode, checks and the core, in two arms fed the same events
    in alternating rounds (paired A/B): ``batched`` (one envelope per engine step, what
    workers send) and ``single`` (one event per envelope, the older form), each into its
    own core. Then decision p50/p99 on the batched arm's index."""
    from kvmesh.router.core import KvRouterCore, RouterSettings

    arms: dict[str, dict[str, object]] = {}
    for name in ("batched", "single"):
        core = KvRouterCore(RouterSettings(block_size=16))
        for w in range(1, workers + 1):
            core.add_worker(w)
        arms[name] = {"core": core, "events": 0, "envelopes": 0, "cpu": 0.0}
    wire = WireStream(stream[:positions], list(range(1, workers + 1)), shape)
    deadline = time.perf_counter() + max_seconds
    rounds = 0
    while time.perf_counter() < deadline:
        batched, single, events = wire.opened_round()  # one batch of every worker, both ways
        if not events:
            break
        for arm, envelopes in ((arms["batched"], batched), (arms["single"], single)):
            t0 = time.thread_time()
            apply_envelopes(arm["core"], envelopes)
            arm["cpu"] += time.thread_time() - t0  # type: ignore[operator]  # CPU time: what one core does
            arm["events"] += events  # type: ignore[operator]
            arm["envelopes"] += len(envelopes)  # type: ignore[operator]
        rounds += 1
    core = arms["batched"]["core"]
    times, cpu = [], []
    for i, tokens in enumerate(prompts(shape, 2000, seed=7)):
        t0, c0 = time.perf_counter(), time.thread_time()
        core.route(f"q{i}", tokens, time.monotonic())  # type: ignore[attr-defined]
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        core.finished(f"q{i}", time.monotonic())  # type: ignore[attr-defined]
    out: dict[str, float] = {"rounds": rounds}
    for name, arm in arms.items():
        out[f"{name}_events"] = arm["events"]  # type: ignore[assignment]
        out[f"{name}_envelopes"] = arm["envelopes"]  # type: ignore[assignment]
        out[f"{name}_events_per_cpu_s"] = arm["events"] / arm["cpu"] if arm["cpu"] else 0.0  # type: ignore[operator]
    out.update(
        decision_p50_us=(percentile(times, 50) or 0) * 1e6,
        decision_p99_us=(percentile(times, 99) or 0) * 1e6,
        decision_cpu_p50_us=(percentile(cpu, 50) or 0) * 1e6,
        decision_cpu_p99_us=(percentile(cpu, 99) or 0) * 1e6,
    )
    return out


class _DumpClient:
    """A worker's request-plane client as the shards' repair calls need it: no event
    buffer (a gap is repaired from a dump), and an empty dump."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id

    async def stream(self, endpoint: str, payload: bytes, ctx: object, decode: object = None) -> object:
        from kvmesh.protocol import KvDump, KvEventsSince
        from kvmesh.runtime.names import KV_EVENTS

        answer = KvEventsSince([], False) if endpoint == KV_EVENTS else KvDump(self.worker_id, -1, [])
        raw = msgspec.Raw(msgspec.msgpack.encode(answer))
        yield raw if decode is None else decode(raw)  # type: ignore[operator]

    async def close(self) -> None:
        pass


def _feed_payloads(stream: list[object], workers: list[int], shape: Shape, positions: int) -> list[list[bytes]]:
    """Per batch position, every worker's encoded ``kv_events`` payload (salted as in
    :class:`WireStream`), for the first ``positions`` batches of the busy stream."""
    from kvmesh.protocol import KvEventBatch

    wire = WireStream(stream, workers, shape)
    encode = msgspec.msgpack.Encoder().encode
    out = []
    for b in stream[:positions]:
        row = []
        for w in workers:
            salt = (w * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)
            datas = [wire._salted(d, salt) for d in b.events]  # type: ignore[attr-defined]
            row.append(encode(KvEventBatch(w, b.first_event_id, datas)))  # type: ignore[arg-type,attr-defined]
        out.append(row)
    return out


def _feeder(conn, payloads: list[list[bytes]], workers: list[int], rate: float, go) -> None:  # type: ignore[no-untyped-def]
    """Forked: one zmq PUB socket per worker (as each worker has); sends every worker's
    batch of each position in turn, envelopes spread evenly at ``rate`` per second."""
    import zmq

    from kvmesh.runtime.event_plane.base import Envelope

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
    socks = _bind_publishers(ctx, len(workers), 10_000)
    conn.send([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in socks])
    go.wait()
    encode = msgspec.msgpack.Encoder().encode
    t0 = time.perf_counter()
    sent = dropped = 0
    for seq, row in enumerate(payloads, 1):
        for w, sock, payload in zip(workers, socks, row):
            due = t0 + (sent + dropped) / rate
            ahead = due - time.perf_counter()
            if ahead > 0.001:  # sleep, not spin: this machine's cores are the shards'
                time.sleep(ahead)
            try:
                sock.send(encode(Envelope(w, seq, "kv_events", payload)), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                dropped += 1
    conn.send((sent, dropped))
    conn.recv()  # the shards have drained: close
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def sharded_ingest(stream: list[object], workers: int, shards: int, positions: int, rate: float, shape: Shape) -> dict[str, float]:
    """The product's sharded index (:class:`~kvmesh.router.shards.ShardedKvIndex`, real
    shard processes on real zmq streams) fed ``workers`` busy workers' batches at
    ``rate`` envelopes per second by a forked feeder, while this process decides
    (overlap queries to every shard + the core's selection) every 2 ms."""
    return _with_feeder(stream, workers, positions, rate, shape, lambda feed, go, events: _sharded(feed, go, workers, shards, events, shape))


def _with_feeder(stream: list[object], workers: int, positions: int, rate: float, shape: Shape, body) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Fork a :func:`_feeder` of the first ``positions`` busy batches of ``workers``
    workers at ``rate`` envelopes per second, and run ``body(feed, go, events)`` (a
    coroutine: the feeder's pipe, its start event, the events it will send) to the end."""
    import multiprocessing as mp

    payloads = _feed_payloads(stream, list(range(1, workers + 1)), shape, positions)
    events = sum(len(b.events) for b in stream[:positions]) * workers  # type: ignore[attr-defined]
    ctx = mp.get_context("fork")
    go = ctx.Event()
    parent, child = ctx.Pipe()
    feeder = ctx.Process(target=_feeder, args=(child, payloads, list(range(1, workers + 1)), rate, go), daemon=True)
    feeder.start()
    del payloads
    try:
        return asyncio.run(body(parent, go, events))  # type: ignore[no-any-return]
    finally:
        feeder.join(10)
        if feeder.is_alive():
            feeder.kill()


async def _sharded(feed, go, workers: int, shards: int, events: int, shape: Shape) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from kvmesh.kv.hashing import block_hashes
    from kvmesh.observability.metrics import FrontendMetrics
    from kvmesh.protocol import EngineConfig, InstanceInfo
    from kvmesh.router.core import KvRouterCore, RouterSettings
    from kvmesh.router.shards import Hello, ShardedKvIndex
    from kvmesh.runtime.instances import Instance

    addresses = await asyncio.to_thread(feed.recv)
    index = ShardedKvIndex(shards, FrontendMetrics().model(MODEL).router)
    await index.start(Hello(MODEL, 16, 1 << 22, "127.0.0.1"))
    engine = EngineConfig("mocker", MODEL, 2048, 16, 1024, 8, 1024)
    core = KvRouterCore(RouterSettings(block_size=16))
    for w, address in zip(range(1, workers + 1), addresses):
        index.add_worker(Instance(InstanceInfo(w, "127.0.0.1:1", engine, event_address=address), _DumpClient(w)))  # type: ignore[arg-type]
        core.add_worker(w)
    pids = [s.proc.pid for s in index._shards]
    queries = [block_hashes(p, 16) for p in prompts(shape, 500, seed=7)]
    n_tokens = shape.prefix_tokens + shape.suffix_tokens
    q = 0

    def decide(times: list[float], cpu: list[float]) -> None:
        nonlocal q
        hashes = queries[q % len(queries)]
        t0, c0 = time.perf_counter(), time.thread_time()
        core.route(f"q{q}", [0] * n_tokens, time.monotonic(), block_hashes=hashes, matches=index.find_matches(hashes))
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        core.finished(f"q{q}", time.monotonic())
        q += 1

    try:
        deadline = time.perf_counter() + 60
        while sum(s.stats.dump_repairs for s in index._shards) < workers and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)  # every worker attached (its dump asked for) before the clock starts
        idle_t: list[float] = []
        idle_c: list[float] = []
        for _ in range(300):
            decide(idle_t, idle_c)
            await asyncio.sleep(0.002)
        late0 = index.late
        cpu0 = measure_cpu(pids)
        go.set()
        t0 = time.perf_counter()
        busy_t: list[float] = []
        busy_c: list[float] = []
        backlog: list[int] = []
        feed_s = math.nan
        last, still = -1, time.perf_counter()  # the shards' applied count, and since when it has not moved
        while index.applied < events and time.perf_counter() - t0 < 300:
            decide(busy_t, busy_c)
            backlog.append(sum(s.stats.backlog for s in index._shards))
            await asyncio.sleep(0.002)
            if feed.poll():
                sent, dropped = feed.recv()
                feed_s = time.perf_counter() - t0
            if index.applied != last:
                last, still = index.applied, time.perf_counter()
            elif not math.isnan(feed_s) and time.perf_counter() - still > 1.5:
                break  # fed, and nothing more applied for 3 stats reports: drained (some lost: see gaps)
        wall = (still if index.applied < events else time.perf_counter()) - t0
        cpu = (measure_cpu(pids) - cpu0) / 1000
        feed.send("done")
        applied = index.applied
        return {
            "shards": shards,
            "workers": workers,
            "events_fed": events,
            "events_applied": applied,
            "feed_s": feed_s,
            "ingest_s": wall,
            "events_per_s": applied / wall,
            "events_per_cpu_s_per_shard": applied / cpu if cpu else 0.0,
            "shard_cpu_s": cpu,
            "backlog_max": max(backlog, default=0),
            "dropped": sum(s.stats.dropped for s in index._shards),
            "gaps": sum(s.stats.gaps for s in index._shards),
            "feeder_dropped": locals().get("dropped", 0),
            "late": index.late - late0,
            **_decision_figures(idle_t, busy_t, busy_c),
        }
    finally:
        await index.close()


def _decision_figures(idle: list[float], busy: list[float], busy_cpu: list[float]) -> dict[str, float]:
    """Decision p50/p99 in µs: wall idle and while ingesting, CPU while ingesting."""
    out = {}
    for name, times in (("idle", idle), ("busy", busy), ("busy_cpu", busy_cpu)):
        for q in (50, 99):
            out[f"decision_{name}_p{q}_us"] = (percentile(times, q) or 0) * 1e6
    return out


def one_core_ingest(stream: list[object], workers: int, positions: int, rate: float, shape: Shape) -> dict[str, float]:
    """The frontend's own index at the busy rate: one :class:`~kvmesh.router.service.KvRouterService`
    (its real zmq subscription, connected to one PUB socket per worker; decode, checks,
    core) in this thread, fed ``workers`` busy workers' batches at ``rate`` envelopes per
    second by a forked feeder, while this thread also decides (the
    service's ``route``, the product's decision) every 2 ms. Backlog: envelopes received
    by the subscription and not yet applied (its inbox), sampled at every decision."""
    return _with_feeder(stream, workers, positions, rate, shape, lambda feed, go, events: _one_core(feed, go, workers, events, shape))


async def _one_core(feed, go, workers: int, events: int, shape: Shape) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from kvmesh.observability.metrics import FrontendMetrics
    from kvmesh.protocol import EngineConfig, InstanceInfo, PreprocessedRequest
    from kvmesh.router.core import RouterSettings
    from kvmesh.router.service import KvRouterService
    from kvmesh.runtime.event_plane.zmq import ZmqEventPlane
    from kvmesh.runtime.instances import Instance

    addresses = await asyncio.to_thread(feed.recv)
    plane = ZmqEventPlane("127.0.0.1", secret=None)
    sub = await plane.subscribe("kv_events")
    service = KvRouterService(RouterSettings(block_size=16), sub, FrontendMetrics().model(MODEL).router)
    service.start()
    engine = EngineConfig("mocker", MODEL, 2048, 16, 1024, 8, 1024)
    for w, address in zip(range(1, workers + 1), addresses):
        service.add_worker(Instance(InstanceInfo(w, "127.0.0.1:1", engine, event_address=address), _DumpClient(w)))  # type: ignore[arg-type]
    requests = [PreprocessedRequest(f"p{i}", MODEL, p) for i, p in enumerate(prompts(shape, 500, seed=7))]
    candidates = list(service.workers)
    q = 0

    def decide(times: list[float], cpu: list[float]) -> None:
        nonlocal q
        r = requests[q % len(requests)]
        t0, c0 = time.perf_counter(), time.thread_time()
        service.route(r, candidates)  # the service's own wall/CPU histograms observe it too
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        service.finished(r.request_id)
        q += 1

    def applied() -> int:
        return int(service.metrics.events_applied._value.get())

    try:
        deadline = time.perf_counter() + 60
        while (len(service._last_applied) < workers or service._repairing) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)  # every worker attached (its dump loaded) before the clock starts
        await asyncio.sleep(0.5)  # zmq's connections and subscriptions settle
        idle_t: list[float] = []
        idle_c: list[float] = []
        for _ in range(300):
            decide(idle_t, idle_c)
            await asyncio.sleep(0.002)
        base = applied()
        gaps0 = service.metrics.event_gaps._value.get()
        go.set()
        t0, c0 = time.perf_counter(), time.thread_time()
        busy_t: list[float] = []
        busy_c: list[float] = []
        backlog: list[int] = []
        feed_s = math.nan
        sent = dropped = 0
        done = base
        last, still = -1, time.perf_counter()
        while time.perf_counter() - t0 < 300:
            decide(busy_t, busy_c)
            backlog.append(len(sub.inbox))
            await asyncio.sleep(0.002)
            if feed.poll():
                sent, dropped = feed.recv()
                feed_s = time.perf_counter() - t0
            if len(busy_t) % 16 == 0:
                done = applied()
                if done - base >= events:
                    still = time.perf_counter()
                    break
                if done != last:
                    last, still = done, time.perf_counter()
                elif not math.isnan(feed_s) and time.perf_counter() - still > 1.5:
                    break  # fed, and nothing more applied for 1.5 s: drained (some lost: see gaps)
        wall, cpu = still - t0, time.thread_time() - c0
        feed.send("done")
        n = done - base
        return {
            "workers": workers,
            "events_fed": events,
            "events_applied": n,
            "feed_s": feed_s,
            "ingest_s": wall,
            "events_per_s": n / wall if wall else 0.0,
            "events_per_cpu_s": n / cpu if cpu else 0.0,  # decisions included
            "cpu_share": cpu / wall if wall else 0.0,
            "drain_ms": max(0.0, wall - feed_s) * 1000 if not math.isnan(feed_s) else math.nan,
            "backlog_max": max(backlog, default=0),
            "backlog_mean": sum(backlog) / len(backlog) if backlog else 0.0,
            "dropped": sub.inbox.dropped,
            "gaps": int(service.metrics.event_gaps._value.get() - gaps0),
            "feeder_dropped": dropped,
            "feeder_sent": sent,
            "decisions": len(busy_t),
            **_decision_figures(idle_t, busy_t, busy_c),
        }
    finally:
        await service.close()
        await plane.close()


# ---------------------------------------------------------------------------- the live fleet


@dataclass
class ArmResult:
    workers: int
    processes: int
    shards: int = 1
    registered_s: float = math.nan
    routable_s: float = math.nan
    idle_worker_rss_kb: float = math.nan  # all worker processes' RSS / N
    idle_worker_cpu_ms_per_s: float = math.nan  # per worker
    idle_frontend_cpu_ms_per_s: float = math.nan
    discovery_keys: int = 0
    leases: int = 0
    worker_sockets: dict[str, int] = field(default_factory=dict)
    frontend_sockets: dict[str, int] = field(default_factory=dict)
    frontend_rss_idle_mb: float = math.nan
    frontend_rss_peak_mb: float = math.nan
    frontend_cpu_ms_per_req: float = math.nan
    scrape_cpu_ms: float = math.nan  # the frontend's CPU per GET /metrics (the sampler's, taken out of the above)
    scrapes: int = 0
    requests_ok: int = 0
    errors: int = 0
    req_per_s: float = 0.0
    load_s: float = 0.0
    decision_p50_us: float | None = None
    decision_p99_us: float | None = None
    decision_cpu_p50_us: float | None = None
    decision_cpu_p99_us: float | None = None
    worker_warnings: int = 0
    decisions: int = 0
    events_per_s: float = 0.0
    events_applied: int = 0
    gaps: int = 0
    dropped: int = 0
    backlog_max: int = 0
    backlog_mean: float = 0.0
    drain_ms: float = math.nan
    error_samples: list[str] = field(default_factory=list)


class Fleet:
    """The services and processes of one run; everything stopped by PID in close()."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.stack = contextlib.ExitStack()
        from tests.services import etcd_server, nats_server

        self.frontend_port = 0
        self.etcd = self.stack.enter_context(etcd_server())
        self.nats = self.stack.enter_context(nats_server())

    def env(self, namespace: str) -> dict[str, str]:
        return dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
            KVMESH_DISCOVERY="etcd",
            KVMESH_ETCD_ENDPOINTS=self.etcd.endpoint,
            KVMESH_NATS_URL=self.nats.url,
            KVMESH_REQUEST_PLANE=self.args.request_plane,
            KVMESH_EVENT_PLANE=self.args.event_plane,
            KVMESH_HOST="127.0.0.1",
            KVMESH_NAMESPACE=namespace,
            KVMESH_LEASE_TTL=str(self.args.lease_ttl),
        )

    def spawn(
        self, name: str, args: list[str], env: dict[str, str], nice: int = 0, idle: bool = False
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """Start ``kvmesh ARGS`` at niceness ``nice`` (the whole process, its threads
        included; 0 also when this process runs at another niceness), in ``SCHED_IDLE``
        if ``idle`` (else ``SCHED_OTHER``, also when this process runs idle)."""
        path = self.workdir / f"{name}.log"
        with open(path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvmesh.cli.main", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=lambda: _set_priority(nice, idle),  # noqa: PLW1509 - nothing but the scheduler calls run there
            )  # fmt: skip
        return proc, path

    def close(self) -> None:
        self.stack.close()

    def etcd_count(self, *args: str) -> int:
        return len([line for line in self.etcd.etcdctl(*args).splitlines() if line.strip()])


def _set_priority(value: int, idle: bool = False) -> None:
    """This thread (and the threads and processes it starts) at niceness ``value``
    (lowering it needs root; without, it stays), in the ``SCHED_IDLE`` class if ``idle``
    (it runs only when no normal task wants the core, and never preempts one), else in
    ``SCHED_OTHER``."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, value)


def _ready_count(path: Path) -> int:
    return path.read_bytes().count(b"KVMESH_READY ")


def _models(url: str) -> int:
    try:
        return int(json.loads(http_get(url + "/health", 2.0))["models"].get(MODEL, 0))
    except Exception:  # noqa: BLE001 - not up yet
        return 0


def _wait(predicate, timeout: float, what: str, procs: list[subprocess.Popen[bytes]]) -> float:
    t0 = time.perf_counter()
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {p.returncode}")
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def run_arm(fleet: Fleet, n: int, procs_n: int, shape: Shape, shards: int = 1) -> ArmResult:
    args = fleet.args
    res = ArmResult(n, procs_n, shards)
    ns = f"fleet{n}x{procs_n}s{shards}"
    env = fleet.env(ns)
    port = fleet.frontend_port = free_port()
    url = f"http://127.0.0.1:{port}"
    frontend, flog = fleet.spawn(
        f"{ns}-frontend",
        ["frontend", "--http-port", str(port), "--router-mode", "kv", "--canary-interval", str(args.canary_interval),
         "--worker-wait", "30", "--router-shards", str(shards)],
        env, nice=args.frontend_nice,
    )  # fmt: skip
    workers: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        _wait(lambda: _try_get(url + "/metrics"), 60, "frontend up", [frontend])
        res.frontend_rss_idle_mb = read_mem(frontend.pid)["rss_kb"] / 1024
        per = [n // procs_n + (1 if i < n % procs_n else 0) for i in range(procs_n)]
        t0 = time.perf_counter()
        for i, k in enumerate(per):
            w_args = ["worker", "--replicas", str(k), "--speedup", str(args.speedup), "--grace", "2"]
            proc, path = fleet.spawn(f"{ns}-workers{i}", w_args, env, nice=args.worker_nice, idle=args.background == "idle")
            workers.append(proc)
            logs.append(path)
        everyone = [frontend, *workers]
        _wait(lambda: sum(_ready_count(p) for p in logs) >= n, args.start_timeout, "all READY", everyone)
        res.registered_s = time.perf_counter() - t0
        _wait(lambda: _models(url) >= n, args.start_timeout, "all routable", everyone)
        res.routable_s = time.perf_counter() - t0
        log(f"{n} workers: registered in {res.registered_s:.1f} s, routable in {res.routable_s:.1f} s")
        _idle(fleet, res, frontend, workers, ns)
        asyncio.run(_load(res, url, frontend, shape, args))
        log(
            f"{n} workers: {res.requests_ok} ok, {res.errors} errors, {res.req_per_s:.0f} req/s, decision p99 "
            f"{res.decision_p99_us} us, {res.events_per_s:.0f} events/s, backlog max {res.backlog_max}"
        )
    finally:
        for proc in workers:
            stop_process(proc, 20.0)
        stop_process(frontend, 20.0)
        res.worker_warnings = sum(p.read_bytes().count(b" WARNING ") + p.read_bytes().count(b" ERROR ") for p in logs)
    return res


def _drain_ms(url: str) -> float:
    """From the end of the load until the router applied its last KV event: its lag
    behind the workers (0 when nothing was left to apply). Polls every 10 ms until the
    count is the same for 0.5 s."""
    name = "kvmesh_router_kv_events_applied_total"
    t0 = time.perf_counter()
    last, changed = metric(scrape(url), name), t0
    while time.perf_counter() - changed < 0.5:
        time.sleep(0.01)
        now = metric(scrape(url), name)
        if now != last:
            last, changed = now, time.perf_counter()
    return (changed - t0) * 1000


def _try_get(url: str) -> bool:
    try:
        http_get(url, 1.0)
        return True
    except Exception:  # noqa: BLE001
        return False


def _idle(fleet: Fleet, res: ArmResult, frontend: subprocess.Popen[bytes], workers: list[subprocess.Popen[bytes]], ns: str) -> None:
    n = res.workers
    pids = [p.pid for p in workers]
    time.sleep(1.0)  # the last attachments settle (dump repairs); this is a measurement window, not a sync
    window = fleet.args.idle_seconds
    w0, f0 = measure_cpu(pids), measure_cpu(frontend.pid)
    time.sleep(window)
    w1, f1 = measure_cpu(pids), measure_cpu(frontend.pid)
    res.idle_worker_cpu_ms_per_s = (w1 - w0) / window / n
    res.idle_frontend_cpu_ms_per_s = (f1 - f0) / window
    res.idle_worker_rss_kb = read_mem(pids)["rss_kb"] / n
    res.discovery_keys = fleet.etcd_count("get", "--prefix", "--keys-only", f"/services/{ns}/")
    res.leases = max(0, fleet.etcd_count("lease", "list") - 1)  # minus the "found N leases" line
    ports = {"etcd": fleet.etcd.client_port, "nats": fleet.nats.port}
    res.worker_sockets = connections(pids, ports)
    res.frontend_sockets = connections([frontend.pid], ports)
    url = f"http://127.0.0.1:{fleet.frontend_port}"
    c0 = measure_cpu(frontend.pid)
    scrapes = 20 if n <= 1000 else 3
    for _ in range(scrapes):
        scrape(url)
    res.scrape_cpu_ms = (measure_cpu(frontend.pid) - c0) / scrapes


async def _load(res: ArmResult, url: str, frontend: subprocess.Popen[bytes], shape: Shape, args: argparse.Namespace) -> None:
    before = await asyncio.to_thread(scrape, url)
    backlog: list[float] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            s = await asyncio.to_thread(scrape, url)
            backlog.append(metric(s, "kvmesh_router_kv_event_backlog"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)  # a scrape lists every worker: ~0.2 s of CPU at 1,000

    sampler = asyncio.ensure_future(sample())
    t0 = time.perf_counter()
    cpu0 = measure_cpu(frontend.pid)
    try:
        load = await run_load_async(
            url, MODEL, args.concurrency, args.requests, prompt_tokens=shape.prefix_tokens + shape.suffix_tokens,
            output_tokens=shape.output_tokens, warmup=args.concurrency, max_seconds=args.max_seconds,
            shared_prefix_tokens=shape.prefix_tokens, prefix_groups=shape.groups, seed=res.workers,
            frontend_pid=frontend.pid, include_descendants=False,
        )  # fmt: skip
    finally:
        stop.set()
        await sampler
    res.load_s = time.perf_counter() - t0
    cpu = measure_cpu(frontend.pid) - cpu0
    res.scrapes = len(backlog)
    # a GET /metrics lists every worker's series: at 1,000 workers its cost is not the requests'
    if load.completed_total:
        res.frontend_cpu_ms_per_req = max(0.0, cpu - res.scrapes * res.scrape_cpu_ms) / load.completed_total
    res.drain_ms = await asyncio.to_thread(_drain_ms, url)
    after = await asyncio.to_thread(scrape, url)
    res.requests_ok = load.ok
    res.errors = load.failures
    res.error_samples = load.errors[:3]
    res.req_per_s = load.req_per_s
    res.frontend_rss_peak_mb = (load.frontend_rss_peak_kb or 0) / 1024
    name = "kvmesh_router_decision_seconds"
    for q, attr in ((0.5, "decision_p50_us"), (0.99, "decision_p99_us")):
        v = histogram_quantile(before, after, name, q)
        setattr(res, attr, None if v is None else round(v * 1e6, 1))
        v = histogram_quantile(before, after, "kvmesh_router_decision_cpu_seconds", q)
        setattr(res, attr.replace("decision", "decision_cpu"), None if v is None else round(v * 1e6, 1))
    res.decisions = int(metric(after, name + "_count") - metric(before, name + "_count"))
    applied = metric(after, "kvmesh_router_kv_events_applied_total") - metric(before, "kvmesh_router_kv_events_applied_total")
    res.events_applied = int(applied)
    res.events_per_s = applied / res.load_s if res.load_s else 0.0
    res.gaps = int(metric(after, "kvmesh_router_kv_event_gaps_total") - metric(before, "kvmesh_router_kv_event_gaps_total"))
    res.dropped = int(metric(after, "kvmesh_router_kv_events_dropped") - metric(before, "kvmesh_router_kv_events_dropped"))
    res.backlog_max = int(max(backlog, default=0))
    res.backlog_mean = sum(backlog) / len(backlog) if backlog else 0.0


# ---------------------------------------------------------------------------- report


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def print_table(arms: list[ArmResult]) -> None:
    rows = [
        ("workers (processes)", lambda a: f"{a.workers} ({a.processes})"),
        ("index shards", lambda a: str(a.shards)),
        ("registered s", lambda a: _f(a.registered_s)),
        ("discovered+routable s", lambda a: _f(a.routable_s)),
        ("idle RSS / worker KiB", lambda a: _f(a.idle_worker_rss_kb, "{:.0f}")),
        ("idle CPU / worker ms/s", lambda a: _f(a.idle_worker_cpu_ms_per_s, "{:.3f}")),
        ("idle frontend CPU ms/s", lambda a: _f(a.idle_frontend_cpu_ms_per_s)),
        ("discovery keys / leases", lambda a: f"{a.discovery_keys} / {a.leases}"),
        ("worker sockets (listening)", lambda a: f"{a.worker_sockets.get('sockets', 0)} ({a.worker_sockets.get('listening', 0)})"),
        ("worker conns etcd / nats", lambda a: f"{a.worker_sockets.get('etcd', 0)} / {a.worker_sockets.get('nats', 0)}"),
        ("frontend sockets", lambda a: str(a.frontend_sockets.get("sockets", 0))),
        ("frontend RSS idle/peak MiB", lambda a: f"{_f(a.frontend_rss_idle_mb, '{:.0f}')} / {_f(a.frontend_rss_peak_mb, '{:.0f}')}"),
        ("frontend CPU ms/req", lambda a: _f(a.frontend_cpu_ms_per_req, "{:.2f}")),
        ("frontend CPU ms per /metrics", lambda a: _f(a.scrape_cpu_ms, "{:.1f}")),
        ("requests ok / errors", lambda a: f"{a.requests_ok} / {a.errors}"),
        ("req/s", lambda a: _f(a.req_per_s)),
        ("decision p50 / p99 us", lambda a: f"{_f(a.decision_p50_us)} / {_f(a.decision_p99_us)}"),
        ("decision CPU p50 / p99 us", lambda a: f"{_f(a.decision_cpu_p50_us)} / {_f(a.decision_cpu_p99_us)}"),
        ("KV events applied/s", lambda a: _f(a.events_per_s, "{:.0f}")),
        ("gaps / dropped", lambda a: f"{a.gaps} / {a.dropped}"),
        ("event backlog max / mean", lambda a: f"{a.backlog_max} / {a.backlog_mean:.1f}"),
        ("events applied after load ms", lambda a: _f(a.drain_ms)),
        ("worker log warnings", lambda a: str(a.worker_warnings)),
    ]
    width = max(len(r[0]) for r in rows)
    cols = [[fn(a) for a in arms] for _, fn in rows]
    cw = max([len(c) for col in cols for c in col] + [8])
    print()
    print("| " + "metric".ljust(width) + " | " + " | ".join(f"arm {i + 1}".ljust(cw) for i in range(len(arms))) + " |")
    print("|" + "-" * (width + 2) + "|" + "|".join("-" * (cw + 2) for _ in arms) + "|")
    for (name, _), col in zip(rows, cols):
        print("| " + name.ljust(width) + " | " + " | ".join(c.ljust(cw) for c in col) + " |")


def parse_arms(text: str) -> list[tuple[int, int, int]]:
    """``NxP`` or ``NxPsS``: N workers in P processes, the frontend's index in S shard processes (default 1)."""
    arms = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        n, _, rest = part.strip().partition("x")
        p, _, s = rest.partition("s")
        arms.append((int(n), int(p or 1), int(s or 1)))
    return arms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="10x1,100x4,1000x4",
                    help="NxP[sS]: N workers in P processes[, the index in S shards] (default %(default)s)")
    ap.add_argument("--request-plane", default="tcp", choices=["tcp", "nats"])
    ap.add_argument("--event-plane", default="zmq", choices=["zmq", "nats"])
    ap.add_argument("--speedup", type=float, default=1e4, help="mocker speedup of the live workers")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=10000,
                    help="measured requests per arm (after --concurrency warm-up; 10,000: a p99 from 100 samples past it)")
    ap.add_argument("--max-seconds", type=float, default=30.0, help="load time limit per arm")
    ap.add_argument("--prefix-tokens", type=int, default=192)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--prefix-groups", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--busy-output-tokens", type=int, default=128, help="outputs of the busy-worker event rate")
    ap.add_argument("--busy-sim-seconds", type=float, default=20.0)
    ap.add_argument("--capacity-seconds", type=float, default=90.0, help="wall time limit of the paired ingest A/B")
    ap.add_argument("--one-core", action=argparse.BooleanOptionalAction, default=True,
                    help="feed the frontend's own index (one thread) at the busy rate over zmq while deciding")
    ap.add_argument("--shards", default="2", help="shard counts of the sharded-ingest run (default %(default)s; '' skips it)")
    ap.add_argument("--shard-positions", type=int, default=80,
                    help="busy batches per worker (engine steps, from the start) fed to the A/B and to the shards")
    ap.add_argument("--worker-nice", type=int, default=10,
                    help="niceness of the live arms' worker processes (they stand for other machines)")
    ap.add_argument("--frontend-nice", type=int, default=0,
                    help="niceness of the frontend (and its index shards); below 0 needs root: for a machine where other"
                    " users' processes run at a raised priority")
    ap.add_argument("--client-nice", type=int, default=5,
                    help="niceness of this process during the arms: the load client (it stands for remote clients)")
    ap.add_argument("--background", default="idle", choices=["idle", "nice"],
                    help="idle: the worker processes and the load client run in the SCHED_IDLE class (they stand for other"
                    " machines: they take a core only when the frontend does not want it, and never preempt it); nice: at"
                    " --worker-nice / --client-nice in SCHED_OTHER (they may preempt the frontend mid-decision)")
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--canary-interval", type=float, default=0.0, help="the frontend's canary checks per worker, s (0: off)")
    ap.add_argument("--lease-ttl", type=float, default=10.0, help="the workers' lease TTL, s (kvmesh's default 10)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--logs", default=None, help="keep the processes' logs in this folder (default: a temporary one)")
    args = ap.parse_args()

    shape = Shape(args.prefix_tokens, args.suffix_tokens, args.prefix_groups, args.output_tokens)
    busy_shape = Shape(args.prefix_tokens, args.suffix_tokens, args.prefix_groups, args.busy_output_tokens)
    log("busy-worker event rate (mocker at speedup 1, virtual clock)")
    busy, stream = busy_worker_rate(busy_shape, args.busy_sim_seconds)
    need = busy["kv_events_per_s"] * BUSY_WORKERS
    log(f"router ingest capacity: {BUSY_WORKERS} workers' streams through one router (batched vs single, paired)")
    cap = router_capacity(stream, BUSY_WORKERS, args.capacity_seconds, shape, args.shard_positions)
    log("the zmq subscription alone (a SUB socket on 100 publishers)")
    zq = zmq_ingest(stream, shape, 100, 3.0)
    one_core = None
    if args.one_core:
        log(f"the frontend's own index (one thread) fed {BUSY_WORKERS} workers' batches at the busy rate over zmq")
        rate = busy["kv_envelopes_per_s"] * BUSY_WORKERS
        one_core = one_core_ingest(stream, BUSY_WORKERS, args.shard_positions, rate, busy_shape)
    sharded = []
    for n_shards in (int(x) for x in args.shards.split(",") if x.strip()):
        log(f"the sharded index: {n_shards} shard processes fed {BUSY_WORKERS} workers' batches at the busy rate")
        rate = busy["kv_envelopes_per_s"] * BUSY_WORKERS
        sharded.append(sharded_ingest(stream, BUSY_WORKERS, n_shards, args.shard_positions, rate, busy_shape))
    results: list[ArmResult] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-fleet-") as tmp:
        if args.logs:
            tmp = args.logs
            Path(tmp).mkdir(parents=True, exist_ok=True)
        fleet = Fleet(args, Path(tmp))
        _set_priority(args.client_nice, args.background == "idle")  # after etcd and nats-server started: the load client's
        try:
            for n, p, s in parse_arms(args.arms):
                log(f"arm: {n} workers in {p} processes, index in {'the frontend' if s == 1 else f'{s} shards'}")
                try:
                    results.append(run_arm(fleet, n, p, shape, s))
                except (RuntimeError, TimeoutError) as exc:
                    log(f"arm {n}x{p}s{s} failed: {exc}; logs kept in {tmp} until the end of the run")
                    results.append(ArmResult(n, p, s, error_samples=[str(exc)]))
        finally:
            fleet.close()
    others = (
        "SCHED_IDLE" if args.background == "idle" else f"nice {args.worker_nice}",
        "SCHED_IDLE" if args.background == "idle" else f"nice {args.client_nice}",
    )
    print(f"\nkvmesh fleet: one frontend (kv router, SCHED_OTHER nice {args.frontend_nice}) + mocker workers ({others[0]}),"
          f" load client {others[1]}; planes: discovery etcd, request {args.request_plane},"
          f" events {args.event_plane}; load: {args.concurrency} streams, {shape.groups} prefixes of {shape.prefix_tokens}"
          f" + {shape.suffix_tokens} unique tokens, {shape.output_tokens} out, mocker speedup {args.speedup:g}")
    if args.background == "idle":
        print("  (workers and client stand for other machines: in SCHED_IDLE they use the cores the frontend leaves and"
              " never preempt it, as if the frontend had its own core; --background nice for the nice-only setting)")
    print_table(results)
    print(
        "  event backlog: KV event envelopes (one engine step's events each) the frontend's subscription received and"
        " the router had not applied yet (kvmesh_router_kv_event_backlog), sampled once a second during the load;"
        " events applied after load: how long after the last request the router still applied events (0: none left)"
    )
    print(
        f"\nbusy worker (max_num_seqs={busy['max_num_seqs']} in flight, {busy_shape.output_tokens} tokens out, modelled speed):"
        f" {busy['kv_events_per_s']:.0f} KV events/s, {busy['requests_per_s']:.1f} req/s per worker"
        f" -> {BUSY_WORKERS:,} busy workers produce {need:,.0f} KV events/s"
    )
    apply_rate, zmq_rate = cap["batched_events_per_cpu_s"], zq["events_per_cpu_s"]
    per_core = 1 / (1 / apply_rate + 1 / zmq_rate) if apply_rate and zmq_rate else 0.0
    print(
        f"  one engine step per envelope: {busy['events_per_envelope']:.0f} events, {busy['payload_bytes_mean'] / 1024:.1f} KiB"
        f" -> {busy['kv_envelopes_per_s'] * BUSY_WORKERS:,.0f} envelopes/s from {BUSY_WORKERS:,} busy workers"
    )
    print(
        f"one router core, {BUSY_WORKERS:,} workers' streams, their first {cap['rounds']} engine steps each (paired A/B,"
        f" CPU time): decode + apply"
        f" {apply_rate:,.0f} events/CPU-s batched vs {cap['single_events_per_cpu_s']:,.0f} one event per envelope"
        f" (x{apply_rate / cap['single_events_per_cpu_s'] if cap['single_events_per_cpu_s'] else math.nan:.2f});"
        f" its zmq subscription {zq['envelopes_per_cpu_s']:,.0f} envelopes/CPU-s = {zmq_rate:,.0f} events/CPU-s"
        f" -> {per_core:,.0f} events per core; decision on that index p50/p99 wall {cap['decision_p50_us']:.0f}/"
        f"{cap['decision_p99_us']:.0f} us, CPU {cap['decision_cpu_p50_us']:.0f}/{cap['decision_cpu_p99_us']:.0f} us"
    )
    ratio = need / per_core if per_core else math.nan
    print(
        f"-> busy rate / one core's ingest = {need:,.0f} / {per_core:,.0f} = {ratio:.2f}:"
        + (" one router core keeps up with margin (<= 0.8); past that, the index sharded by worker"
           " (kvmesh frontend --router-shards), measured below" if ratio <= 0.8 else
           f" one core does not keep up with margin; the index sharded by worker over >= {math.ceil(ratio / 0.8)}"
           " processes (kvmesh frontend --router-shards) does:")
    )
    if one_core is not None:
        r = one_core
        print(
            f"the frontend's own index at the busy rate (one KvRouterService, its zmq subscription, {r['workers']:,} workers"
            f" fed {r['events_fed']:,} events at {need:,.0f}/s in {r['feed_s']:.1f} s by a forked feeder):"
            f" applied {r['events_applied']:,} in {r['ingest_s']:.1f} s = {r['events_per_s']:,.0f} events/s, the thread"
            f" busy {r['cpu_share']:.0%} of the time (decisions included); backlog (envelopes received, not yet applied)"
            f" max {r['backlog_max']} mean {r['backlog_mean']:.1f}, {_f(r['drain_ms'], '{:.0f}')} ms to drain after the"
            f" feed; dropped {r['dropped']} at the inbox, {r['feeder_dropped']} by the feeder's sockets, {r['gaps']} gaps"
            + (" (kept up);" if not (r["dropped"] or r["gaps"] or r["feeder_dropped"]) else
               " (fell behind: the bench's stand-in workers answer a repair with an empty dump);")
            + f" decision (service.route, every 2 ms) p50/p99 {r['decision_busy_p50_us']:.0f}/{r['decision_busy_p99_us']:.0f}"
            f" us wall, CPU {r['decision_busy_cpu_p50_us']:.0f}/{r['decision_busy_cpu_p99_us']:.0f} us while ingesting"
            f" ({r['decision_idle_p50_us']:.0f}/{r['decision_idle_p99_us']:.0f} us idle)"
        )
    for r in sharded:
        print(
            f"  --router-shards {r['shards']} (real shard processes, zmq, {r['workers']:,} workers fed"
            f" {r['events_fed']:,} events at the busy rate in {r['feed_s']:.1f} s): applied {r['events_applied']:,} in"
            f" {r['ingest_s']:.1f} s = {r['events_per_s']:,.0f} events/s, {r['events_per_cpu_s_per_shard']:,.0f} events per"
            f" shard CPU-s; backlog max {r['backlog_max']} envelopes, dropped {r['dropped']} at the inboxes and"
            f" {r['feeder_dropped']} by the feeder's sockets, {r['gaps']} gaps (repaired from dumps); decision (queries to every"
            f" shard + selection) p50/p99 {r['decision_idle_p50_us']:.0f}/{r['decision_idle_p99_us']:.0f} us idle,"
            f" {r['decision_busy_p50_us']:.0f}/{r['decision_busy_p99_us']:.0f} us (CPU p99"
            f" {r['decision_busy_cpu_p99_us']:.0f}) while ingesting; late answers {r['late']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"busy": busy, "capacity": cap, "one_core": one_core, "sharded": sharded, "arms": [asdict(a) for a in results]},
            indent=2,
        ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
