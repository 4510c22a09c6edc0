"""The hf sampler on hand-made logits: bans, penalties, truncation, seeded draws."""

from __future__ import annotations

import pytest

from kvmesh.engines.hf.sampling import SampleParams, sample
from tests.unit.hf.conftest import torch

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_bans_and_logprobs():
    assert sample(LOGITS, [SampleParams()])[0].token == 4
    out = sample(LOGITS, [SampleParams(banned=(4,), logprobs=2)])[0]
    assert out.token == 0  # the best one left
    assert out.logprob.top[0][0] == 0 and len(out.logprob.top) == 2
    assert out.logprob.logprob == pytest.approx(torch.log_softmax(LOGITS[0, :4], -1)[0].item(), abs=1e-6)


def test_penalties_follow_the_openai_and_ctrl_definitions():
    # repetition: positive logits divided, negative multiplied, for seen tokens only
    out = sample(LOGITS, [SampleParams(repetition_penalty=2.0, history=(4, 0), logprobs=5)])[0]
    assert out.token == 4 and dict(out.logprob.top)[4] > dict(out.logprob.top)[1]
    assert sample(LOGITS, [SampleParams(repetition_penalty=4.0, history=(4,))])[0].token == 0  # 3/4 < 2
    # presence + frequency: subtract presence once and frequency per occurrence
    assert sample(LOGITS, [SampleParams(presence_penalty=0.5, frequency_penalty=0.3, output=(4, 4))])[0].token == 0
    assert sample(LOGITS, [SampleParams(frequency_penalty=0.3, output=(4, 4))])[0].token == 4  # 3 - 0.6 > 2


def test_truncation_and_seeded_draws():
    narrow = [SampleParams(temperature=1.0, top_p=0.01, generator=_gen(s)) for s in range(20)]
    assert {r.token for r in sample(LOGITS.repeat(20, 1), narrow)} == {4}  # top_p keeps only the best
    top2 = [SampleParams(temperature=5.0, top_k=2, generator=_gen(s)) for s in range(40)]
    assert {r.token for r in sample(LOGITS.repeat(40, 1), top2)} == {0, 4}
    minp = [SampleParams(temperature=1.0, min_p=0.3, generator=_gen(s)) for s in range(40)]
    assert {r.token for r in sample(LOGITS.repeat(40, 1), minp)} <= {0, 4}  # p(1)/p(4) = 0.14 < 0.3
    wide = [SampleParams(temperature=2.0, generator=_gen(s)) for s in range(60)]
    draws = [r.token for r in sample(LOGITS.repeat(60, 1), wide)]
    assert len(set(draws)) >= 4
    again = [SampleParams(temperature=2.0, generator=_gen(s)) for s in range(60)]
    assert [r.token for r in sample(LOGITS.repeat(60, 1), again)] == draws
