"""The step's inlined draw (``Scheduler._draw_all``) is the oracle's ``_draw``, token for
token: every EOS rule (``ignore_eos``, ``min_tokens``, the first position after the
user's prompt) at every position, and the StepOutput it builds."""

from __future__ import annotations

import random

import pytest

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.scheduler import MockSeq, Scheduler
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions

pytestmark = pytest.mark.timeout(60)


def _seq(sched: Scheduler, rng: random.Random, i: int) -> MockSeq:
    prompt = [rng.randrange(100, 2000) for _ in range(rng.randrange(1, 40))]
    request = PreprocessedRequest(
        request_id=f"r{i}",
        model="m",
        token_ids=prompt,
        stop=StopConditions(max_tokens=64, min_tokens=rng.choice([0, 1, 5, 20]), ignore_eos=rng.random() < 0.3),
        sampling=SamplingOptions(seed=rng.choice([None, i])),
        original_prompt_len=rng.choice([None, max(1, len(prompt) - rng.randrange(0, 10))]),
    )
    seq = sched.get(sched.submit(request))
    assert seq is not None
    return seq


@pytest.mark.parametrize("eos_rate", [0.0, 0.3, 0.9])
def test_the_inlined_draw_is_the_oracles_at_every_position(eos_rate: float) -> None:
    sched = Scheduler(MockerOptions(worker_id=1, speedup=1e9, vocab_size=512, eos_rate=eos_rate, eos_token_ids=(2,)))
    rng = random.Random(eos_rate)
    seqs = [_seq(sched, rng, i) for i in range(60)]
    eos = 0
    for _ in range(30):  # walk every sequence through positions: prompt end, min_tokens, past them
        drawn = sched._draw_all(seqs)
        assert drawn == {s.id: sched._draw(s) for s in seqs}
        eos += sum(1 for t in drawn.values() if t < 0)
        for s in seqs:
            s.tokens.append(rng.randrange(100, 2000))
    assert (eos > 0) == (eos_rate > 0)  # the EOS branch was taken when it can be
