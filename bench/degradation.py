"""Graceful degradation under 3× overload: how much sooner premium requests get their
first token than standard ones, the timing tests/e2e/test_degradation.py no longer
asserts (it checks the order instead: premium sent behind a waiting standard request
gets its first token first).

    PYTHONPATH=src python bench/degradation.py              # one run
    PYTHONPATH=src python bench/degradation.py --runs 3

Each run is the test's scenario: `kvmesh run` with 2 mocker workers at a quarter speed,
--degradation and its SLO, 12 s of requests at 3× the fleet's modelled capacity, tiers
drawn premium 2 : standard 4 : best_effort 4. Printed per run, over the requests sent
after the first 4 s: TTFT p50 / p90 of premium and standard (200s), the ratio premium
p90 / standard p50 (below 1: premium's slow end is faster than standard's middle; the
test asserted this before), best-effort requests shed, the highest degradation level
seen, and the ordering count the test asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _lib import percentile  # noqa: E402

from tests.e2e.test_degradation import ARGS, SPEEDUP, WARMUP_S, Result, _highest_level, _overload, overtaking  # noqa: E402
from tests.helpers import kvmesh_run  # noqa: E402


async def _run_once(url: str) -> tuple[list[Result], float]:
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(_highest_level(url, stop))
    results = await _overload(url)
    stop.set()
    return results, await watcher


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def report(results: list[Result], level: float) -> str:
    late = [r for r in results if r.at >= WARMUP_S]
    ttft = {tier: [r.ttft_s for r in late if r.tier == tier and r.status == 200 and r.ttft_s is not None]
            for tier in ("premium", "standard")}  # fmt: skip
    p90, std_p50 = percentile(ttft["premium"], 90), percentile(ttft["standard"], 50)
    ratio = f"{p90 / std_p50:.2f}" if p90 is not None and std_p50 else "-"
    best_effort = [r for r in late if r.tier == "best_effort"]
    shed = sum(r.status == 503 for r in best_effort)
    pairs, overtook = overtaking(results)
    return (
        f"premium TTFT p50 {_ms(percentile(ttft['premium'], 50))} ms p90 {_ms(p90)} ms (n={len(ttft['premium'])}) | "
        f"standard p50 {_ms(std_p50)} ms p90 {_ms(percentile(ttft['standard'], 90))} ms (n={len(ttft['standard'])}) | "
        f"premium p90 / standard p50 ×{ratio} | best-effort shed {shed}/{len(best_effort)} | level {level:g} | "
        f"premium first in {overtook}/{pairs}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1, help="independent runs (a fresh `kvmesh run` each)")
    a = p.parse_args(argv)
    print(f"kvmesh run {' '.join(ARGS)} --workers 2 --speedup {SPEEDUP}")
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="kvmesh-degradation-") as d, kvmesh_run(Path(d), *ARGS, workers=2,
                                                                                     speedup=str(SPEEDUP)) as server:  # fmt: skip
            results, level = asyncio.run(_run_once(server.url))
        print(f"run {i + 1}: {report(results, level)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
