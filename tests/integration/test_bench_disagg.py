"""Smoke test of ``bench/disagg.py`` on a tiny slice of the conversation trace: both
arms run, every request completes, and a goodput ratio comes out (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "disagg.py"
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason=f"trace not found at {TRACE}")
def test_bench_disagg_tiny_slice(tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    # 12 requests (two bursts), fast clock, SLOs no request can miss: goodput > 0 in every arm
    cmd = [
        sys.executable, str(BENCH), "--trace", str(TRACE), "--limit", "12", "--speed", "4", "--speedup", "50",
        "--repeat", "1", "--max-wall-s", "30", "--slo-ttft-ms", "1e9", "--slo-itl-ms", "1e9", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "goodput ratio disaggregated / aggregated" in proc.stdout

    result = json.loads(out.read_text())
    arms = {arm["name"]: arm for arm in result["rounds"][0]}
    assert set(arms) == {"aggregated", "disagg 3+1", "disagg 2+2"}
    for arm in arms.values():
        assert arm["sent"] == arm["completed"] == arm["good"] == 12
        assert arm["goodput"] > 0
        counters = arm["counters"]
        assert counters["remote_prefills"] + counters["local_prefills"] == 12
    for name in ("disagg 3+1", "disagg 2+2"):
        assert arms[name]["counters"]["remote_prefills"] > 0  # long prompts did go through the queue
        assert arms[name]["counters"]["kv_bytes"] > 0
        assert result["ratios"][name] > 0
    assert result["best"] in ("disagg 3+1", "disagg 2+2")
    # the same slice on the virtual clock (kvmesh replay --arms), side by side
    virtual = result["virtual"]
    assert set(virtual["real"]) == set(virtual["virtual"]) == {"aggregated", "disagg 3+1", "disagg 2+2"}
    assert all(v > 0 for v in virtual["virtual"].values())
    assert "ordering of arms:" in proc.stdout
