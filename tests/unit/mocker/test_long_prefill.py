"""Chunked prefill beside short prompts (vLLM V1's shared token budget): a long prompt's
chunks are capped at ``long_prefill_token_threshold`` while other prefills share the
pass, at most ``max_long_partial_prefills`` long prompts prefill at once, and short
prompts behind them are admitted in the very next pass instead of waiting for the
whole long prefill. The mocker and the hf engine share this core."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.engines.batching.scheduler import SchedulerLimits
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.scheduler import Scheduler, limits_of
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions

OPTS = MockerOptions(block_size=16, num_blocks=4096, max_num_batched_tokens=1024, context_length=16384,
                     long_prefill_token_threshold=128)  # fmt: skip


def req(rid: str, tokens: list[int] | range, max_tokens: int = 4) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="mock",
        token_ids=list(tokens),
        sampling=SamplingOptions(),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


def test_a_lone_long_prompt_prefills_at_the_full_budget() -> None:
    sched = Scheduler(OPTS)
    sid = sched.submit(req("long", range(3000)))
    chunks = []
    while sid not in (out := sched.step()).tokens:
        chunks.append(out.prefill_tokens)
    chunks.append(out.prefill_tokens)
    assert chunks == [1024, 1024, 952]


def test_a_short_prompt_is_admitted_beside_a_long_prefill() -> None:
    sched = Scheduler(OPTS)
    long_id = sched.submit(req("long", range(8000)))
    first = sched.step()
    assert first.prefill_tokens == 1024  # alone: the whole budget
    short_id = sched.submit(req("short", range(10_000, 10_100)))
    out = sched.step()
    # the short prompt's first token comes from the very next pass; the long one took
    # only its capped chunk of that pass and is still prefilling
    assert short_id in out.tokens
    assert long_id not in out.tokens
    assert out.prefill_tokens == 100 + 128


def test_without_a_threshold_the_short_prompt_waits_for_the_long_one() -> None:
    sched = Scheduler(dataclasses.replace(OPTS, long_prefill_token_threshold=0))
    long_id = sched.submit(req("long", range(8000)))
    sched.step()
    short_id = sched.submit(req("short", range(10_000, 10_300)))
    passes = 1
    while short_id not in (out := sched.step()).tokens:
        passes += 1
    assert passes == 8  # 8000 tokens at 1024 a pass, then the short one
    assert long_id in out.tokens


def test_a_prompt_over_the_threshold_counts_as_long() -> None:
    sched = Scheduler(OPTS)
    sched.submit(req("long", range(8000)))
    sched.step()
    mid = sched.submit(req("mid", range(10_000, 10_300)))  # 300 > 128: long, waits for the slot
    out = sched.step()
    assert mid not in out.tokens and sched.num_waiting == 1


def test_one_long_prefill_at_a_time_and_shorter_ones_pass_it() -> None:
    sched = Scheduler(OPTS)
    a = sched.submit(req("a", range(5000)))
    b = sched.submit(req("b", range(20_000, 25_000)))
    c = sched.submit(req("c", range(40_000, 40_100)))
    out = sched.step()
    assert c in out.tokens  # admitted past the long b, which keeps its place
    assert out.prefill_tokens == 128 + 100  # a's capped chunk and all of c
    assert sched.get(b) is not None and sched.get(b).num_computed == 0  # type: ignore[union-attr]
    assert sched.num_waiting == 1
    # once a is done prefilling, b starts
    while a not in (out := sched.step()).tokens:
        assert sched.get(b).num_computed == 0  # type: ignore[union-attr]
    sched.step()
    assert sched.get(b).num_computed > 0  # type: ignore[union-attr]


def test_max_long_partial_prefills_lets_two_long_prompts_share() -> None:
    sched = Scheduler(dataclasses.replace(OPTS, max_long_partial_prefills=2))
    sched.submit(req("a", range(5000)))
    sched.submit(req("b", range(20_000, 25_000)))
    out = sched.step()
    assert out.prefill_tokens == 1024  # two capped chunks, then topped up to the budget
    assert sched.num_waiting == 0


def test_max_num_partial_prefills_caps_the_prefills_of_a_pass() -> None:
    sched = Scheduler(dataclasses.replace(OPTS, max_num_partial_prefills=1))
    ids = [sched.submit(req(f"s{i}", range(1000 * i, 1000 * i + 100))) for i in range(3)]
    out = sched.step()
    assert list(out.tokens) == [ids[0]]
    assert sched.num_waiting == 2


def test_the_threshold_reaches_the_shared_limits() -> None:
    limits = limits_of(OPTS)
    assert (limits.long_prefill_token_threshold, limits.max_long_partial_prefills) == (128, 1)
    assert limits_of(MockerOptions()).long_prefill_token_threshold == 0  # off by default, as in vLLM
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerLimits(block_size=16, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64,
                        context_length=128, max_long_partial_prefills=0)  # fmt: skip
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        MockerOptions(long_prefill_token_threshold=-1)


def test_the_next_long_prompt_starts_in_the_pass_where_the_last_one_ends_beside_decodes() -> None:
    # every pass that carries prefill work costs the decodes in it the step's fixed
    # prefill cost: while decodes ride, a pass where a long prefill ends gives the rest of
    # its budget to the next long prompt (fewer, fuller prefill passes) instead of
    # leaving it unused
    sched = Scheduler(OPTS)
    d = sched.submit(req("d", range(50_000, 50_016), max_tokens=100))
    sched.step()  # d prefills and samples: it decodes from now on
    a = sched.submit(req("a", range(3000)))
    b = sched.submit(req("b", range(20_000, 25_000)))
    assert sched.step().prefill_tokens == 1023 and sched.step().prefill_tokens == 1023  # d's decode beside a
    out = sched.step()
    assert a in out.tokens and d in out.tokens
    assert out.prefill_tokens == 1023  # 954 of a, 69 of b: the budget stays full
    assert sched.get(b).num_computed == 69  # type: ignore[union-attr]


def test_without_decodes_the_next_long_prompt_waits_for_the_next_pass() -> None:
    # no decode pays for an extra pass, and a smaller pass lets arrivals in sooner
    sched = Scheduler(OPTS)
    a = sched.submit(req("a", range(3000)))
    b = sched.submit(req("b", range(20_000, 25_000)))
    sched.step(), sched.step()
    out = sched.step()
    assert a in out.tokens and out.prefill_tokens == 952
    assert sched.get(b).num_computed == 0  # type: ignore[union-attr]


def test_a_short_prompt_still_caps_the_long_chunk_after_the_handover() -> None:
    sched = Scheduler(OPTS)
    sched.submit(req("a", range(1100)))
    b = sched.submit(req("b", range(20_000, 25_000)))
    sched.step()  # a: 1024
    short = sched.submit(req("short", range(40_000, 40_050)))
    out = sched.step()  # a's last 76, the short prompt's 50, then b capped at 128 (a short one shares the pass)
    assert short in out.tokens
    assert sched.get(b).num_computed == 128  # type: ignore[union-attr]


def test_the_three_settings_are_flags_of_the_mocker_and_the_hf_engine() -> None:
    import argparse

    from kvmesh.cli.replay import _config, add_replay_args
    from kvmesh.engines.hf.options import HfOptions
    from kvmesh.engines.settings import HfSettings, MockerSettings, options_from
    from kvmesh.settings import add_flags, resolve

    p = argparse.ArgumentParser()
    add_replay_args(p)
    ns = p.parse_args(["t.jsonl", "--long-prefill-token-threshold", "96", "--max-long-partial-prefills", "2",
                       "--max-num-partial-prefills", "3"])  # fmt: skip
    mocker = _config(ns).mocker
    assert (mocker.long_prefill_token_threshold, mocker.max_long_partial_prefills, mocker.max_num_partial_prefills) == (96, 2, 3)
    assert limits_of(mocker).long_prefill_token_threshold == 96
    default = _config(p.parse_args(["t.jsonl"])).mocker
    assert default.long_prefill_token_threshold == 0  # unset: off
    hp = argparse.ArgumentParser()
    add_flags(hp, HfSettings)
    hf = resolve(HfSettings, hp.parse_args(["--hf-long-prefill-token-threshold", "64", "--hf-max-long-partial-prefills", "2"]))
    options = options_from(HfOptions, hf, model_path="/nonexistent")
    assert (options.long_prefill_token_threshold, options.max_long_partial_prefills) == (64, 2)
    with pytest.raises(ValueError, match="--max-long-partial-prefills"):
        MockerSettings(max_long_partial_prefills=0)
