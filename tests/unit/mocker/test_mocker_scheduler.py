"""The mocker's options, deterministic tokens and scheduler: prefix hits, chunked
prefill, preemption, the timing model, finish rules, migration continuation, and KV
events that replay into exactly ``kv_dump()`` after random workloads."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.scheduler import Finished, Scheduler, StepOutput
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, PreprocessedRequest
from kvmesh.protocol import SamplingOptions, StopConditions
from kvmesh.runtime.events import RecordingPublisher

FAST = MockerOptions(eos_rate=0.0)


def req(
    rid: str,
    tokens: list[int] | range,
    max_tokens: int | None = 8,
    *,
    seed: int | None = None,
    ignore_eos: bool = True,
    min_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
    eos_ids: tuple[int, ...] = (),
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="mock",
        token_ids=list(tokens),
        sampling=SamplingOptions(seed=seed),
        stop=StopConditions(
            max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop_ids)
        ),
        eos_token_ids=list(eos_ids),
    )


class Run:
    """Everything a scheduler produced until it went idle."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, Finished] = {}
        self.steps: list[StepOutput] = []

    def absorb(self, out: StepOutput) -> None:
        self.steps.append(out)
        for sid, token in out.tokens.items():
            self.tokens.setdefault(sid, []).append(token)
        for fin in out.finished:
            self.finished[fin.seq_id] = fin


def run(sched: Scheduler, max_steps: int = 20_000) -> Run:
    result = Run()
    for _ in range(max_steps):
        if not sched.has_work:
            return result
        result.absorb(sched.step())
    raise AssertionError("scheduler did not finish")


def solo(request: PreprocessedRequest, options: MockerOptions = FAST) -> tuple[list[int], Finished]:
    """Tokens and finish of ``request`` run alone on a fresh scheduler."""
    sched = Scheduler(options)
    sid = sched.submit(request)
    result = run(sched)
    return result.tokens.get(sid, []), result.finished[sid]


def replay(events: list[KvEvent]) -> set[int]:
    cached: set[int] = set()
    for event in events:
        data = event.data
        if isinstance(data, BlockStored):
            assert cached.isdisjoint(data.block_hashes)
            cached.update(data.block_hashes)
        elif isinstance(data, BlockRemoved):
            assert set(data.block_hashes) <= cached
            cached.difference_update(data.block_hashes)
        else:
            assert isinstance(data, AllBlocksCleared)
            cached.clear()
    return cached


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("num_blocks", -1),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("speedup", 0.0),
        ("speedup", float("inf")),
        ("eos_rate", 1.5),
        ("vocab_size", 2),
        ("prefill_coeffs", (1.0, 2.0)),
        ("model", ""),
        ("worker_id", -1),
    ],
)
def test_options_reject_bad_values(field: str, value: object) -> None:
    kwargs: dict[str, object] = {field: value}
    if field == "vocab_size":
        kwargs["eos_token_ids"] = (0, 1)
    with pytest.raises(ValueError):
        MockerOptions(**kwargs)  # type: ignore[arg-type]


def test_options_timing_polynomials_and_speedup() -> None:
    opts = MockerOptions()
    assert opts.prefill_ms(1000) == pytest.approx(4.21e-7 * 1000**2 + 1.518e-2 * 1000 + 16.5)
    assert opts.decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert opts.step_ms(0, 0, 0.5) == 0.0
    assert opts.step_ms(100, 3, 0.5) == pytest.approx(opts.prefill_ms(100) + opts.decode_ms(0.5))
    fast = dataclasses.replace(opts, speedup=4.0)
    assert fast.step_ms(100, 3, 0.5) == pytest.approx(opts.step_ms(100, 3, 0.5) / 4)
    custom = MockerOptions(prefill_coeffs=(0.0, 1.0, 0.0), decode_coeffs=(0.0, 0.0, 2.0))
    assert custom.step_ms(7, 1, 0.9) == pytest.approx(9.0)
    assert opts.served_name == "mocker" and MockerOptions(served_model_name="x").served_name == "x"


# ---------------------------------------------------------------------------- prefix cache


def test_shared_prefix_is_a_cache_hit() -> None:
    sched = Scheduler(FAST)
    first = sched.submit(req("a", range(64)))
    run(sched)
    shared = list(range(48)) + [1000 + i for i in range(20)]  # 3 shared blocks, then new
    sid = sched.submit(req("b", shared))
    out = sched.step()
    assert out.prefill_tokens == len(shared) - 48
    result = run(sched)
    assert result.finished[sid].usage.cached_tokens == 48
    assert first != sid


def test_identical_prompt_recomputes_at_least_its_last_token() -> None:
    sched = Scheduler(FAST)
    sched.submit(req("a", range(64)))
    run(sched)
    sid = sched.submit(req("b", range(64)))
    out = sched.step()
    # 64 tokens = 4 full blocks, but the last token must run to sample from it.
    assert out.prefill_tokens == 16
    assert sid in out.tokens
    assert run(sched).finished[sid].usage.cached_tokens == 48


def test_no_prefix_hits_without_prefix_caching() -> None:
    opts = dataclasses.replace(FAST, enable_prefix_caching=False)
    sched = Scheduler(opts)
    sched.submit(req("a", range(64)))
    run(sched)
    sid = sched.submit(req("b", range(64)))
    assert sched.step().prefill_tokens == 64
    assert run(sched).finished[sid].usage.cached_tokens == 0


def test_generated_blocks_are_cached_during_decode() -> None:
    pub = RecordingPublisher()
    sched = Scheduler(dataclasses.replace(FAST, block_size=4), pub)
    sched.submit(req("a", range(6), max_tokens=10))
    sched.step()  # prefill 6 tokens: 1 full block cached
    assert len(sched.kv_dump()) == 1
    sched.step()  # token 7 computed: nothing new
    sched.step()  # token 8 computed: the second block is full
    assert len(sched.kv_dump()) == 2
    run(sched)
    # 6 + 10 tokens, the last one never computed: 15 computed -> 3 full blocks.
    assert len(sched.kv_dump()) == 3
    assert replay(pub.kv_events) == sched.kv_dump()


# ---------------------------------------------------------------------------- batching


def test_chunked_prefill_respects_the_budget() -> None:
    opts = dataclasses.replace(FAST, max_num_batched_tokens=32)
    sched = Scheduler(opts)
    sid = sched.submit(req("long", range(100), max_tokens=20))
    chunks = []
    while sid not in (out := sched.step()).tokens:
        chunks.append(out.prefill_tokens)
    chunks.append(out.prefill_tokens)
    assert chunks == [32, 32, 32, 4]
    # New arrivals share the budget with running decodes, which go first.
    for i in range(3):
        sched.submit(req(f"r{i}", [500 + i] * 70, max_tokens=10))
    result = run(sched)
    for step in result.steps:
        assert step.prefill_tokens + step.decode_seqs <= 32
    assert any(s.decode_seqs and s.prefill_tokens == 32 - s.decode_seqs for s in result.steps)
    assert all(f.reason == "length" for f in result.finished.values())


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = Scheduler(dataclasses.replace(FAST, max_num_seqs=2))
    for i in range(5):
        sched.submit(req(f"r{i}", [i] * 10, max_tokens=5))
    peak = 0
    while sched.has_work:
        sched.step()
        peak = max(peak, sched.num_running)
        assert sched.num_running <= 2
    assert peak == 2


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    sched = Scheduler(dataclasses.replace(FAST, max_num_seqs=1))
    sids = [sched.submit(req(f"r{i}", [i] * 10, max_tokens=3)) for i in range(4)]
    result = run(sched)
    first_token_step = {sid: next(i for i, s in enumerate(result.steps) if sid in s.tokens) for sid in sids}
    assert sorted(sids, key=first_token_step.__getitem__) == sids


def test_preemption_under_block_pressure_keeps_the_tokens() -> None:
    opts = dataclasses.replace(FAST, block_size=4, num_blocks=8)
    reqs = [req("a", range(8), max_tokens=12), req("b", range(100, 108), max_tokens=12)]
    sched = Scheduler(opts)
    sids = [sched.submit(r) for r in reqs]
    result = run(sched)
    preempted = [sid for step in result.steps for sid in step.preempted]
    assert preempted and preempted[0] == sids[1]  # the most recently admitted gives way
    for sid, r in zip(sids, reqs):
        assert result.finished[sid].reason == "length"
        assert result.tokens[sid] == solo(r)[0]
    assert sched.blocks.active_blocks == 0


@pytest.mark.parametrize("caching", [True, False])
def test_heavy_preemption_still_completes_every_request(caching: bool) -> None:
    opts = dataclasses.replace(
        FAST, block_size=4, num_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=caching
    )
    reqs = [req(f"r{i}", [i % 3] * (5 + i), max_tokens=14) for i in range(8)]
    sched = Scheduler(opts)
    sids = [sched.submit(r) for r in reqs]
    result = run(sched)
    assert sum(len(step.preempted) for step in result.steps) > 0
    for sid, r in zip(sids, reqs):
        assert result.finished[sid].reason == "length"
        assert result.tokens[sid] == solo(r)[0]


def test_requests_that_can_never_fit_fail() -> None:
    opts = dataclasses.replace(FAST, block_size=4, num_blocks=8)
    sched = Scheduler(opts)
    too_long = sched.submit(req("big", range(40)))  # 40 tokens > 32 slots
    grows_too_long = sched.submit(req("grows", range(8), max_tokens=100))
    empty = sched.submit(req("empty", []))
    zero = sched.submit(req("zero", range(4), max_tokens=0))
    result = run(sched)
    for sid in (too_long, empty, zero):
        assert result.finished[sid].reason == "error"
        assert result.finished[sid].error
        assert result.finished[sid].usage.completion_tokens == 0
    fin = result.finished[grows_too_long]
    assert fin.reason == "error" and "exceeds the KV cache" in (fin.error or "")
    # Tokens fill all 32 slots (the 32nd slot's KV still samples one more), then no room.
    assert len(result.tokens[grows_too_long]) == 32 - 8 + 1
    assert sched.blocks.active_blocks == 0


def test_prompt_filling_the_context_fails_and_max_tokens_defaults_to_the_rest() -> None:
    opts = dataclasses.replace(FAST, context_length=40)
    tokens, fin = solo(req("a", range(30), max_tokens=None), opts)
    assert len(tokens) == 10 and fin.reason == "length"
    tokens, fin = solo(req("b", range(30), max_tokens=100), opts)
    assert len(tokens) == 10
    assert solo(req("c", range(40)), opts)[1].reason == "error"


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    sched = Scheduler(dataclasses.replace(FAST, max_num_seqs=1))
    running = sched.submit(req("a", range(40), max_tokens=50))
    waiting = sched.submit(req("b", range(40, 80), max_tokens=50))
    sched.step()
    assert sched.blocks.active_blocks > 0
    assert sched.abort(waiting) and sched.abort(running)
    assert not sched.abort(running)
    assert sched.blocks.active_blocks == 0 and not sched.has_work
    assert sched.load_report().num_running == 0


# ---------------------------------------------------------------------------- timing


def test_step_durations_follow_the_timing_model() -> None:
    opts = MockerOptions(eos_rate=0.0, num_blocks=64, speedup=2.0)
    base = dataclasses.replace(opts, speedup=1.0)
    sched = Scheduler(opts)
    sched.submit(req("a", range(100), max_tokens=30))
    out = sched.step()
    assert (out.prefill_tokens, out.decode_seqs) == (100, 0)
    assert out.duration_ms == pytest.approx((4.21e-7 * 100**2 + 1.518e-2 * 100 + 16.5) / 2)
    out = sched.step()
    p = 101 / (64 * opts.block_size)  # the decode attends to 100 prompt tokens and 1 generated
    assert (out.prefill_tokens, out.decode_seqs) == (0, 1)
    assert out.duration_ms == pytest.approx((-25.74 * p * p + 54.01 * p + 5.74) / 2)
    sched.submit(req("b", range(500, 550), max_tokens=5))
    out = sched.step()
    p = 102 / (64 * opts.block_size)  # "a"'s decode (101 + 1 tokens); "b" prefills and does not count
    assert (out.prefill_tokens, out.decode_seqs) == (50, 1)
    assert out.duration_ms == pytest.approx((base.prefill_ms(50) + base.decode_ms(p)) / 2)


# ---------------------------------------------------------------------------- tokens


def test_tokens_are_deterministic_across_modes() -> None:
    r = req("a", range(37), max_tokens=60, ignore_eos=False)
    reference = solo(r, MockerOptions())
    variants = [
        MockerOptions(enable_prefix_caching=False),
        MockerOptions(block_size=4, max_num_batched_tokens=8, num_blocks=32),
        MockerOptions(speedup=1e9, worker_id=7),
    ]
    for opts in variants:
        tokens, fin = solo(r, opts)
        assert (tokens, fin.reason) == (reference[0], reference[1].reason)
    other_prompt = solo(req("b", range(1, 38), max_tokens=60, ignore_eos=False), MockerOptions())
    assert other_prompt[0] != reference[0]


def test_seed_replaces_the_prompt_as_the_key() -> None:
    a = solo(req("a", range(10), seed=5))[0]
    b = solo(req("b", range(10), seed=6))[0]
    c = solo(req("c", range(20, 30), seed=5))[0]
    assert a != b
    assert a == c  # same seed, same positions


def test_ignore_eos_gives_exactly_max_tokens() -> None:
    opts = MockerOptions(eos_rate=1.0)  # every position would be an EOS
    tokens, fin = solo(req("a", range(10), max_tokens=25, ignore_eos=True), opts)
    assert len(tokens) == 25 and fin.reason == "length" and fin.usage.completion_tokens == 25


def test_natural_eos_respects_min_tokens_and_is_not_emitted() -> None:
    opts = MockerOptions(eos_rate=1.0, eos_token_ids=(0,))
    tokens, fin = solo(req("a", range(10), max_tokens=25, ignore_eos=False, min_tokens=3), opts)
    assert len(tokens) == 3 and fin.reason == "stop" and 0 not in tokens
    # The first token is never an EOS: a completion is never empty.
    tokens, fin = solo(req("b", range(10), max_tokens=25, ignore_eos=False), opts)
    assert len(tokens) == 1 and fin.reason == "stop"
    # With a configured probability, long generations end early with "stop".
    for i in range(5):
        early = solo(req(f"r{i}", [i] * 5, max_tokens=2000, ignore_eos=False), MockerOptions(eos_rate=1 / 64))
        assert early[1].reason == "stop" and 1 <= len(early[0]) < 2000


def test_default_generates_the_requested_length_without_ignore_eos() -> None:
    # By default (eos_rate 0, --eos-probability 0) every request gets max_tokens.
    assert MockerOptions().eos_rate == 0.0
    for i in range(5):
        tokens, fin = solo(req(f"r{i}", [i] * 5, max_tokens=500, ignore_eos=False), MockerOptions())
        assert len(tokens) == 500 and fin.reason == "length" and fin.usage.completion_tokens == 500


def test_a_migrated_request_may_end_on_eos_at_its_first_new_position() -> None:
    # The "never empty" rule counts from the user's prompt, not the re-issued one.
    opts = MockerOptions(eos_rate=1.0)
    tokens, fin = solo(req("a", range(10), max_tokens=25, ignore_eos=False), opts)
    assert len(tokens) == 1
    resumed = msgspec.structs.replace(
        req("a", [*range(10), *tokens], max_tokens=24, ignore_eos=False), original_prompt_len=10
    )
    rest, rest_fin = solo(resumed, opts)
    assert rest == [] and rest_fin.reason == "stop"


def test_stop_token_ids_end_the_stream_with_the_token() -> None:
    full, _ = solo(req("a", range(10), max_tokens=30))
    j = next(i for i in range(3, 30) if full[i] not in full[:i])
    tokens, fin = solo(req("a", range(10), max_tokens=30, stop_ids=(full[j],)))
    assert tokens == full[: j + 1] and fin.reason == "stop"
    tokens, fin = solo(req("a", range(10), max_tokens=30, stop_ids=(full[j],), min_tokens=30))
    assert tokens == full and fin.reason == "length"


def test_eos_and_special_ids_are_never_drawn() -> None:
    opts = MockerOptions(vocab_size=8, eos_token_ids=(0, 1), special_token_ids=(3,), eos_rate=0.0)
    tokens, _ = solo(req("a", range(5), max_tokens=300, eos_ids=(2,)), opts)
    assert set(tokens) == {4, 5, 6, 7}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    prompt=st.lists(st.integers(0, 2047), min_size=1, max_size=40),
    max_tokens=st.integers(1, 40),
    min_tokens=st.integers(0, 10),
    cut=st.floats(0.0, 1.0),
)
def test_migration_continues_the_identical_stream(
    seed: int, prompt: list[int], max_tokens: int, min_tokens: int, cut: float
) -> None:
    opts = MockerOptions(eos_rate=0.1)
    original = req("a", prompt, max_tokens, seed=seed, ignore_eos=False, min_tokens=min_tokens)
    tokens, fin = solo(original, opts)
    k = int(cut * len(tokens))
    resumed = req(
        "a-migrated",
        prompt + tokens[:k],
        max_tokens - k,
        seed=seed,
        ignore_eos=False,
        min_tokens=max(0, min_tokens - k),
    )
    resumed = msgspec.structs.replace(resumed, original_prompt_len=len(prompt))  # as the frontend sends it
    if max_tokens - k == 0:
        return  # nothing left to generate: the frontend would not re-issue
    rest, rest_fin = solo(resumed, opts)
    assert rest == tokens[k:]
    assert rest_fin.reason == fin.reason


# ---------------------------------------------------------------------------- KV events


_workload = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 5), st.integers(1, 30), st.integers(1, 16)),
        st.tuples(st.just("step"), st.integers(1, 6), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(_workload, st.booleans())
def test_kv_events_replay_into_the_dump(workload: list[tuple[str, int, int, int]], reset: bool) -> None:
    pub = RecordingPublisher()
    # A pool this small forces evictions and preemptions in most workloads.
    opts = MockerOptions(block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4, eos_rate=0.05)
    sched = Scheduler(opts, pub)
    # Six prompt families sharing blocks: a common root, two branches, three leaves.
    families = [[1] * 8 + [2 + (f % 2)] * 8 + [10 + f] * 16 for f in range(6)]
    sids: list[int] = []
    for kind, a, b, c in workload:
        if kind == "add":
            sids.append(sched.submit(req(f"r{len(sids)}", families[a][:b] + [99] * (b % 3), c, ignore_eos=False)))
        elif kind == "step":
            for _ in range(a):
                if sched.has_work:
                    sched.step()
        elif sids:
            sched.abort(sids[a % len(sids)])
        assert replay(pub.kv_events) == sched.kv_dump()
    if reset:
        sched.reset()
    run(sched)
    assert replay(pub.kv_events) == sched.kv_dump()
    assert [e.event_id for e in pub.kv_events] == list(range(len(pub.kv_events)))
    assert sched.blocks.active_blocks == 0
    assert sched.blocks.ring.since(-1) == pub.kv_events[-1024:]


def test_load_report_counts() -> None:
    sched = Scheduler(dataclasses.replace(FAST, max_num_seqs=1, worker_id=4))
    sched.submit(req("a", range(40)))
    sched.submit(req("b", range(40)))
    sched.step()
    report = sched.load_report(timestamp_ms=12.5)
    assert (report.worker_id, report.num_running, report.num_waiting) == (4, 1, 1)
    assert report.active_blocks == sched.blocks.active_blocks > 0
    assert report.total_blocks == FAST.num_blocks and report.timestamp_ms == 12.5


def test_premium_requests_wait_ahead_of_standard_and_best_effort():
    from kvmesh.engines.mocker import MockerOptions
    from kvmesh.engines.mocker.scheduler import Scheduler
    from kvmesh.protocol import PreprocessedRequest, RoutingHints, StopConditions

    sched = Scheduler(MockerOptions(max_num_seqs=1, eos_rate=0.0))

    def add(name: str, priority: str | None) -> int:
        routing = RoutingHints(priority=priority) if priority else None
        req = PreprocessedRequest(request_id=name, model="m", token_ids=[5, 6, 7], routing=routing,
                                  stop=StopConditions(max_tokens=2, ignore_eos=True))  # fmt: skip
        return sched.submit(req)

    order = [add("be1", "best_effort"), add("std1", None), add("prem1", "premium"), add("std2", "standard"), add("prem2", "premium")]
    finished: list[str] = []
    for _ in range(100):
        out = sched.step()
        finished += [f.request_id for f in out.finished]
        if not sched.has_work:
            break
    assert len(order) == 5
    # all five wait before the first step: premium first, FCFS within each tier
    assert finished == ["prem1", "prem2", "std1", "std2", "be1"]


def test_premium_arrival_preempts_the_least_urgent_running_request_which_still_completes():
    from kvmesh.engines.mocker import MockerOptions
    from kvmesh.engines.mocker.scheduler import Scheduler
    from kvmesh.protocol import PreprocessedRequest, RoutingHints, StopConditions

    sched = Scheduler(MockerOptions(max_num_seqs=2, eos_rate=0.0))

    def add(name: str, priority: str) -> None:
        req = PreprocessedRequest(request_id=name, model="m", token_ids=[5, 6, 7, 8], routing=RoutingHints(priority=priority),
                                  stop=StopConditions(max_tokens=6, ignore_eos=True))  # fmt: skip
        sched.submit(req)

    add("std", "standard")
    add("be", "best_effort")
    sched.step()  # both running
    add("prem", "premium")
    out = sched.step()
    assert len(out.preempted) == 1  # the best-effort one made room
    finished: dict[str, int] = {}
    for _ in range(100):
        for f in sched.step().finished:
            finished[f.request_id] = f.usage.completion_tokens
        if not sched.has_work:
            break
    assert finished == {"std": 6, "be": 6, "prem": 6}


def test_batch_multiplier_caps_running_sequences():
    import pytest

    from kvmesh.engines.mocker import MockerOptions
    from kvmesh.engines.mocker.scheduler import Scheduler
    from kvmesh.protocol import PreprocessedRequest, StopConditions

    sched = Scheduler(MockerOptions(max_num_seqs=4, eos_rate=0.0))
    sched.set_batch_multiplier(0.5)
    for i in range(6):
        sched.submit(PreprocessedRequest(request_id=str(i), model="m", token_ids=[5, 6, 7], stop=StopConditions(max_tokens=3, ignore_eos=True)))
    sched.step()
    assert sched.num_running == 2 and sched.num_waiting == 4
    sched.set_batch_multiplier(1.0)
    sched.step()
    assert sched.num_running == 4
    with pytest.raises(ValueError):
        sched.set_batch_multiplier(0.0)


def test_reduced_batch_still_lets_premium_fill_the_full_batch():
    from kvmesh.engines.mocker import MockerOptions
    from kvmesh.engines.mocker.scheduler import Scheduler
    from kvmesh.protocol import PreprocessedRequest, RoutingHints, StopConditions

    sched = Scheduler(MockerOptions(max_num_seqs=4, eos_rate=0.0))
    sched.set_batch_multiplier(0.5)
    for i in range(3):
        sched.submit(PreprocessedRequest(request_id=f"s{i}", model="m", token_ids=[5, 6, 7], stop=StopConditions(max_tokens=9, ignore_eos=True)))
    sched.step()
    assert sched.num_running == 2  # standard requests get the reduced batch
    for i in range(3):
        sched.submit(PreprocessedRequest(request_id=f"p{i}", model="m", token_ids=[5, 6, 7], routing=RoutingHints(priority="premium"),
                                      stop=StopConditions(max_tokens=9, ignore_eos=True)))  # fmt: skip
    sched.step()
    assert sched.num_running == 4  # premium fills up to max_num_seqs
