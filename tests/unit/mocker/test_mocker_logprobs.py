"""The mocker's log-probabilities: a pure function of (stream key, position) like its
tokens, the same on every engine, across a migration's re-issue; a ``corrupt`` fault
shifts them, ``corrupt:subtle=1`` without touching the tokens."""

from __future__ import annotations

import pytest

from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.engines.mocker.faults import CORRUPT_LOGPROB_SHIFT, FaultSpec
from kvmesh.engines.mocker.tokens import TOP_LOGPROB_MAX, TOP_LOGPROB_MIN, logprob_at, top_alternatives
from kvmesh.protocol import OutputOptions, PreprocessedRequest, SamplingOptions, StopConditions, TokenLogprob
from kvmesh.runtime.context import Context

FAST = MockerOptions(speedup=1e9)


def req(prompt: list[int], n: int = 8, logprobs: int | None = 0, rid: str = "r", **extra: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="mock",
        token_ids=prompt,
        sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=n, ignore_eos=True),
        output=OutputOptions(logprobs=logprobs),
        **extra,  # type: ignore[arg-type]
    )


async def generate(request: PreprocessedRequest, fault: FaultSpec | None = None) -> tuple[list[int], list[TokenLogprob]]:
    engine = MockerEngine(FAST if fault is None else MockerOptions(speedup=1e9, fault=fault))
    await engine.start()
    tokens: list[int] = []
    lps: list[TokenLogprob] = []
    try:
        async for chunk in engine.generate(request, Context(request.request_id)):
            tokens.extend(chunk.token_ids)
            lps.extend(chunk.logprobs or [])
    finally:
        await engine.cleanup()
    return tokens, lps


def test_logprob_is_a_pure_function_in_a_confident_range() -> None:
    values = [logprob_at(key, pos) for key in (1, 2, 3) for pos in range(200)]
    assert all(TOP_LOGPROB_MIN <= v <= TOP_LOGPROB_MAX for v in values)
    assert values == [logprob_at(key, pos) for key in (1, 2, 3) for pos in range(200)]
    assert len(set(values)) > 500  # it moves with key and position


def test_alternatives_start_with_the_token_and_fall() -> None:
    top = top_alternatives(7, -0.2, 3, 10)
    assert top[0] == (7, -0.2) and [t for t, _ in top] == [7, 8, 9]
    assert top[0][1] > top[1][1] > top[2][1]


async def test_same_logprobs_on_two_engines_and_one_per_token() -> None:
    prompt = list(range(10, 50))
    a = await generate(req(prompt, logprobs=2))
    b = await generate(req(prompt, logprobs=2, rid="other"))
    assert a == b and len(a[1]) == len(a[0]) == 8
    assert [lp.token_id for lp in a[1]] == a[0]
    assert all(len(lp.top) == 2 and lp.top[0] == (lp.token_id, lp.logprob) for lp in a[1])


async def test_a_request_without_logprobs_gets_none() -> None:
    tokens, lps = await generate(req(list(range(30)), logprobs=None))
    assert len(tokens) == 8 and lps == []


async def test_a_migrated_continuation_has_the_same_logprobs() -> None:
    prompt = list(range(5, 45))
    tokens, lps = await generate(req(prompt))
    rest, rest_lps = await generate(req(prompt + tokens[:3], n=5, original_prompt_len=len(prompt)))
    assert rest == tokens[3:] and rest_lps == lps[3:]


@pytest.mark.parametrize("subtle", [0, 1])
async def test_corrupt_shifts_logprobs_and_subtle_keeps_tokens(subtle: int) -> None:
    prompt = list(range(60))
    tokens, lps = await generate(req(prompt))
    bad_tokens, bad_lps = await generate(req(prompt), FaultSpec.parse(f"corrupt:subtle={subtle}"))
    assert (bad_tokens == tokens) is bool(subtle)
    assert [b.logprob - g.logprob for b, g in zip(bad_lps, lps)] == pytest.approx([CORRUPT_LOGPROB_SHIFT] * 8)


def test_subtle_is_parsed_and_checked() -> None:
    assert FaultSpec.parse("corrupt:subtle=1") == FaultSpec("corrupt", subtle=1)
    with pytest.raises(ValueError):
        FaultSpec.parse("corrupt:subtle=2")
