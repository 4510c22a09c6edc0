#!/usr/bin/env python3
"""Start and idle of ``kvmesh run`` (issue 36), measured as ``bench/compare_dynamo.py``
measures them: launch (just before Popen) -> the first successful streamed completion
(``wait_ready``: polling every 50 ms), then the frontend process's VmRSS 0.5 s later
(idle RSS), the workers' RSS, and the CPU seconds the frontend process and the
workers had used by the first completion (steadier than wall time on a loaded machine).

Arms are source trees (``--arm LABEL=SRC[,VAR=VALUE...]``, ``--base-commit C`` adds
``before`` from ``git archive C src``), each byte-compiled first as pip would; rounds
alternate the arms' order so background load hits every arm alike. Prints per arm the
median (and min) of each measure and the ratio to the first arm.

    python bench/launch.py --base-commit ab2ecd9 --rounds 6
    python bench/launch.py --arm now=src --router-mode round_robin --rounds 4
    python bench/launch.py --python both --rounds 8     # this interpreter vs a venv of kvmesh's own
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import (  # noqa: E402
    descendant_pids,
    free_port,
    kvmesh_command,
    launch_server,
    measure_cpu,
    path_only_venv,
    read_mem,
    source_arms,
    wait_ready,
)

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "kvmesh-tiny"  # the bundled model, asked for by name as compare_dynamo.py does


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/launch.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", default=[], help="LABEL=SRC[,VAR=VALUE...] (repeatable)")
    p.add_argument("--base-commit", help="add an arm 'before' built from this commit's src/ (git archive)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--router-mode", default="kv")
    p.add_argument("--idle-wait", type=float, default=0.5, help="seconds after the first completion before reading RSS")
    p.add_argument("--python", choices=["system", "venv", "both"], default="system",
                   help="run kvmesh on this interpreter, from a venv of its own (compare_dynamo.py's default: "
                        "no site-packages .pth code at start), or both, each arm twice (LABEL, LABEL-venv)")
    return p.parse_args()


def one_launch(src: str, extra_env: dict[str, str], a: argparse.Namespace, python: str | None = None) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=src, **extra_env)
    cmd = kvmesh_command(port, workers=a.workers, speedup="1e9", router_mode=a.router_mode,
                         extra=["--canary-interval", "0"], python=python)
    server = launch_server(cmd, port, env=env)
    try:
        _, t_ok = wait_ready(server.url, 120, model=MODEL_NAME, proc=server.proc)
        launch = t_ok - server.t_launch
        # CPU spent to get there (less sensitive to a loaded machine than the wall time)
        cpu_fe, cpu_workers = measure_cpu(server.pid), measure_cpu(descendant_pids(server.pid))
        time.sleep(a.idle_wait)
        fe = read_mem(server.pid)
        workers = read_mem(descendant_pids(server.pid))
        return {"launch_s": launch, "rss_mib": fe["rss_kb"] / 1024, "hwm_mib": fe["hwm_kb"] / 1024,
                "worker_rss_mib": workers["rss_kb"] / 1024, "cpu_fe_s": cpu_fe / 1000, "cpu_workers_s": cpu_workers / 1000}
    finally:
        server.stop()
        server.remove_temp_log()


def main() -> int:
    a = _parse()
    with tempfile.TemporaryDirectory() as tmp:
        sources = source_arms(REPO, a.base_commit, a.arm or ["now=src"], tmp)
        for _, src, _ in sources:
            compileall.compile_dir(os.path.join(src, "kvmesh"), quiet=1, workers=1)
        venv_py = path_only_venv(os.path.join(tmp, "venv")) if a.python != "system" else None
        pythons = {"system": [("", None)], "venv": [("", venv_py)], "both": [("", None), ("-venv", venv_py)]}[a.python]
        arms = [(label + suffix, src, extra, py) for label, src, extra in sources for suffix, py in pythons]
        results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _, _ in arms}
        for rnd in range(a.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]
            for label, src, extra, py in order:
                r = one_launch(src, extra, a, py)
                results[label].append(r)
                print(f"[launch] round {rnd + 1} {label}: " + " ".join(f"{k}={v:.3f}" for k, v in r.items()),
                      file=sys.stderr, flush=True)
    keys = ("launch_s", "rss_mib", "hwm_mib", "worker_rss_mib", "cpu_fe_s", "cpu_workers_s")
    first = arms[0][0]
    med = {label: {k: statistics.median(r[k] for r in rs) for k in keys} for label, rs in results.items()}
    print(f"{'arm':<10}" + "".join(f"{k + ' med (min)':>24}" for k in keys))
    for label, rs in results.items():
        cells = "".join(f"{med[label][k]:>15.3f} ({min(r[k] for r in rs):7.3f})" for k in keys)
        print(f"{label:<10}{cells}")
    for label in results:
        if label != first:
            print(f"{label} / {first}: " + "  ".join(f"{k} {med[label][k] / med[first][k]:.3f}x" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
