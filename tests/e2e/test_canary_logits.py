"""Silent corruption caught by logits, not tokens: in a fleet of four real workers one
is switched to ``corrupt:subtle=1`` (its tokens stay right, its log-probabilities
drop); the canaries, learnt from agreeing workers, catch it by the top logprob range
and take it out of routing, and no healthy worker is touched."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.e2e.test_health import _canary_checks, _fault, _wait, _workers
from tests.helpers import kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.slow]

ARGS = ("--admin", "--canary-interval", "0.5", "--canary-timeout", "2", "--breaker-recovery", "60")


def _results(url: str, worker: str, result: str) -> int:
    text = httpx.get(url + "/metrics").text
    pattern = rf'kvmesh_health_check_duration_seconds_count\{{check_type="canary",result="{result}",worker_id="{worker}"\}} ([0-9.e+]+)'
    return int(sum(float(v) for v in re.findall(pattern, text)))


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
        _fault(url, bad, "corrupt:subtle=1")
        _wait(lambda: _workers(url)[bad]["status"] == "unhealthy", 60, lambda: f"detection (now {_workers(url)[bad]})")
        assert _workers(url)[bad]["weight"] == 0.0
        assert _results(url, bad, "logit_out_of_range") >= 1
        assert _results(url, bad, "wrong_tokens") == 0, "the subtle fault must not change tokens"
        assert all(_results(url, w, "logit_out_of_range") == 0 for w in good)
        assert all(_workers(url)[w]["status"] == "healthy" for w in good)
        assert all(_canary_checks(url, w) >= 1 for w in good)
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
