"""Silent corruption caught by logits, not tokens: in a fleet of four real workers one
is switched to ``corrupt:subtle=1`` (its tokens stay right, its log-probabilities
drop); the canaries, learnt from agreeing workers, catch it by the top logprob range
and take it out of routing, and no healthy worker is touched."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_health import _canary_checks, _fault, _results, _routed, _wait, _workers
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ARGS = ("--admin", "--canary-interval", "0.5", "--canary-timeout", "2", "--breaker-recovery", "60")


def _answer(url: str, body: dict) -> tuple[str, list[float]]:
    """The completion's text and its tokens' log-probabilities."""
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_subtle_corruption_is_caught_by_the_top_logprob(tmp_path):
    with kvmesh_run(tmp_path, *ARGS, workers=4) as server:
        url = server.url
        _wait(lambda: len(_workers(url)) == 4, 60, "4 workers")
        ids = sorted(_workers(url))
        # the canaries are agreed (three identical answers) and each worker passed one
        _wait(lambda: all(_results(url, w, "ok") >= 1 for w in ids), 60, "a passing canary on every worker")
        bad, good = ids[0], ids[1:]
        # its answers keep their tokens: a token-only check would pass it
        body = {"model": "kvmesh-tiny", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 1}
        healthy = _answer(url, body)  # every worker is healthy still: any of them gives this answer
        _fault(url, bad, "corrupt:subtle=1")
        _wait(lambda: _workers(url)[bad]["status"] == "unhealthy", 60, lambda: f"detection (now {_workers(url)[bad]})")
        assert _workers(url)[bad]["weight"] == 0.0
        assert _results(url, bad, "logit_out_of_range") >= 1
        assert _results(url, bad, "wrong_tokens") == 0, "the subtle fault must not change tokens"
        assert all(_results(url, w, "logit_out_of_range") == 0 for w in good)
        assert all(_workers(url)[w]["status"] == "healthy" for w in good)
        assert all(_canary_checks(url, w) >= 1 for w in good)
        # the decisive requests: the corrupted worker serves none of them (its answers would
        # have the right tokens and lower log-probabilities), the healthy workers serve them all
        # with the answer they gave before the fault
        routed = _routed(url)
        for _ in range(8):
            text, logprobs = _answer(url, body)
            assert (text, logprobs) == (healthy[0], pytest.approx(healthy[1])), "an answer not from a healthy worker"
        now = _routed(url)
        assert now.get(bad, 0) == routed.get(bad, 0), "the corrupted worker is still routed to"
        assert sum(now.get(w, 0) - routed.get(w, 0) for w in good) == 8
        assert all(_workers(url)[w]["status"] == "healthy" and _workers(url)[w]["weight"] == 1.0 for w in good)
        assert all(_results(url, w, "logit_out_of_range") + _results(url, w, "wrong_tokens") == 0 for w in good)
