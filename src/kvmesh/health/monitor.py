"""The frontend's health monitor: canary checks per worker, feeding the pure
:class:`~kvmesh.health.state.HealthTracker` (state machine + circuit breaker + latency
baseline), whose routing weights every router mode honours.

* A check sends each canary of the model's set to the worker directly (not through
  the router): greedy, ``ignore_eos``, ``max_tokens`` = the expected length, top
  logprob asked for; a failed attempt is retried up to ``canary_max_retries`` times,
  each attempt counting as one check result.
* Canary sets come from ``--canaries FILE`` (a set names its model); a model without
  one records its set from the first worker that answers (trust on first use), which
  is what ``kvmesh canary record`` writes to a file ahead of time.
* Real request failures (migratable errors from a worker) are reported by the
  pipeline through :meth:`HealthMonitor.stream_failed`.
* A worker that becomes UNHEALTHY (or whose breaker opens) gets weight 0, and its
  connection is closed so the streams it is holding migrate to other workers; canaries
  keep probing it, and a passing half-open trial brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvmesh.errors import KvmeshError
from kvmesh.health.canary import Canary, CanaryOutput, CanarySet, evaluate, load_canaries, record_canaries
from kvmesh.health.state import CheckKind, CheckResult, HealthConfig, HealthStatus, HealthTracker, Transition
from kvmesh.protocol import OutputChunk, OutputOptions, PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.runtime.context import Context
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import GENERATE

__all__ = ["HealthMonitor", "DEFAULT_CANARY_PROMPTS", "generate_greedy"]

log = logging.getLogger("kvmesh.health")

DEFAULT_CANARY_PROMPTS = ("The capital of France is", "def fibonacci(n):")
_CANARY_TOKENS = 8
_encode = msgspec.msgpack.encode
_decode_chunk = msgspec.msgpack.Decoder(OutputChunk).decode


async def generate_greedy(client: Any, model: str, prompt: list[int], n: int) -> tuple[list[int], list[float] | None]:
    """``n`` greedy tokens for ``prompt`` straight from one worker (no router), with the
    top log-probability of each token when the engine reports it."""
    request = PreprocessedRequest(
        request_id=f"canary-{time.monotonic_ns()}",
        model=model,
        token_ids=prompt,
        sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=n, ignore_eos=True),
        output=OutputOptions(logprobs=1),
    )
    tokens: list[int] = []
    top: list[float] = []
    async for chunk in client.stream(GENERATE, _encode(request), Context(request.request_id), decode=_decode_chunk):
        tokens.extend(chunk.token_ids)
        if chunk.logprobs:
            top.extend(lp.logprob for lp in chunk.logprobs)
    return tokens, (top or None)


class HealthMonitor:
    def __init__(
        self,
        registry: Any,
        config: HealthConfig,
        timeout_s: float,
        canary_files: Sequence[str] = (),
        metrics: Any = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.trackers: dict[int, HealthTracker] = {}
        self._instances: dict[int, Instance] = {}
        self._canaries: dict[str, CanarySet] = {}
        for path in canary_files:
            canary_set = load_canaries(path)
            self._canaries[canary_set.model] = canary_set
        self._checking: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

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
        if tracker is not None:
            tracker.record_process_death(time.monotonic())
            self._publish(worker_id, tracker)

    # ------------------------------------------------------------------ routing view
    def weight(self, worker_id: int) -> float:
        tracker = self.trackers.get(worker_id)
        return 1.0 if tracker is None else tracker.weight

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
            for worker_id, tracker in list(self.trackers.items()):
                if worker_id not in self._checking and tracker.begin_check(now):
                    self._checking.add(worker_id)
                    self._spawn(self._check(worker_id))
            await asyncio.sleep(tick)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, worker_id: int) -> None:
        try:
            instance = self._instances.get(worker_id)
            if instance is None:
                return
            canary_set = await self._canary_set(instance)
            if canary_set is None:
                return
            for canary in canary_set.canaries:
                if not await self._check_one(instance, canary):
                    break
        finally:
            self._checking.discard(worker_id)

    async def _check_one(self, instance: Instance, canary: Canary) -> bool:
        """One canary with retries; every attempt is a check result. True if it passed."""
        for _ in range(1 + self.config.canary_max_retries):
            tracker = self.trackers.get(instance.worker_id)
            if tracker is None:
                return False
            result = await self._probe(instance, canary, tracker.baseline_s)
            self._observe(instance.worker_id, result)
            self._after(instance.worker_id, tracker.record_check(result, time.monotonic()))
            if result.ok:
                return True
        return False

    async def _probe(self, instance: Instance, canary: Canary, baseline: float | None) -> CheckResult:
        start = time.monotonic()
        try:
            tokens, top = await asyncio.wait_for(self._generate(instance, canary.prompt_token_ids, len(canary.expected_token_ids)), self.timeout_s)
        except TimeoutError:
            return CheckResult(CheckKind.TIMEOUT, self.timeout_s, f"no answer within {self.timeout_s:g} s")
        except KvmeshError as exc:
            return CheckResult(CheckKind.ERROR, time.monotonic() - start, exc.message)
        return evaluate(canary, tokens, top, time.monotonic() - start, baseline, spike_factor=self.config.latency_spike_factor)

    async def _generate(self, instance: Instance, prompt: list[int], n: int) -> tuple[list[int], list[float] | None]:
        return await generate_greedy(instance.client, instance.info.engine.served_model_name, prompt, n)

    async def _canary_set(self, instance: Instance) -> CanarySet | None:
        model = instance.info.engine.served_model_name
        known = self._canaries.get(model)
        if known is not None:
            return known
        entry = self.registry.models.get(model)
        if entry is None:
            return None
        outputs = []
        for text in DEFAULT_CANARY_PROMPTS:
            prompt = entry.preprocessor.text_prompt(text)
            try:
                tokens, top = await asyncio.wait_for(self._generate(instance, prompt, _CANARY_TOKENS), self.timeout_s)
            except (TimeoutError, KvmeshError):
                return None  # not known-good yet: record from the next check
            outputs.append(CanaryOutput(prompt, tokens, top, name=text))
        canary_set = self._canaries.setdefault(model, record_canaries(outputs, model=model))
        log.info("recorded %d canaries for %s from worker %x", len(outputs), model, instance.worker_id)
        return canary_set

    # ------------------------------------------------------------------ outcomes
    def _after(self, worker_id: int, transition: Transition | None) -> None:
        tracker = self.trackers.get(worker_id)
        if tracker is not None:
            self._publish(worker_id, tracker)
        if transition is None:
            return
        log.warning("worker %x: %s -> %s (%s)", worker_id, transition.src.name, transition.dst.name, transition.reason)
        if tracker is not None and tracker.weight == 0.0:
            self._evict_streams(worker_id)

    def _evict_streams(self, worker_id: int) -> None:
        """Close the connection to a worker taken out of routing: its streams get a
        migratable error and move to healthy workers."""
        instance = self._instances.get(worker_id)
        if instance is not None:
            self._spawn(instance.client.close())

    def _observe(self, worker_id: int, result: CheckResult) -> None:
        if self.metrics is not None:
            self.metrics.check_duration.labels(f"{worker_id:x}", "canary", result.kind.value).observe(result.latency_s)

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
