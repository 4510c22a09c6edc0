#!/usr/bin/env python3
"""What one ``GET /metrics`` costs now that it carries every worker's metrics: two
``kvmesh run --workers N`` servers (the base commit's ``src``, where /metrics is the
frontend's own, and this tree's), scraped in alternating rounds. Prints the median
scrape latency, the frontend's CPU ms per scrape (workers' CPU separately) and the
response size per arm, with the per-round ratio to the base.

    python bench/metrics_view.py --base-commit 23c449e --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import descendant_pids, free_port, http_get, kvmesh_command, launch_server, measure_cpu, wait_ready_async  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


async def _scrapes(port: int, pid: int, n: int) -> tuple[float, float, float, int]:
    """(median latency ms, frontend CPU ms per scrape, workers' CPU ms per scrape, bytes)."""
    workers = descendant_pids(pid)
    cpu0, wcpu0 = measure_cpu(pid), measure_cpu(workers)
    lat, size = [], 0
    for _ in range(n):
        t = time.perf_counter()
        r = await http_get("127.0.0.1", port, "/metrics")
        lat.append((time.perf_counter() - t) * 1000.0)
        size = len(r.body)
    return statistics.median(lat), (measure_cpu(pid) - cpu0) / n, (measure_cpu(workers) - wcpu0) / n, size


async def _main(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "base"
        out.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", a.base_commit, "src"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
        arms = [("base", str(out / "src")), ("now", str(REPO / "src"))]
        servers = []
        try:
            for label, src in arms:
                port = free_port()
                env = dict(os.environ, PYTHONPATH=src)
                cmd = kvmesh_command(port, workers=a.workers, extra=["--canary-interval", "0"])
                servers.append((label, port, launch_server(cmd, port, env=env)))
            for _, _, server in servers:
                await wait_ready_async(server.url, 180, proc=server.proc)
            await asyncio.sleep(2)
            res: dict[str, list[tuple[float, float, float, int]]] = {label: [] for label, _ in arms}
            for rnd in range(a.rounds):
                for label, port, server in servers if rnd % 2 == 0 else servers[::-1]:
                    res[label].append(await _scrapes(port, server.pid, a.scrapes))
        finally:
            for _, _, server in servers:
                server.stop()
    print(f"{'arm':>6} {'latency ms':>11} {'paired':>7} {'fe CPU ms/scrape':>17} {'workers CPU ms':>15} {'bytes':>8}")
    base = res["base"]
    for label, _ in arms:
        r = res[label]
        paired = statistics.median(x[0] / b[0] for x, b in zip(r, base))
        print(f"{label:>6} {statistics.median(x[0] for x in r):11.2f} {paired:7.2f} {statistics.median(x[1] for x in r):17.3f} "
              f"{statistics.median(x[2] for x in r):15.3f} {r[-1][3]:8d}")
    print(f"(medians of {a.rounds} rounds x {a.scrapes} scrapes, {a.workers} workers)")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="bench/metrics_view.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-commit", required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--scrapes", type=int, default=30)
    sys.exit(asyncio.run(_main(p.parse_args())))
