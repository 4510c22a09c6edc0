"""Disaggregated vs aggregated serving: goodput under a TTFT and an inter-token SLO on
the Mooncake conversation trace, with the same number of mocker workers, the ratio
measured in the same run (issue 6).

    python bench/disagg.py                                  # defaults below, a few minutes
    python bench/disagg.py --limit 40 --splits 2+2 --max-wall-s 20 --json out.json

**Arms.** Every arm replays the same requests (the first ``--limit`` of the trace
from ``--start-ms``) on ``--workers`` mocker workers, all with the same options, in
one process and one event loop on the real clock:

* ``aggregated``: every worker prefills and decodes its own requests;
* ``disagg D+P`` (one arm per ``--splits`` entry): D decode workers, each a
  :class:`~kvmesh.disagg.engine.DisaggEngine` in mode ``decode`` with its
  :class:`~kvmesh.disagg.transfer.KvTransferServer` on 127.0.0.1, one
  :class:`~kvmesh.disagg.queue.LocalPrefillQueue`, and P
  :class:`~kvmesh.disagg.prefill.PrefillWorker` s moving KV over the real
  :class:`~kvmesh.disagg.transfer.TcpKvConnector` (loopback). Conditional
  disaggregation with ``--max-local-prefill-length`` / ``--max-prefill-queue-size``
  (the seed's 1000 tokens and 2 jobs by default).

Requests reach workers (decode workers in a disaggregated arm) through the same
router in every arm: ``--router kv`` (default; :class:`~kvmesh.router.core.KvRouterCore`
fed by the workers' KV events, as in ``kvmesh replay``) or ``round_robin``.

**Workers** (defaults, all flags): the mocker's timing model as it ships; 64-token
blocks × 24,576 = 1.57M tokens of KV per worker and 64 KiB of KV per token (an
8B-class model with an FP8 KV cache on a ~140 GB GPU); KV moves at 25 GB/s (a
200 Gb/s NIC). The pool size matters: a decode pass costs more as the worker's KV
fills up (5.7 ms empty, 34 ms full), so putting every decode on D < N workers
raises their ITL; a small pool penalises disaggregation more.

**Clocks.** Everything is stated in *model time*, the modelled GPU's time: the
mocker divides each step's modelled duration by ``--speedup``, so a wall-clock
interval × speedup is model time. Arrivals are the trace's timestamps divided by
``--speed`` in model time (``--speed 2``: twice the trace's request rate), i.e. sent
at ``timestamp / speed / speedup`` wall seconds. The mocker's step model charges a
pass ``prefill_ms(new tokens) + decode_ms(KV usage)``: in an aggregated worker a
pass that carries an 8192-token prefill chunk (~170 ms) delays the next token of
every request decoding in it, which is what disaggregation removes. The defaults
(``--speed 1.5``: ~4 requests/s of ~14k-token prompts, ~1.1 worker-seconds of
prefill per second; ``--speedup 2``) keep a decode pass ≥ ~3 ms of wall time, so
the event loop's lag on a busy 2-core machine stays a small part of each pass;
the whole run takes about 3 minutes.

**Per request** (model ms): TTFT = first token − arrival; mean inter-token latency
ITL = (last token − first token) / (tokens − 1) (a request with one token meets any
ITL SLO). Tokens that reach the client merged in one chunk share its receive time,
which is why ITL is the per-request mean and not the individual gaps.

**SLOs and goodput.** Goodput = requests that completed and met *both* SLOs ÷ the
arrival window, in requests per model second. The window is the same in every arm:
the model time the requests arrive over, last − first arrival, × N/(N−1) (one mean
gap more, so N requests cover N gaps); if they all arrive at once, the arm's own
first arrival → last completion. So the goodput ratio is the ratio of requests
served within the SLOs, at the same offered load. The defaults are fixed in advance
from the timing model, not read off a run (``--slo-ttft-ms``, ``--slo-itl-ms``):

* **mean ITL ≤ 35 ms.** A decode-only pass costs ``decode_ms(KV usage)`` = 5.7 ms
  with an empty KV pool and at most 34 ms with a full one. A request whose mean
  gap exceeds 35 ms therefore lost time to prefill work sharing its passes (an
  8192-token chunk adds ~170 ms to a pass) or to preemption: exactly the
  interference disaggregation exists to remove. (~30 tokens/s per user.)
* **TTFT ≤ 2,000 ms.** The trace's prompts average ~13k tokens (up to ~120k); a
  13k-token prefill alone takes ~0.25 s of model time, a 64k one ~1.4 s, so 2 s
  leaves several prefills' worth of queueing and the KV transfer for typical
  prompts, and only the rare >90k-token prompts cannot make it in any arm.

After the main ratio the same samples are judged under neighbouring SLOs (ITL 15 to
100 ms, TTFT 1 to 5 s), to show how much the ratio owes to the SLO choice.

**Printed per arm:** requests (completed/sent), requests meeting each SLO and both,
goodput, TTFT and ITL p50/p99 (completed requests), prefills done remotely vs
locally (and how many locals the queue-size threshold forced), the prefill queue's
largest depth, the KV bytes the prefill workers moved (modelled bytes: reads of
prefix hits + writes of new blocks), wall time and the event loop's lag p99 (a
check that the process kept up with the clock: lag × speedup is model-time error).
Then goodput ratios disaggregated / aggregated and the best split.

Bounded: at most ``--limit`` requests (≤ 5,000) per arm, each arm stops after
``--max-wall-s`` (unfinished requests count as failed), ``--repeat`` ≤ 10 rounds.
With ``--repeat`` > 1 the arms run alternately (agg, splits..., agg, ...) and the
summary uses each arm's median goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvmesh.disagg.engine import DisaggEngine
from kvmesh.disagg.prefill import KvMetadataCache, PrefillWorker
from kvmesh.disagg.queue import LocalPrefillQueue
from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector
from kvmesh.engines.base import Engine
from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.errors import KvmeshError
from kvmesh.protocol import DisaggThresholds, KvEndpoint, LoadReport, OutputChunk, PrefillJob, PreprocessedRequest
from kvmesh.replay.policies import ReplayPolicy, make_policy
from kvmesh.replay.report import percentile
from kvmesh.replay.trace import TokenSynth, TraceError, load_trace
from kvmesh.runtime.context import Context
from kvmesh.runtime.events import CallbackPublisher

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MAX_REQUESTS = 5000
MAX_REPEAT = 10
LAG_PERIOD_S = 0.005


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class BenchConfig:
    """One bench run; ``splits`` are (decode, prefill) worker counts, each summing to ``workers``."""

    trace: str = str(DEFAULT_TRACE)
    limit: int = 200
    start_ms: float = 0.0
    speed: float = 1.5
    speedup: float = 2.0
    workers: int = 4
    splits: tuple[tuple[int, int], ...] = ((3, 1), (2, 2))
    router: str = "kv"
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 35.0
    thresholds: DisaggThresholds = field(default_factory=DisaggThresholds)
    block_size: int = 64
    num_blocks: int = 24576
    kv_bytes_per_token: int = 65536
    kv_bandwidth: float = 25e9
    max_wall_s: float = 120.0
    repeat: int = 2
    racy_queue: bool = False  # A/B of issue 16's fixes: the bound checked, then an unconditional put
    pipeline: bool = True  # prefill workers overlap a job's KV write with the next job's compute

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_REQUESTS:
            raise ValueError(f"--limit must be in 1..{MAX_REQUESTS}, got {self.limit}")
        if not 1 <= self.repeat <= MAX_REPEAT:
            raise ValueError(f"--repeat must be in 1..{MAX_REPEAT}, got {self.repeat}")
        for name in ("speed", "speedup", "slo_ttft_ms", "slo_itl_ms", "max_wall_s", "kv_bandwidth"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if self.workers < 2:
            raise ValueError(f"--workers must be at least 2, got {self.workers}")
        for d, p in self.splits:
            if d < 1 or p < 1 or d + p != self.workers:
                raise ValueError(f"split {d}+{p}: needs decode >= 1, prefill >= 1, decode + prefill = {self.workers}")
        if self.router not in ("kv", "round_robin"):
            raise ValueError(f"--router must be kv or round_robin, got {self.router!r}")

    def mocker(self, context_length: int) -> MockerOptions:
        return MockerOptions(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            speedup=self.speedup,
            context_length=context_length,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_bandwidth=self.kv_bandwidth,
        )


def parse_split(text: str) -> tuple[int, int]:
    """``"2+2"`` → (2 decode, 2 prefill)."""
    d, sep, p = text.partition("+")
    if not sep or not d.strip().isdigit() or not p.strip().isdigit():
        raise ValueError(f"a split is DECODE+PREFILL, e.g. 2+2, got {text!r}")
    return int(d), int(p)


# ---------------------------------------------------------------------------- per request


@dataclass(slots=True)
class Sample:
    """One request as the client saw it; times in model milliseconds since the arm began."""

    request_id: str
    arrival_ms: float = math.nan
    first_ms: float | None = None
    last_ms: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_ms is None else self.first_ms - self.arrival_ms

    @property
    def itl_ms(self) -> float | None:
        """Mean gap between tokens; None with fewer than two tokens."""
        if self.tokens < 2 or self.first_ms is None or self.last_ms is None:
            return None
        return (self.last_ms - self.first_ms) / (self.tokens - 1)


def meets(s: Sample, slo_ttft_ms: float, slo_itl_ms: float) -> tuple[bool, bool]:
    """(TTFT within its SLO, ITL within its SLO); both False unless the request completed."""
    if not s.completed or s.ttft_ms is None:
        return False, False
    itl = s.itl_ms
    return s.ttft_ms <= slo_ttft_ms, itl is None or itl <= slo_itl_ms


# ---------------------------------------------------------------------------- fleets


def _drop_load(_report: LoadReport) -> None:
    pass


class _RacyQueue(LocalPrefillQueue):
    """``--racy-queue``: the queue as it was before the atomic bound: a decode worker
    checks the depth it read, then puts whatever the queue holds by now."""

    async def offer(self, job: PrefillJob, limits: DisaggThresholds | None = None) -> bool:
        await asyncio.sleep(0)  # the status → put round trip other decode workers can run in
        await self.put(job)
        return True


class Fleet:
    """The workers of one arm behind the router. Lifecycle: ``start``, then
    ``generate`` per request (concurrently), then ``close`` once."""

    name = ""
    layout = ""

    def __init__(self, policy: ReplayPolicy, engines: Sequence[Engine]) -> None:
        self.policy = policy
        self.engines = list(engines)

    async def start(self) -> None:
        for engine in self.engines:
            await engine.start()

    def generate(self, request: PreprocessedRequest, ctx: Context, now_ms: float) -> AsyncIterator[OutputChunk]:
        return self.engines[self.policy.route(request, now_ms)].generate(request, ctx)

    async def close(self) -> None:
        for engine in self.engines:
            await engine.cleanup()

    def counters(self, requests: int) -> dict[str, int]:
        return {"remote_prefills": 0, "local_prefills": requests, "local_by_queue": 0, "remote_fallbacks": 0,
                "prefill_jobs_failed": 0, "queue_max": 0, "kv_bytes": 0}  # fmt: skip


def _routed_engine(options: MockerOptions, worker_id: int, policy: ReplayPolicy) -> MockerEngine:
    publisher = CallbackPublisher(policy.on_kv_event, _drop_load)
    return MockerEngine(replace(options, worker_id=worker_id), publisher)


def aggregated_fleet(options: MockerOptions, workers: int, router: str) -> Fleet:
    policy = make_policy(router, workers, block_size=options.block_size)
    fleet = Fleet(policy, [_routed_engine(options, i, policy) for i in range(workers)])
    fleet.name, fleet.layout = "aggregated", f"{workers} aggregated"
    return fleet


class DisaggFleet(Fleet):
    """D decode workers (routed) and P prefill workers pulling from one queue."""

    def __init__(
        self, options: MockerOptions, decode: int, prefill: int, router: str, t: DisaggThresholds,
        racy: bool = False, pipeline: bool = True,
    ) -> None:  # fmt: skip
        policy = make_policy(router, decode, block_size=options.block_size)
        self.queue = _RacyQueue(t) if racy else LocalPrefillQueue(t)
        self.pipeline = pipeline
        engines = []
        for i in range(decode):
            inner = _routed_engine(options, i, policy)
            engines.append(
                DisaggEngine(
                    inner, worker_id=i, transfer=KvTransferServer(inner, "127.0.0.1", 0), connector=TcpKvConnector(),
                    mode="decode", queue=self.queue, thresholds=t, remote_timeout_s=60.0,
                )  # fmt: skip
            )
        super().__init__(policy, engines)
        self.decode: list[DisaggEngine] = engines
        self.prefill_engines = [MockerEngine(replace(options, worker_id=1000 + j)) for j in range(prefill)]
        self.prefill: list[PrefillWorker] = []
        self.name, self.layout = f"disagg {decode}+{prefill}", f"{decode} decode + {prefill} prefill"

    async def start(self) -> None:
        await super().start()
        endpoints = {d.worker_id: d.kv_endpoint for d in self.decode}

        async def lookup(worker_id: int) -> KvEndpoint | None:  # the discovery lookup, in process
            return endpoints.get(worker_id)

        for engine in self.prefill_engines:
            await engine.start()
            worker = PrefillWorker(
                engine, self.queue, TcpKvConnector(), KvMetadataCache(lookup), poll_s=0.05, pipeline=self.pipeline
            )
            worker.start()
            self.prefill.append(worker)

    async def close(self) -> None:
        for worker in self.prefill:
            await worker.stop(timeout_s=10.0)
        for engine in self.prefill_engines:
            await engine.cleanup()
        await super().close()

    def counters(self, requests: int) -> dict[str, int]:
        decode = [d.disagg_stats() for d in self.decode]
        prefill = [w.disagg_stats() for w in self.prefill]
        return {
            "remote_prefills": sum(s.remote_prefills for s in decode),
            "local_prefills": sum(s.local_prefills for s in decode),
            "local_by_queue": sum(s.local_by_queue for s in decode),
            "remote_fallbacks": sum(s.remote_fallbacks for s in decode),
            "prefill_jobs_failed": sum(s.prefill_jobs_failed for s in prefill),
            "queue_max": self.queue.max_depth,
            # the connectors count modelled bytes (the mocker's wire carries 8-byte digests)
            "kv_bytes": sum(s.kv_bytes_sent + s.kv_bytes_received for s in prefill),
        }


# ---------------------------------------------------------------------------- replay


class LagMonitor:
    """Samples how late the event loop wakes a ``LAG_PERIOD_S`` sleep (wall seconds)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lag-monitor")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_PERIOD_S)
            self.lags.append(max(0.0, loop.time() - before - LAG_PERIOD_S))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _serve(fleet: Fleet, request: PreprocessedRequest, s: Sample, clock: Callable[[], float]) -> None:
    rid = request.request_id
    try:
        async with contextlib.aclosing(fleet.generate(request, Context(rid), s.arrival_ms)) as stream:
            async for chunk in stream:
                if chunk.token_ids:
                    t = clock()
                    if s.first_ms is None:
                        s.first_ms = t
                        fleet.policy.on_first_token(rid, t)
                    s.last_ms = t
                    s.tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    s.finish_reason, s.error = chunk.finish_reason, chunk.error
    except KvmeshError as exc:  # a failed request is a result
        s.finish_reason, s.error = "error", exc.message
    finally:
        fleet.policy.on_finished(rid, clock())


async def replay(
    fleet: Fleet, arrivals: Sequence[tuple[float, PreprocessedRequest]], speedup: float, max_wall_s: float
) -> tuple[list[Sample], float]:
    """Send each request at its model-time arrival; returns the samples and the wall
    seconds it took. Requests unfinished after ``max_wall_s`` are cancelled."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return (loop.time() - t0) * 1000.0 * speedup

    samples = [Sample(r.request_id) for _, r in arrivals]
    try:
        async with asyncio.timeout(max_wall_s), asyncio.TaskGroup() as tg:
            for s, (at_ms, request) in zip(samples, arrivals):
                delay = at_ms / 1000.0 / speedup - (loop.time() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                s.arrival_ms = clock()
                tg.create_task(_serve(fleet, request, s, clock))
    except TimeoutError:
        print(f"  {fleet.name}: stopped after {max_wall_s:g} s wall (--max-wall-s)", file=sys.stderr)
    return samples, loop.time() - t0


# ---------------------------------------------------------------------------- results


@dataclass
class ArmResult:
    name: str
    layout: str
    sent: int
    completed: int
    ok_ttft: int
    ok_itl: int
    good: int
    span_s: float
    goodput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    wall_s: float
    lag_p99_ms: float
    counters: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list, repr=False)

    def goodput_at(self, slo_ttft_ms: float, slo_itl_ms: float) -> float:
        """Goodput under other SLOs (same samples, same window)."""
        good = sum(all(meets(s, slo_ttft_ms, slo_itl_ms)) for s in self.samples)
        return good / self.span_s if self.span_s > 0 else 0.0


def arrival_window_s(arrivals: Sequence[tuple[float, PreprocessedRequest]]) -> float | None:
    """Model seconds N requests arrive over (see the module docstring); None if at once."""
    n, span_ms = len(arrivals), arrivals[-1][0] - arrivals[0][0]
    return span_ms * n / (n - 1) / 1000.0 if n > 1 and span_ms > 0 else None


def summarize(
    fleet: Fleet, samples: Sequence[Sample], wall_s: float, lags: Sequence[float], window_s: float | None, cfg: BenchConfig
) -> ArmResult:
    done = [s for s in samples if s.completed]
    verdicts = [meets(s, cfg.slo_ttft_ms, cfg.slo_itl_ms) for s in samples]
    ttfts = sorted(s.ttft_ms for s in done if s.ttft_ms is not None)
    itls = sorted(x for x in (s.itl_ms for s in done) if x is not None)
    ends = [s.last_ms for s in done if s.last_ms is not None]
    span_s = window_s if window_s is not None else _makespan_s(done, ends)
    good = sum(a and b for a, b in verdicts)
    return ArmResult(
        name=fleet.name,
        layout=fleet.layout,
        sent=len(samples),
        completed=len(done),
        ok_ttft=sum(a for a, _ in verdicts),
        ok_itl=sum(b for _, b in verdicts),
        good=good,
        span_s=span_s,
        goodput=good / span_s if span_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(itls, 50),
        itl_p99_ms=percentile(itls, 99),
        wall_s=wall_s,
        lag_p99_ms=percentile(sorted(lags), 99) * 1000.0,
        counters=fleet.counters(len(samples)),
        samples=list(samples),
    )


def _makespan_s(done: Sequence[Sample], ends: Sequence[float]) -> float:
    return (max(ends) - min(s.arrival_ms for s in done)) / 1000.0 if ends else math.nan


async def run_arm(fleet: Fleet, arrivals: Sequence[tuple[float, PreprocessedRequest]], cfg: BenchConfig) -> ArmResult:
    lag = LagMonitor()
    try:
        await fleet.start()
        lag.start()
        samples, wall_s = await replay(fleet, arrivals, cfg.speedup, cfg.max_wall_s)
    finally:
        await lag.stop()
        await fleet.close()
    return summarize(fleet, samples, wall_s, lag.lags, arrival_window_s(arrivals), cfg)


_ROWS = (
    ("requests done/sent", lambda r: f"{r.completed}/{r.sent}"),
    ("meet TTFT / ITL / both", lambda r: f"{r.ok_ttft} / {r.ok_itl} / {r.good}"),
    ("goodput (req/s, model)", lambda r: f"{r.goodput:.3f}"),
    ("SLO attainment", lambda r: f"{r.good / r.sent:.1%}"),
    ("TTFT p50 / p99 (ms)", lambda r: f"{r.ttft_p50_ms:,.0f} / {r.ttft_p99_ms:,.0f}"),
    ("ITL p50 / p99 (ms)", lambda r: f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f}"),
    ("prefills remote / local", lambda r: f"{r.counters['remote_prefills']} / {r.counters['local_prefills']}"),
    ("  local: queue full", lambda r: f"{r.counters['local_by_queue']}"),
    ("  remote failed→local", lambda r: f"{r.counters['remote_fallbacks']}"),
    ("queue depth max", lambda r: f"{r.counters['queue_max']}"),
    ("KV bytes moved", lambda r: _bytes(r.counters["kv_bytes"])),
    ("wall s / loop lag p99 ms", lambda r: f"{r.wall_s:.1f} / {r.lag_p99_ms:.1f}"),
)


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return ""


def format_round(results: Sequence[ArmResult]) -> str:
    """One column per arm."""
    width = max(18, *(len(r.layout) + 2 for r in results))
    lines = [f"{'':<26}" + "".join(f"{r.name:>{width}}" for r in results)]
    lines.append(f"{'workers':<26}" + "".join(f"{r.layout:>{width}}" for r in results))
    for title, cell in _ROWS:
        lines.append(f"{title:<26}" + "".join(f"{cell(r):>{width}}" for r in results))
    return "\n".join(lines)


def ratios(rounds: Sequence[Sequence[ArmResult]], slo_ttft_ms: float, slo_itl_ms: float) -> dict[str, float]:
    """Each disaggregated arm's median goodput over rounds ÷ the aggregated arm's (NaN if 0)."""
    med = {
        name: statistics.median(r.goodput_at(slo_ttft_ms, slo_itl_ms) for rr in rounds for r in rr if r.name == name)
        for name in (r.name for r in rounds[0])
    }
    base = med["aggregated"]
    return {name: (g / base if base > 0 else math.nan) for name, g in med.items() if name != "aggregated"}


def _best(r: dict[str, float]) -> str:
    return max(r, key=lambda k: -1.0 if math.isnan(r[k]) else r[k])


def sensitivity(rounds: Sequence[Sequence[ArmResult]], cfg: BenchConfig) -> list[tuple[float, float, str, float]]:
    """(TTFT SLO, ITL SLO, best split, its ratio) for SLOs around the chosen ones: the
    same samples judged differently, so a reader sees how much the ratio owes to the SLO."""
    points = [(cfg.slo_ttft_ms, itl) for itl in sorted({15.0, 20.0, 25.0, 35.0, 50.0, 100.0} | {cfg.slo_itl_ms})]
    points += [(ttft, cfg.slo_itl_ms) for ttft in sorted({1000.0, 2000.0, 3000.0, 5000.0} - {cfg.slo_ttft_ms})]
    out = []
    for ttft, itl in points:
        r = ratios(rounds, ttft, itl)
        best = _best(r)
        out.append((ttft, itl, best, r[best]))
    return out


# ---------------------------------------------------------------------------- the run


def prepare(cfg: BenchConfig) -> tuple[list[tuple[float, PreprocessedRequest]], MockerOptions]:
    """The requests with their model-time arrivals (ms), and the workers' options."""
    trace = load_trace(cfg.trace, start_ms=cfg.start_ms, limit=cfg.limit)
    need = max(r.input_length + r.output_length for r in trace) + 1
    options = cfg.mocker(max(2048, need))
    if options.total_tokens < need:
        raise ValueError(f"a request needs {need} tokens of KV, the pool holds {options.total_tokens}: raise --num-blocks")
    synth = TokenSynth(options.vocab_size)
    t0 = trace[0].timestamp_ms
    arrivals = [((r.timestamp_ms - t0) / cfg.speed, synth.request(r, f"r{i}")) for i, r in enumerate(trace)]
    return arrivals, options


def describe(cfg: BenchConfig, arrivals: Sequence[tuple[float, PreprocessedRequest]], options: MockerOptions) -> str:
    span = arrivals[-1][0] / 1000.0
    window = arrival_window_s(arrivals)
    offered = f"{len(arrivals) / window:.2f} req/s offered" if window else "all at once"
    prompt = statistics.mean(len(r.token_ids) for _, r in arrivals)
    out = statistics.mean(r.stop.max_tokens or 0 for _, r in arrivals)
    t = cfg.thresholds
    return "\n".join([
        f"trace {Path(cfg.trace).name}: {len(arrivals)} requests from {cfg.start_ms:g} ms, "
        f"mean prompt {prompt:,.0f} tokens, mean output {out:,.0f}",
        f"arrivals over {span:.1f} s model time ({offered}; --speed {cfg.speed:g}), "
        f"mocker speedup {cfg.speedup:g} (≈{span / cfg.speedup:.0f} s wall of arrivals per arm)",
        f"mocker: block {options.block_size} tokens × {options.num_blocks} blocks "
        f"({options.total_tokens:,} tokens of KV per worker), max {options.max_num_batched_tokens} batched tokens, "
        f"KV {options.kv_bytes_per_token:,} B/token at {options.kv_bandwidth / 1e9:g} GB/s",
        f"router: {cfg.router}; disaggregation thresholds: max_local_prefill_length={t.max_local_prefill_length}, "
        f"max_prefill_queue_size={t.max_prefill_queue_size}, max_prefill_queue_tokens={t.max_prefill_queue_tokens}; "
        f"queue bound {'racy (check, then put)' if cfg.racy_queue else 'atomic'}; "
        f"prefill KV writes {'pipelined' if cfg.pipeline else 'not pipelined'}",
        f"SLOs (model time): TTFT <= {cfg.slo_ttft_ms:g} ms, mean ITL <= {cfg.slo_itl_ms:g} ms",
    ])  # fmt: skip


def fleets(cfg: BenchConfig, options: MockerOptions) -> list[Callable[[], Fleet]]:
    makers: list[Callable[[], Fleet]] = [lambda: aggregated_fleet(options, cfg.workers, cfg.router)]
    for d, p in cfg.splits:
        makers.append(
            lambda d=d, p=p: DisaggFleet(options, d, p, cfg.router, cfg.thresholds, cfg.racy_queue, cfg.pipeline)  # type: ignore[misc]
        )
    return makers


async def bench(cfg: BenchConfig) -> dict[str, object]:
    arrivals, options = prepare(cfg)
    print(describe(cfg, arrivals, options), flush=True)
    gc.collect()
    gc.freeze()  # the prompts stay for the whole run: keep them out of every collection
    rounds: list[list[ArmResult]] = []
    for n in range(cfg.repeat):
        results = []
        for make in fleets(cfg, options):
            fleet = make()
            print(f"round {n + 1}/{cfg.repeat}: {fleet.name} ...", file=sys.stderr, flush=True)
            results.append(await run_arm(fleet, arrivals, cfg))
        rounds.append(results)
        print(f"\nround {n + 1}/{cfg.repeat}\n{format_round(results)}", flush=True)
    out = report(cfg, rounds)
    out["virtual"] = virtual_check(cfg, arrivals, options, rounds)
    return out


def virtual_check(
    cfg: BenchConfig,
    arrivals: Sequence[tuple[float, PreprocessedRequest]],
    options: MockerOptions,
    rounds: Sequence[Sequence[ArmResult]],
) -> dict[str, object]:
    """The same slice, arms and settings replayed by ``kvmesh replay --arms`` on the
    virtual clock (model time: speedup 1): its goodput next to this run's median, and
    whether the two order the arms alike (issue 16: within 15 %, same order)."""
    from kvmesh.replay.arms import Arm, DisaggModel, run_arm as run_virtual
    from kvmesh.replay.goodput import Slo, summarize_arm

    virtual_options = replace(options, speedup=1.0)
    arms = [Arm("aggregated")] + [Arm(f"disagg {d}+{p}", prefill=p, decode=d) for d, p in cfg.splits]
    slo = Slo(cfg.slo_ttft_ms, cfg.slo_itl_ms)
    window = arrival_window_s(arrivals)
    model = DisaggModel(cfg.thresholds, cfg.pipeline)
    virtual: dict[str, float] = {}
    for arm in arms:
        run = run_virtual(arm, arrivals, virtual_options, cfg.workers,
                          lambda n: make_policy(cfg.router, n, block_size=options.block_size), model)  # fmt: skip
        virtual[arm.name] = summarize_arm(arm.name, run.records, slo, window, run.counters).goodput_rps
    real = {a.name: statistics.median(r.goodput for rr in rounds for r in rr if r.name == a.name) for a in arms}
    diffs = {k: (virtual[k] - real[k]) / real[k] if real[k] > 0 else math.nan for k in real}
    same_order = sorted(real, key=lambda k: -real[k]) == sorted(virtual, key=lambda k: -virtual[k])
    print("\nvirtual clock (kvmesh replay --arms, same slice and settings) vs this run (median goodput, req/s):")
    for k in real:
        print(f"  {k:<14} real {real[k]:.3f}   virtual {virtual[k]:.3f}   {diffs[k]:+.1%}")
    worst = max(abs(d) for d in diffs.values())
    print(f"  ordering of arms: {'same' if same_order else 'DIFFERENT'}; largest goodput difference {worst:.1%} (goal <= 15%)")
    return {"real": real, "virtual": virtual, "same_order": same_order, "max_abs_diff": worst}


def report(cfg: BenchConfig, rounds: Sequence[Sequence[ArmResult]]) -> dict[str, object]:
    r = ratios(rounds, cfg.slo_ttft_ms, cfg.slo_itl_ms)
    best = _best(r)
    how = f"median of {len(rounds)} rounds" if len(rounds) > 1 else "same run"
    print(f"\ngoodput ratio disaggregated / aggregated ({how}; TTFT <= {cfg.slo_ttft_ms:g} ms, ITL <= {cfg.slo_itl_ms:g} ms):")
    for name, value in r.items():
        print(f"  {name:<14} {value:.2f}x" + ("   <- best" if name == best else ""))
    print(f"best: {best} at {r[best]:.2f}x (goal >= 1.3x)")
    sens = sensitivity(rounds, cfg)
    print("\nthe same samples under other SLOs (best split, ratio):")
    for ttft, itl, name, value in sens:
        print(f"  TTFT <= {ttft:>6,.0f} ms, ITL <= {itl:>4.0f} ms: {name:<14} {value:.2f}x")
    return {
        "config": _config_json(cfg),
        "rounds": [[_arm_json(a) for a in rr] for rr in rounds],
        "ratios": {k: (None if math.isnan(v) else v) for k, v in r.items()},
        "best": best,
        "sensitivity": [{"slo_ttft_ms": t, "slo_itl_ms": i, "best": n, "ratio": v} for t, i, n, v in sens],
    }


def _arm_json(a: ArmResult) -> dict[str, object]:
    d = {k: v for k, v in asdict(a).items() if k != "samples"}
    d["requests"] = [
        {"id": s.request_id, "arrival_ms": s.arrival_ms, "ttft_ms": s.ttft_ms, "itl_ms": s.itl_ms,
         "tokens": s.tokens, "finish": s.finish_reason}  # fmt: skip
        for s in a.samples
    ]
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _config_json(cfg: BenchConfig) -> dict[str, object]:
    d = asdict(cfg)
    d["splits"] = [f"{a}+{b}" for a, b in cfg.splits]
    d["thresholds"] = {"max_local_prefill_length": cfg.thresholds.max_local_prefill_length,
                       "max_prefill_queue_size": cfg.thresholds.max_prefill_queue_size,
                       "max_prefill_queue_tokens": cfg.thresholds.max_prefill_queue_tokens}  # fmt: skip
    return d


def _parse_args(argv: list[str] | None) -> tuple[BenchConfig, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BenchConfig()
    p.add_argument("--trace", default=d.trace, help="Mooncake-format JSONL trace (default: the conversation trace)")
    p.add_argument("--limit", type=int, default=d.limit, help=f"requests per arm, the earliest (default {d.limit})")
    p.add_argument("--start-ms", type=float, default=d.start_ms, help="skip trace requests before this timestamp")
    p.add_argument("--speed", type=float, default=d.speed, help=f"arrival rate × this, in model time (default {d.speed:g})")
    p.add_argument("--speedup", type=float, default=d.speedup, help=f"mocker speedup (default {d.speedup:g})")
    p.add_argument("--workers", type=int, default=d.workers, help=f"mocker workers per arm (default {d.workers})")
    p.add_argument("--splits", default=",".join(f"{a}+{b}" for a, b in d.splits), help="disaggregated arms, DECODE+PREFILL, comma-separated")
    p.add_argument("--router", default=d.router, choices=("kv", "round_robin"), help="how requests reach (decode) workers")
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms, help=f"TTFT SLO, model ms (default {d.slo_ttft_ms:g})")
    p.add_argument("--slo-itl-ms", type=float, default=d.slo_itl_ms, help=f"mean ITL SLO, model ms (default {d.slo_itl_ms:g})")
    t = d.thresholds
    p.add_argument("--max-local-prefill-length", type=int, default=t.max_local_prefill_length)
    p.add_argument("--max-prefill-queue-size", type=int, default=t.max_prefill_queue_size)
    p.add_argument("--max-prefill-queue-tokens", type=int, default=t.max_prefill_queue_tokens, help="0: no token bound")
    p.add_argument("--racy-queue", action="store_true", help="A/B: the queue bound checked, then an unconditional put")
    p.add_argument("--no-pipeline", action="store_true", help="A/B: prefill workers write KV before the next job")
    p.add_argument("--block-size", type=int, default=d.block_size, help=f"mocker KV block tokens (default {d.block_size})")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help=f"mocker KV blocks per worker (default {d.num_blocks})")
    p.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token, help="modelled KV size per token")
    p.add_argument("--kv-bandwidth", type=float, default=d.kv_bandwidth, help="modelled KV link, bytes/s")
    p.add_argument("--max-wall-s", type=float, default=d.max_wall_s, help=f"cap per arm (default {d.max_wall_s:g})")
    p.add_argument("--repeat", type=int, default=d.repeat, help=f"rounds, arms alternating (default {d.repeat})")
    p.add_argument("--json", metavar="PATH", default=None, help="write config, every arm's figures and the ratios")
    a = p.parse_args(argv)
    try:
        thresholds = DisaggThresholds(a.max_local_prefill_length, a.max_prefill_queue_size, a.max_prefill_queue_tokens)
        splits = tuple(parse_split(s) for s in a.splits.split(",") if s.strip())
        cfg = BenchConfig(
            trace=a.trace, limit=a.limit, start_ms=a.start_ms, speed=a.speed, speedup=a.speedup, workers=a.workers,
            splits=splits, router=a.router, slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms, thresholds=thresholds,
            block_size=a.block_size, num_blocks=a.num_blocks, kv_bytes_per_token=a.kv_bytes_per_token,
            kv_bandwidth=a.kv_bandwidth, max_wall_s=a.max_wall_s, repeat=a.repeat, racy_queue=a.racy_queue,
            pipeline=not a.no_pipeline,
        )  # fmt: skip
    except ValueError as exc:
        p.error(str(exc))
    return cfg, a.json


def _runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def main(argv: list[str] | None = None) -> int:
    cfg, json_path = _parse_args(argv)
    started = time.perf_counter()
    try:
        with _runner() as runner:
            out = runner.run(bench(cfg))
    except (TraceError, ValueError) as exc:
        print(f"bench/disagg.py: {exc}", file=sys.stderr)
        return 2
    print(f"total {time.perf_counter() - started:.0f} s wall", file=sys.stderr)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
