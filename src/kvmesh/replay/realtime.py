"""Replay on the real clock: :class:`~kvmesh.engines.mocker.MockerEngine` instances in
one event loop, requests sent at their (scaled) arrival times, real sleeps.

Slower and less exact than the virtual clock (timings include event-loop jitter), but
it drives the engines through the same ``generate`` stream the workers serve. Tokens
that arrive merged in one chunk share its receive time. KV events reach the policy
synchronously from the engines' publishers, as on the virtual clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord
from kvmesh.errors import KvmeshError
from kvmesh.protocol import PreprocessedRequest
from kvmesh.replay.policies import ReplayPolicy
from kvmesh.replay.sim import kv_feed
from kvmesh.runtime.context import Context

__all__ = ["simulate_real"]


async def simulate_real(
    arrivals: Iterable[tuple[float, PreprocessedRequest]],
    policy: ReplayPolicy,
    fleet: Sequence[MockerOptions],
    on_done: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Like :func:`kvmesh.replay.sim.simulate`, in real time (milliseconds since start)."""
    engines = [MockerEngine(options, kv_feed(policy)) for options in fleet]
    for engine in engines:
        await engine.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def now_ms() -> float:
        return (loop.time() - t0) * 1000.0

    records: list[RequestRecord] = []
    try:
        async with asyncio.TaskGroup() as tg:
            for t, request in arrivals:
                delay = t / 1000.0 - (loop.time() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                arrival = now_ms()
                i = policy.route(request, arrival)
                record = RequestRecord(request.request_id, i, arrival, len(request.token_ids))
                records.append(record)
                tg.create_task(_serve(engines[i], request, record, policy, now_ms, on_done))
    finally:
        for engine in engines:
            await engine.cleanup()
    return records


async def _serve(
    engine: MockerEngine,
    request: PreprocessedRequest,
    record: RequestRecord,
    policy: ReplayPolicy,
    now_ms: Callable[[], float],
    on_done: Callable[[], None] | None,
) -> None:
    rid = request.request_id
    try:
        async for chunk in engine.generate(request, Context(rid)):
            t = now_ms()
            if chunk.token_ids and not record.token_ids:
                policy.on_first_token(rid, t)
            record.token_ids.extend(chunk.token_ids)
            record.token_times_ms.extend([t] * len(chunk.token_ids))
            if chunk.finish_reason is not None:
                record.finish_ms = t
                record.finish_reason = chunk.finish_reason
                record.error = chunk.error
                if chunk.usage is not None:
                    record.cached_tokens = chunk.usage.cached_tokens
    except KvmeshError as exc:  # a failed request is a result, not a reason to stop the replay
        record.finish_ms = now_ms()
        record.finish_reason = "error"
        record.error = exc.message
    finally:
        policy.on_finished(rid, now_ms())
        if on_done is not None:
            on_done()
