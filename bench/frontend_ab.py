#!/usr/bin/env python3
"""A/B(/C) of the frontend's HTTP path in one run: several ``kvmesh run --workers 1
--speedup 1e9`` servers (arms) side by side, loaded one at a time in alternating
order for a few rounds, so background load hits every arm alike. Prints the median
req/s at concurrency 64 and TTFT p50 at concurrency 1 per arm, and each arm's ratio
to the first one; also the frontend's and the worker's CPU per request at c=64 (the
worker: the frontend's descendants), paired.

Arms: ``--arm LABEL=SRC[,VAR=VALUE...]``: SRC is a source tree (``src`` of a
checkout) put first on PYTHONPATH, VAR=VALUE extra environment. ``--base-commit C``
adds an arm ``before`` from ``git archive C src`` (the repository's own history).

    python bench/frontend_ab.py --base-commit 837b87c               # before vs now
    python bench/frontend_ab.py --arm own=src --arm aiohttp=src,KVMESH_HTTP_SERVER=aiohttp
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import (  # noqa: E402
    source_arms,
    Workload,
    free_port,
    kvmesh_command,
    launch_server,
    run_load_async,
    wait_ready_async,
)

REPO = Path(__file__).resolve().parent.parent


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/frontend_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", default=[], help="LABEL=SRC[,VAR=VALUE...] (repeatable)")
    p.add_argument("--base-commit", help="add an arm 'before' built from this commit's src/ (git archive)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests-64", type=int, default=1280, help="measured requests per round at c=64")
    p.add_argument("--requests-1", type=int, default=150, help="measured requests per round at c=1")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--router-mode", default=None, help="every arm's --router-mode (kvmesh's default: round_robin)")
    return p.parse_args()


def _arms(a: argparse.Namespace, tmp: str) -> list[tuple[str, str, dict[str, str]]]:
    return source_arms(REPO, a.base_commit, a.arm or (["now=src"] if a.base_commit else ["own=src", "aiohttp=src,KVMESH_HTTP_SERVER=aiohttp"]), tmp)


async def _main(a: argparse.Namespace) -> int:
    import os

    with tempfile.TemporaryDirectory() as tmp:
        arms = _arms(a, tmp)
        servers = []
        try:
            for label, src, extra in arms:
                port = free_port()
                env = dict(os.environ, PYTHONPATH=src, **extra)
                servers.append((label, launch_server(kvmesh_command(port, router_mode=a.router_mode, extra=["--canary-interval", "0"]),
                                                    port, env=env)))
            models = {}
            for label, server in servers:
                models[label], _ = await wait_ready_async(server.url, 180, proc=server.proc)
            results: dict[str, dict[str, list[float]]] = {label: {"rps64": [], "ttft1": [], "cpu64": [], "itl64": [], "itl1": [], "wk64": []} for label, _, _ in arms}
            for rnd in range(a.rounds):
                order = servers if rnd % 2 == 0 else servers[::-1]
                for label, server in order:
                    wl = Workload(models[label], 128, a.output_tokens, seed=rnd)
                    r64 = await run_load_async(server.url, models[label], 64, a.requests_64, 128, a.output_tokens,
                                               frontend_pid=server.pid, workload=wl)
                    r1 = await run_load_async(server.url, models[label], 1, a.requests_1, 128, a.output_tokens,
                                              frontend_pid=server.pid, workload=wl)
                    if r64.failures or r1.failures:
                        print(f"[ab] {label}: failures {r64.failures}/{r1.failures}: {r64.errors + r1.errors}", file=sys.stderr)
                    results[label]["rps64"].append(r64.req_per_s)
                    results[label]["ttft1"].append(r1.ttft_p50_ms or 0.0)
                    results[label]["cpu64"].append(r64.frontend_cpu_ms_per_req or 0.0)
                    results[label]["wk64"].append(r64.descendants_cpu_ms_per_req or 0.0)  # the worker
                    results[label]["itl64"].append(r64.itl_p50_ms or 0.0)
                    results[label]["itl1"].append(r1.itl_p50_ms or 0.0)
                    print(f"[ab] round {rnd + 1} {label:>8}: c=64 {r64.req_per_s:7.1f} req/s "
                          f"{r64.frontend_cpu_ms_per_req or 0:6.3f} fe {r64.descendants_cpu_ms_per_req or 0:6.3f} worker CPU ms/req   c=1 TTFT p50 "
                          f"{r1.ttft_p50_ms:6.2f} ms   ITL p50 c=64 {r64.itl_p50_ms or 0:6.2f} c=1 "
                          f"{r1.itl_p50_ms or 0:6.3f} ms", file=sys.stderr, flush=True)
        finally:
            for _, server in servers:
                server.stop()
    first = arms[0][0]
    base = results[first]
    print(f"\n{'arm':>10} {'req/s c=64':>11} {'ratio':>6} {'paired':>7} {'fe CPU ms/req c=64':>19} {'ratio':>6} "
          f"{'TTFT p50 c=1':>13} {'ratio':>6} {'paired':>7}")
    for label, _, _ in arms:
        r = results[label]
        rps, cpu, ttft = (statistics.median(r[k]) for k in ("rps64", "cpu64", "ttft1"))
        # per-round ratios: the two arms ran back to back, so slow drifts of the machine cancel
        prps = statistics.median(a / b for a, b in zip(r["rps64"], base["rps64"]))
        pttft = statistics.median(a / b for a, b in zip(r["ttft1"], base["ttft1"]))
        print(f"{label:>10} {rps:11.1f} {rps / statistics.median(base['rps64']):6.3f} {prps:7.3f} {cpu:19.3f} "
              f"{cpu / statistics.median(base['cpu64']):6.3f} {ttft:11.2f}ms {ttft / statistics.median(base['ttft1']):6.3f} {pttft:7.3f}")
    pcpu = {label: statistics.median(a / b for a, b in zip(results[label]["cpu64"], base["cpu64"])) for label, _, _ in arms}
    print(f"(medians of {a.rounds} rounds, router mode {a.router_mode or 'round_robin'}; 'paired': median of the per-round "
          f"ratios to {first}; fe CPU paired: " + ", ".join(f"{k} {v:.3f}" for k, v in pcpu.items()) + ")")
    pwk = {label: statistics.median(a / b for a, b in zip(results[label]["wk64"], base["wk64"])) for label, _, _ in arms}
    print("worker CPU ms/req c=64, median (paired): " + ", ".join(f"{k} {statistics.median(results[k]['wk64']):.3f} ({v:.3f})" for k, v in pwk.items()))
    for label, _, _ in arms:
        r = results[label]
        print(f"{label:>10} ITL p50 c=64 {statistics.median(r['itl64']):6.2f} ms, c=1 {statistics.median(r['itl1']):6.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(_parse())))
