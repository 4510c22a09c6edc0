"""The virtual-clock driver: exact step timings, batching of simultaneous arrivals,
and multi-worker trace replays with a pluggable routing policy."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord, VirtualWorker, round_robin, run_trace
from kvmesh.protocol import PreprocessedRequest, StopConditions
from kvmesh.runtime.events import RecordingPublisher

OPTS = MockerOptions(eos_rate=0.0, num_blocks=256)


def req(rid: str, tokens: list[int] | range, max_tokens: int = 8) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="mock",
        token_ids=list(tokens),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


def test_single_request_timings_follow_the_model() -> None:
    worker = VirtualWorker(OPTS)
    record = worker.submit(req("a", range(200), max_tokens=5), now_ms=100.0)
    assert worker.next_event_time() == 100.0
    events = worker.run_until_idle()
    assert record.ttft_ms == pytest.approx(OPTS.prefill_ms(200))
    assert len(record.itl_ms) == 4
    for k, itl in enumerate(record.itl_ms):  # the decode attends to the prompt and the tokens so far
        assert itl == pytest.approx(OPTS.decode_ms((201 + k) / (256 * OPTS.block_size)))
    assert record.finish_reason == "length" and record.finish_ms == record.token_times_ms[-1]
    assert [e.token_id for e in events if e.token_id is not None] == record.token_ids
    assert events[-1].finish_reason == "length"
    assert worker.next_event_time() is None and not worker.busy


def test_speedup_divides_virtual_time() -> None:
    slow, fast = VirtualWorker(OPTS), VirtualWorker(MockerOptions(eos_rate=0.0, num_blocks=256, speedup=8.0))
    a = slow.submit(req("a", range(300)), 0.0)
    b = fast.submit(req("a", range(300)), 0.0)
    slow.run_until_idle()
    fast.run_until_idle()
    assert b.latency_ms == pytest.approx(a.latency_ms / 8)  # type: ignore[operator]
    assert a.token_ids == b.token_ids


def test_simultaneous_arrivals_share_a_step_and_late_ones_wait() -> None:
    worker = VirtualWorker(OPTS)
    a = worker.submit(req("a", range(100)), 0.0)
    b = worker.submit(req("b", range(100, 200)), 0.0)
    assert worker.advance_to(0.0) == []  # the step started; it ends later
    end = worker.next_event_time()
    assert end == pytest.approx(OPTS.prefill_ms(200))
    c = worker.submit(req("c", range(200, 300)), 1.0)  # arrives mid-step: joins the next one
    worker.run_until_idle()
    assert a.ttft_ms == b.ttft_ms == pytest.approx(OPTS.prefill_ms(200))
    assert c.ttft_ms is not None and c.token_times_ms[0] > end  # type: ignore[operator]


def test_idle_worker_jumps_to_the_next_arrival() -> None:
    worker = VirtualWorker(OPTS)
    worker.submit(req("a", range(50), max_tokens=2), 0.0)
    worker.run_until_idle()
    later = worker.submit(req("b", range(500, 550), max_tokens=2), 10_000.0)
    worker.run_until_idle()
    assert later.ttft_ms == pytest.approx(OPTS.prefill_ms(50))
    assert worker.now_ms > 10_000.0


def _trace(n: int, seed: int = 0) -> list[tuple[float, PreprocessedRequest]]:
    """``n`` requests over 8 shared system prompts, Poisson-ish arrivals."""
    rnd = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rnd.expovariate(1 / 20.0)
        group = rnd.randrange(8)
        prompt = [group] * 256 + [rnd.randrange(2048) for _ in range(rnd.randrange(16, 200))]
        out.append((t, req(f"r{i}", prompt, max_tokens=rnd.randrange(1, 60))))
    return out


def _by_group(request: PreprocessedRequest, _now: float, workers: Sequence[VirtualWorker]) -> int:
    return request.token_ids[0] % len(workers)


def test_trace_replay_across_workers() -> None:
    trace = _trace(600)
    opts = [MockerOptions(eos_rate=0.0, num_blocks=512, worker_id=i) for i in range(4)]
    pubs = [RecordingPublisher() for _ in opts]
    records = run_trace(trace, [VirtualWorker(o, p) for o, p in zip(opts, pubs)], round_robin())
    assert len(records) == 600
    arrivals = {r.request_id: t for t, r in trace}
    for rid, record in records.items():
        assert record.done and record.finish_reason == "length"
        assert record.arrival_ms == arrivals[rid]
        assert record.ttft_ms is not None and record.ttft_ms >= OPTS.prefill_ms(1) - 1e-9
        assert record.token_times_ms == sorted(record.token_times_ms)
    assert {r.worker_id for r in records.values()} == {0, 1, 2, 3}
    assert all(p.kv_events and p.load_reports for p in pubs)
    # Deterministic: the same trace replays to the same timings.
    again = run_trace(trace, [VirtualWorker(o) for o in opts], round_robin())
    assert [r.token_times_ms for r in again.values()] == [r.token_times_ms for r in records.values()]


def test_prefix_aware_routing_gets_more_cache_hits() -> None:
    trace = _trace(300, seed=1)

    def replay(policy: object) -> dict[str, RequestRecord]:
        workers = [VirtualWorker(MockerOptions(eos_rate=0.0, num_blocks=128, worker_id=i)) for i in range(4)]
        return run_trace(trace, workers, policy)  # type: ignore[arg-type]

    def hit_tokens(records: dict[str, RequestRecord]) -> int:
        return sum(r.cached_tokens for r in records.values())

    def mean_ttft(records: dict[str, RequestRecord]) -> float:
        return sum(r.ttft_ms or 0.0 for r in records.values()) / len(records)

    by_prefix, blind = replay(_by_group), replay(round_robin())
    assert hit_tokens(by_prefix) > hit_tokens(blind)
    assert mean_ttft(by_prefix) < mean_ttft(blind)


def test_trace_must_be_time_ordered_and_ids_unique() -> None:
    with pytest.raises(ValueError):
        run_trace([(5.0, req("a", range(4))), (1.0, req("b", range(4)))], [VirtualWorker(OPTS)])
    worker = VirtualWorker(OPTS)
    worker.submit(req("a", range(4)), 0.0)
    with pytest.raises(ValueError):
        worker.submit(req("a", range(4)), 0.0)
    with pytest.raises(ValueError):
        run_trace([], [])
