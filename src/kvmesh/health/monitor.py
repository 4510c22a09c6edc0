"""The frontend's health monitor: canary checks per worker, feeding the pure
:class:`~kvmesh.health.state.HealthTracker` (state machine + circuit breaker + latency
baseline), whose routing weights every router mode honours.

* A check sends each canary of the model's set to the worker directly (not through
  the router): greedy, ``ignore_eos``, ``max_tokens`` = the expected length, top
  logprob asked for; a failed attempt is retried up to ``canary_max_retries`` times,
  each attempt counting as one check result.
* Canary sets come from ``--canaries FILE`` (a set names its model); a model without
  one learns its set from the fleet: each worker's greedy answers (tokens and top
  log-probabilities) are a vote, adopted once three workers agree (all live workers
  in a smaller fleet; see :class:`~kvmesh.health.canary.CanaryVotes`), so one corrupt
  worker cannot poison it. ``kvmesh canary record`` writes such a set to a file.
* At degradation levels 3 and 4 (the latency SLOs relaxed ×2) the latency a canary
  may take is relaxed by the same factor (:attr:`HealthMonitor.latency_multiplier`,
  set by the frontend from its load shedder).
* Real request failures (migratable errors from a worker) are reported by the
  pipeline through :meth:`HealthMonitor.stream_failed`.
* A worker that becomes UNHEALTHY (or whose breaker opens) gets weight 0 and its
  streams move to other workers; canaries keep probing it, and a passing half-open
  trial brings it back. A worker that still answers and was not ejected for corruption
  hands them off with their KV (its ``handoff`` endpoint; it needs a KV-transfer
  server: ``--drain-migrate``), premium first, each to the healthy worker a
  :class:`~kvmesh.health.migration.CapacityLedger` of the fleet's free KV blocks and
  load picks (:meth:`HealthMonitor.handoff_target`, asked by the request's owner); a
  corrupt worker, one that does not answer, or one with no KV to give has its
  connection closed instead: its streams re-prefill elsewhere.

Load versus failure (see :mod:`kvmesh.health.state`): checks run in *rounds*, every
worker due at once, so peers are compared at the same moment. A canary asks for
``premium`` priority (it does not queue behind real traffic on engines that honour
tiers); its time to first token (queueing + its own prefill) is measured apart from
its compute (first token to last), and only the compute is judged, against the
worker's load (a load report fetched as the canary starts and as it ends) times its
peers' load-normalised latency in the same round. Its timeout stretches only when the
worker's last known load predicts a canary slower than ``--canary-timeout`` (at most
``_MAX_TIMEOUT_SCALE`` ×). Latency alone removes at most
``max_latency_ejection_share`` of the live workers from routing; beyond that (and in
a fleet of 2) a slow worker stays SUSPICIOUS. Hangs, errors and wrong tokens
are recorded as soon as they happen, with no such limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgspec

from kvmesh.errors import KvmeshError
from kvmesh.health.fleet import FleetView
from kvmesh.health.canary import Canary, CanaryOutput, CanarySet, CanaryVotes, evaluate, load_canaries
from kvmesh.health.migration import CapacityLedger, HandOffReport, TargetCapacity, handoff_allowed
from kvmesh.health.state import (
    CheckKind,
    CheckResult,
    FleetLatency,
    HealthConfig,
    HealthStatus,
    HealthTracker,
    LatencyContext,
    LoadSample,
    Transition,
    latency_ejection_allowed,
)
from kvmesh.protocol import (
    LoadReport,
    OutputChunk,
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)
from kvmesh.runtime.context import Context
from kvmesh.runtime.distributed import RequestClient, call
from kvmesh.runtime.instances import Instance
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.runtime.names import GENERATE, HANDOFF, LOAD

__all__ = ["HealthMonitor", "DEFAULT_CANARY_PROMPTS", "generate_greedy"]

log = logging.getLogger("kvmesh.health")

DEFAULT_CANARY_PROMPTS = ("The capital of France is", "def fibonacci(n):")
_CANARY_TOKENS = 8
_MAX_TIMEOUT_SCALE = 20.0  # a canary's timeout grows with the worker's load, up to this
_encode = msgspec.msgpack.encode
_decode_chunk = msgspec.msgpack.Decoder(OutputChunk).decode
_decode_load = msgspec.msgpack.Decoder(LoadReport).decode
_decode_handoff = msgspec.msgpack.Decoder(HandOffReport).decode
_CUT_GRACE_S = 1.0  # after a hand-off, the streams left without KV are cut this much later


async def generate_greedy(
    client: RequestClient, model: str, prompt: list[int], n: int, timing: list[float] | None = None
) -> tuple[list[int], list[float] | None]:
    """``n`` greedy tokens for ``prompt`` straight from one worker (no router), with the
    top log-probability of each token when the engine reports it. The request asks for
    ``premium`` priority. ``timing``, when given, receives the monotonic time at which
    the first token arrived."""
    request = PreprocessedRequest(
        request_id=f"canary-{time.monotonic_ns()}",
        model=model,
        token_ids=prompt,
        sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=n, ignore_eos=True),
        output=OutputOptions(logprobs=1),
        routing=RoutingHints(priority="premium"),
    )
    tokens: list[int] = []
    top: list[float] = []
    async for chunk in client.stream(GENERATE, _encode(request), Context(request.request_id), decode=_decode_chunk):
        if timing is not None and not tokens and chunk.token_ids:
            timing.append(time.monotonic())
        tokens.extend(chunk.token_ids)
        if chunk.logprobs:
            top.extend(lp.logprob for lp in chunk.logprobs)
    return tokens, (top or None)


def load_sample(report: LoadReport | None) -> LoadSample | None:
    """A worker's load report as the health state's :class:`LoadSample`."""
    if report is None:
        return None
    kv = report.active_blocks / report.total_blocks if report.total_blocks > 0 else 0.0
    return LoadSample(report.num_running, report.num_waiting, kv, report.batch_tokens)


class HealthMonitor:
    def __init__(
        self,
        fleet: FleetView,
        config: HealthConfig,
        timeout_s: float,
        canary_files: Sequence[str] = (),
        metrics: FrontendMetrics | None = None,
    ) -> None:
        self.view = fleet  # the served workers and models
        self.config = config
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.trackers: dict[int, HealthTracker] = {}
        self._instances: dict[int, Instance] = {}
        self._canaries: dict[str, CanarySet] = {}
        self._votes: dict[str, CanaryVotes] = {}  # model -> answers offered so far (no file)
        # the degradation level's latency SLO multiplier (2 at levels 3-4); 1 without shedding
        self.latency_multiplier: Callable[[], float] = lambda: 1.0
        for path in canary_files:
            canary_set = load_canaries(path)
            self._canaries[canary_set.model] = canary_set
        self.fleet = FleetLatency(config)
        self._loads: dict[int, LoadSample] = {}  # each worker's last known load
        self._checking: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._ledgers: dict[int, CapacityLedger] = {}  # ejected worker -> where its hand-offs go

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._loop_task] if self._loop_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def attached(self, instance: Instance) -> None:
        self.trackers[instance.worker_id] = HealthTracker(instance.worker_id, self.config)
        self._instances[instance.worker_id] = instance
        self._publish(instance.worker_id)

    def detached(self, worker_id: int) -> None:
        tracker = self.trackers.pop(worker_id, None)
        self._instances.pop(worker_id, None)
        self._loads.pop(worker_id, None)
        self._ledgers.pop(worker_id, None)
        self.fleet.forget(worker_id)
        if tracker is not None:
            transition = tracker.record_process_death(time.monotonic())
            self._publish(worker_id, tracker)
            if transition is not None:
                self._count(transition)

    # ------------------------------------------------------------------ routing view
    def weight(self, worker_id: int) -> float:
        tracker = self.trackers.get(worker_id)
        return 1.0 if tracker is None else tracker.weight

    def capacity(self, worker_id: int) -> float:
        """The worker's share of its nominal capacity: routing weight × its speed
        against its own baseline (graceful degradation's input: fleet-wide slowness
        sheds load instead of evicting workers)."""
        tracker = self.trackers.get(worker_id)
        if tracker is None:
            return 1.0
        return tracker.weight * self.fleet.speed(worker_id, tracker.baseline_s, time.monotonic())

    def weights(self, ids: Sequence[int]) -> dict[int, float] | None:
        """Weights of ``ids``; None when all are 1 (the routers' fast path)."""
        out = {w: self.weight(w) for w in ids}
        return None if all(v == 1.0 for v in out.values()) else out

    def stream_failed(self, worker_id: int, error: BaseException) -> None:
        tracker = self.trackers.get(worker_id)
        if tracker is not None:
            self._after(worker_id, tracker.record_stream_error(error, time.monotonic()))

    # ------------------------------------------------------------------ checking
    async def _loop(self) -> None:
        tick = max(0.05, min(1.0, self.config.check_interval_s / 4))
        while True:
            now = time.monotonic()
            due = [
                worker_id
                for worker_id, tracker in list(self.trackers.items())
                if worker_id not in self._checking and tracker.begin_check(now)
            ]
            if due:
                self._checking.update(due)
                self._spawn(self._round(due))
            await asyncio.sleep(tick)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _round(self, worker_ids: list[int]) -> None:
        """Check ``worker_ids`` at the same moment and judge their speed together (a
        spike counts once ``latency_confirm_rounds`` consecutive rounds agree)."""
        try:
            verdicts = await self._sample_round(worker_ids)
            now = time.monotonic()
            for worker_id, (result, judged, context) in verdicts.items():
                tracker = self.trackers.get(worker_id)
                if tracker is None:
                    continue
                self._observe(worker_id, judged)
                self._after(worker_id, tracker.record_check(result, now, context))
        finally:
            self._checking.difference_update(worker_ids)

    async def _sample_round(self, worker_ids: list[int]) -> dict[int, tuple[CheckResult, CheckResult, LatencyContext]]:
        """Canaries on every worker at once; for each that answered right, its result,
        how its speed is judged, and the context it was judged in."""
        samples = await asyncio.gather(*(self._check(w) for w in worker_ids), return_exceptions=True)
        for worker_id, sample in zip(worker_ids, samples):
            if isinstance(sample, Exception):  # a bug in the checker: log it, check again next round
                log.error("canary check of worker %x failed", worker_id, exc_info=sample)
        passed = [s for s in samples if isinstance(s, tuple)]
        now = time.monotonic()
        for worker_id, result, load in passed:
            self.fleet.record(worker_id, result.judged_s, load, now)
        verdicts = {}
        for worker_id, result, load in passed:
            tracker = self.trackers.get(worker_id)
            if tracker is None:
                continue
            context = self.fleet.context(worker_id, load, tracker.baseline_s, now, may_eject=self._may_eject(worker_id))
            context = dataclasses.replace(context, relax=self.latency_multiplier())
            judged = tracker.classify_latency(result, context)
            if not judged.ok:  # a warning once it confirms a streak, else a note
                confirms = tracker.spike_streak + 1 >= self.config.latency_confirm_rounds
                log.log(logging.WARNING if confirms else logging.INFO, "worker %x: %s; %s (may eject: %s)",
                        worker_id, judged.detail, load, context.may_eject)  # fmt: skip
            verdicts[worker_id] = (result, judged, context)
        return verdicts

    async def _check(self, worker_id: int) -> tuple[int, CheckResult, LoadSample | None] | None:
        """Every canary of the set on one worker; failures other than speed are recorded
        at once. The slowest passing canary (its speed not judged yet) and its load."""
        instance = self._instances.get(worker_id)
        if instance is None:
            return None
        canary_set = await self._canary_set(instance)
        if canary_set is None:
            return None
        passed: tuple[CheckResult, LoadSample | None] | None = None
        for canary in canary_set.canaries:
            outcome = await self._check_one(instance, canary)
            if outcome is None:
                return None
            passed = outcome if passed is None or outcome[0].judged_s >= passed[0].judged_s else passed
        return None if passed is None else (worker_id, *passed)

    async def _check_one(self, instance: Instance, canary: Canary) -> tuple[CheckResult, LoadSample | None] | None:
        """One canary with retries; every failed attempt is a check result. The passing
        attempt (not recorded yet: its speed is judged with its peers'), or None."""
        for _ in range(1 + self.config.canary_max_retries):
            tracker = self.trackers.get(instance.worker_id)
            if tracker is None:
                return None
            result, load = await self._probe(instance, canary)
            if result.ok:
                return result, load
            self._observe(instance.worker_id, result)
            self._after(instance.worker_id, tracker.record_check(result, time.monotonic()))
        return None

    def _may_eject(self, worker_id: int) -> bool:
        return latency_ejection_allowed(self.trackers.values(), worker_id, self.config)

    async def _probe(self, instance: Instance, canary: Canary) -> tuple[CheckResult, LoadSample | None]:
        timeout = self._timeout(instance.worker_id)
        before = asyncio.get_running_loop().create_task(self._load(instance))
        start = time.monotonic()
        first: list[float] = []
        try:
            n = len(canary.expected_token_ids)
            tokens, top = await asyncio.wait_for(self._generate(instance, canary.prompt_token_ids, n, first), timeout)
        except TimeoutError:
            before.cancel()
            return CheckResult(CheckKind.TIMEOUT, timeout, f"no answer within {timeout:g} s"), None
        except KvmeshError as exc:
            before.cancel()
            return CheckResult(CheckKind.ERROR, time.monotonic() - start, exc.message), None
        end = time.monotonic()
        load = LoadSample.heavier(await before, await self._load(instance))
        if load is not None:
            self._loads[instance.worker_id] = load
        result = evaluate(canary, tokens, top, end - start, None)
        if result.ok and first:
            wait = first[0] - start
            # one token: nothing but the first; else the first token to the last
            compute = end - start if len(tokens) <= 1 else end - first[0]
            result = CheckResult(CheckKind.OK, end - start, compute_s=compute, wait_s=wait)
        return result, load

    def _timeout(self, worker_id: int) -> float:
        """``--canary-timeout``, or longer when the worker's last known load predicts a
        canary slower than that: spike factor × its baseline × the load's multiplier
        (at most ``_MAX_TIMEOUT_SCALE`` × the timeout)."""
        tracker = self.trackers.get(worker_id)
        last = self._loads.get(worker_id)
        if tracker is None or last is None or tracker.baseline_s is None:
            return self.timeout_s
        factor = self.config.latency_spike_factor * self.latency_multiplier()
        predicted = factor * tracker.baseline_s * last.multiplier(self.config)
        return min(self.timeout_s * _MAX_TIMEOUT_SCALE, max(self.timeout_s, predicted))

    async def _load(self, instance: Instance) -> LoadSample | None:
        try:
            report = await asyncio.wait_for(call(instance.client, LOAD, decode=_decode_load), self.timeout_s)
        except (TimeoutError, KvmeshError, OSError):
            return None  # the load only informs the judgement; the canary itself decides
        return load_sample(report)

    async def _generate(
        self, instance: Instance, prompt: list[int], n: int, timing: list[float] | None = None
    ) -> tuple[list[int], list[float] | None]:
        return await generate_greedy(instance.client, instance.info.engine.served_model_name, prompt, n, timing)

    async def _canary_set(self, instance: Instance) -> CanarySet | None:
        model = instance.info.engine.served_model_name
        known = self._canaries.get(model)
        if known is not None:
            return known
        outputs = []
        for text in DEFAULT_CANARY_PROMPTS:
            prompt = self.view.canary_prompt(model, text)
            if prompt is None:
                return None
            try:
                tokens, top = await asyncio.wait_for(self._generate(instance, prompt, _CANARY_TOKENS), self.timeout_s)
            except (TimeoutError, KvmeshError):
                return None  # not known-good yet: record from the next check
            outputs.append(CanaryOutput(prompt, tokens, top, name=text))
        votes = self._votes.setdefault(model, CanaryVotes(model))
        live = sum(1 for i in self.view.workers() if i.info.engine.served_model_name == model)
        agreed = votes.offer(instance.worker_id, outputs, live)
        if agreed is None:
            if votes.disagreeing() > 1:
                log.warning("workers disagree on the canary answers for %s (%d answers from %d workers)",
                            model, votes.disagreeing(), len(votes.votes))  # fmt: skip
            return None  # not agreed yet: this worker is checked against the set next round
        canary_set = self._canaries.setdefault(model, agreed)
        log.info("recorded %d canaries for %s from %d agreeing workers", len(outputs), model, len(votes.votes))
        return canary_set

    async def vet(self, instance: Instance) -> CheckResult:
        """A canary check of a worker not in routing (a hot spare): every canary of
        its model's set against it, the first failure or OK; nothing is recorded in the
        fleet's health. Before the fleet has agreed on a set, a spare passes when it
        answers a greedy canary prompt at all."""
        model = instance.info.engine.served_model_name
        canary_set = self._canaries.get(model)
        start = time.monotonic()
        if canary_set is None:
            prompt = self.view.canary_prompt(model, DEFAULT_CANARY_PROMPTS[0]) or [1, 2, 3]
            try:
                tokens, _ = await asyncio.wait_for(self._generate(instance, prompt, 1), self.timeout_s)
            except TimeoutError:
                return CheckResult(CheckKind.TIMEOUT, self.timeout_s, "no answer")
            except KvmeshError as exc:
                return CheckResult(CheckKind.ERROR, time.monotonic() - start, exc.message)
            ok = len(tokens) == 1
            return CheckResult(CheckKind.OK if ok else CheckKind.WRONG_TOKENS, time.monotonic() - start)
        try:
            for canary in canary_set.canaries:
                result, _ = await self._probe(instance, canary)
                if not result.ok:
                    return result
        finally:
            self._loads.pop(instance.worker_id, None)
        return CheckResult(CheckKind.OK, time.monotonic() - start)

    # ------------------------------------------------------------------ outcomes
    def _after(self, worker_id: int, transition: Transition | None) -> None:
        tracker = self.trackers.get(worker_id)
        if tracker is not None:
            self._publish(worker_id, tracker)
        if transition is None:
            return
        self._count(transition)
        log.warning("worker %x: %s -> %s (%s)", worker_id, transition.src.name, transition.dst.name, transition.reason)
        if tracker is not None and tracker.weight == 0.0:
            self._evict_streams(worker_id, transition.reason)

    def _evict_streams(self, worker_id: int, reason: str = "") -> None:
        """Move the streams of a worker taken out of routing to healthy workers: with
        their KV when it may (:func:`~kvmesh.health.migration.handoff_allowed`) and
        has a KV-transfer server, else by closing the connection (a migratable error:
        they re-prefill)."""
        instance = self._instances.get(worker_id)
        if instance is None:
            return
        if handoff_allowed(reason) and instance.info.kv is not None:
            self._spawn(self._hand_off(instance))
        else:
            self._spawn(instance.client.close())

    async def _hand_off(self, instance: Instance) -> None:
        """Book the healthy workers' capacity, then ask ``instance`` to hand its
        requests off; on any failure close the connection (re-prefill)."""
        worker_id = instance.worker_id
        kv = instance.info.kv
        assert kv is not None
        targets = await self._capacities(worker_id)
        self._ledgers[worker_id] = CapacityLedger(targets, max(1, kv.layout.block_size))
        try:
            report = await asyncio.wait_for(call(instance.client, HANDOFF, decode=_decode_handoff), self.timeout_s)
        except (TimeoutError, KvmeshError, OSError, msgspec.ValidationError) as exc:
            log.warning("worker %x: no KV hand-off (%s); its streams re-prefill elsewhere", worker_id, exc)
            report = None
        if report is not None:
            order = ", ".join(f"{m.request_id}:{m.priority}" for m in report.moved)
            log.warning("worker %x: handed %d in-flight requests off with their KV, in order [%s]; %d without KV",
                        worker_id, len(report.moved), order, report.kept)  # fmt: skip
            if not report.kept:
                return
            await asyncio.sleep(_CUT_GRACE_S)  # the handed-off streams end first
        await instance.client.close()

    async def _capacities(self, source: int) -> list[TargetCapacity]:
        """Free KV blocks and requests held of every routable worker but ``source``."""
        peers = [i for w, i in self._instances.items() if w != source and self.weight(w) > 0.0]
        reports = await asyncio.gather(*(self._load_report(i) for i in peers))
        return [
            TargetCapacity(i.worker_id, max(0, r.total_blocks - r.active_blocks), r.num_running + r.num_waiting)
            for i, r in zip(peers, reports)
            if r is not None
        ]

    async def _load_report(self, instance: Instance) -> LoadReport | None:
        try:
            return await asyncio.wait_for(call(instance.client, LOAD, decode=_decode_load), self.timeout_s)
        except (TimeoutError, KvmeshError, OSError):
            return None

    def handoff_target(self, source: int, tokens: int, exclude: Sequence[int]) -> int | None:
        """Where a request that ``source`` handed off with ``tokens`` tokens of KV goes
        (booked in the source's ledger); None: the router picks."""
        ledger = self._ledgers.get(source)
        return None if ledger is None else ledger.claim(tokens, exclude)

    def _observe(self, worker_id: int, result: CheckResult) -> None:
        if self.metrics is not None:
            self.metrics.check_duration.labels(f"{worker_id:x}", "canary", result.kind.value).observe(result.latency_s)
            if result.ok or result.kind is CheckKind.LATENCY_SPIKE:
                self.metrics.canary_wait.labels(f"{worker_id:x}").observe(result.wait_s)

    def _count(self, transition: Transition) -> None:
        """``kvmesh_health_transitions_total``: the cause is the reason's first word
        after the colon (``latency_spike``, ``timeout``, ``failure``…)."""
        if self.metrics is not None:
            cause = transition.reason.rsplit(":", 1)[-1].strip().replace(" ", "_") or "event"
            self.metrics.health_transitions.labels(f"{transition.worker_id:x}", transition.dst.name.lower(), cause).inc()

    def _publish(self, worker_id: int, tracker: HealthTracker | None = None) -> None:
        if self.metrics is None:
            return
        tracker = tracker or self.trackers.get(worker_id)
        if tracker is None:
            return
        label = f"{worker_id:x}"
        self.metrics.worker_status.labels(label).set(int(tracker.status))
        self.metrics.breaker_state.labels(label).set(int(tracker.breaker.state))

    def status(self, worker_id: int) -> HealthStatus | None:
        tracker = self.trackers.get(worker_id)
        return None if tracker is None else tracker.status
