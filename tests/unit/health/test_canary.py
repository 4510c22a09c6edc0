"""Canary set format (JSON round trip, validation) and reply evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.health.canary import (
    Canary,
    CanaryOutput,
    CanarySet,
    decode_canaries,
    encode_canaries,
    evaluate,
    load_canaries,
    record_canaries,
    save_canaries,
)
from kvmesh.health.state import CheckKind, EmaBaseline

CANARY = Canary([1, 2, 3, 4], [17, 42], (-0.5, 0.0), name="two-tokens")


def test_exact_tokens_pass() -> None:
    result = evaluate(CANARY, [17, 42], [-0.1, -0.2], 0.02, None)
    assert result.ok and result.latency_s == 0.02


def test_no_response_is_a_timeout() -> None:
    assert evaluate(CANARY, None, None, 5.0, 0.02).kind is CheckKind.TIMEOUT


@pytest.mark.parametrize("tokens", [[17], [17, 43], [17, 42, 1], []])
def test_any_token_difference_fails(tokens: list[int]) -> None:
    result = evaluate(CANARY, tokens, None, 0.02, None)
    assert result.kind is CheckKind.WRONG_TOKENS and result.corruption
    assert "expected [17, 42]" in result.detail


@pytest.mark.parametrize("top", [-0.51, 0.01, -3.0])
def test_top_logprob_out_of_range_fails(top: float) -> None:
    result = evaluate(CANARY, [17, 42], [top, -0.1], 0.02, None)
    assert result.kind is CheckKind.LOGIT_OUT_OF_RANGE and result.corruption


def test_range_bounds_are_inclusive_and_only_checked_with_logprobs() -> None:
    assert evaluate(CANARY, [17, 42], [-0.5], 0.02, None).ok
    assert evaluate(CANARY, [17, 42], [0.0], 0.02, None).ok
    assert evaluate(CANARY, [17, 42], None, 0.02, None).ok
    assert evaluate(CANARY, [17, 42], [], 0.02, None).ok
    no_range = Canary([1], [2])
    assert evaluate(no_range, [2], [-9.0], 0.02, None).ok


def test_token_mismatch_wins_over_other_failures() -> None:
    assert evaluate(CANARY, [1, 1], [-9.0], 10.0, 0.01).kind is CheckKind.WRONG_TOKENS


def test_latency_spike_against_the_ema_baseline() -> None:
    ema = EmaBaseline(0.1)
    for latency in (0.020, 0.030, 0.020, 0.025):
        ema.update(latency)
    base = ema.value
    assert base is not None
    assert evaluate(CANARY, [17, 42], None, 3.0 * base, base).ok
    spike = evaluate(CANARY, [17, 42], None, 3.0 * base + 1e-6, base)
    assert spike.kind is CheckKind.LATENCY_SPIKE and not spike.corruption
    assert evaluate(CANARY, [17, 42], None, 3.0 * base + 1e-6, base, spike_factor=4.0).ok
    assert evaluate(CANARY, [17, 42], None, 100.0, None).ok  # no baseline yet
    assert evaluate(CANARY, [17, 42], None, 100.0, 0.0).ok


def test_canaries_are_validated() -> None:
    with pytest.raises(ValueError):
        Canary([], [1])
    with pytest.raises(ValueError):
        Canary([1], [])
    with pytest.raises(ValueError):
        Canary([1], [2], (0.0, -1.0))
    assert CANARY.max_tokens == 2


def test_json_round_trip(tmp_path: Path) -> None:
    canaries = CanarySet([CANARY, Canary([5], [6])], model="kvmesh-tiny")
    path = tmp_path / "canaries.json"
    save_canaries(path, canaries)
    assert load_canaries(path) == canaries
    assert b'"prompt_token_ids"' in path.read_bytes()


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"canaries": [{"prompt_token_ids": [], "expected_token_ids": [1]}]}',
        '{"canaries": [{"prompt_token_ids": [1]}]}',
        '{"canaries": [], "version": 99}',
    ],
)
def test_bad_files_raise_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        decode_canaries(text)


def test_record_canaries_from_known_good_outputs() -> None:
    outputs = [
        CanaryOutput([1, 2, 3], [9, 8], [-0.2, -0.4], name="a"),
        CanaryOutput([4, 5], [7], None),
        CanaryOutput([6], [3], [-2.5]),
    ]
    recorded = record_canaries(outputs, model="m", logprob_margin=0.5)
    assert recorded.model == "m"
    a, b, c = recorded.canaries
    assert (a.prompt_token_ids, a.expected_token_ids, a.name) == ([1, 2, 3], [9, 8], "a")
    assert a.top_logprob_range == pytest.approx((-0.7, 0.0))  # clipped: a logprob is <= 0
    assert b.top_logprob_range is None
    assert c.top_logprob_range == pytest.approx((-3.0, -2.0))
    # a recorded set passes on the output it was recorded from, and survives JSON
    assert evaluate(a, [9, 8], [-0.2], 0.01, None).ok
    assert decode_canaries(encode_canaries(recorded)) == recorded
    with pytest.raises(ValueError):
        record_canaries(outputs, logprob_margin=-1.0)
