"""Capacity back after a SIGKILLed worker: a hot spare promoted by the planner against
a cold start of a replacement, measured in the same run (issue 16).

    python bench/planner_spares.py                 # 3 kills per arm, ~1 min
    python bench/planner_spares.py --kills 5 --json out.json

Arms, each one ``kvmesh run --workers 2 --admin`` (mocker workers) on this host:

* ``promote``: ``--planner --hot-spares 1``: the planner promotes the checked spare
  and starts a new spare in the background;
* ``cold``: ``--planner --hot-spares 0``: the planner starts a replacement (a fresh
  interpreter that loads the engine: a cold start);
* ``restart``: no planner: the supervisor's own restart (backoff, then a cold start).

Per kill, two figures: **external**, from the SIGKILL to ``GET /admin/workers``
listing two workers again without the victim (polled every 5 ms: an upper bound),
and, under the planner, **internal**, the planner's own log line (the loss as the
supervisor saw it, to the frontend having attached the replacement:
``kvmesh_planner_replacement_seconds``). The last line is the ratio of medians,
cold / promote. Figures taken on a shared machine are "loaded": compare arms of
the same run only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lib import free_port, kvmesh_command  # noqa: E402

ARMS = {
    "promote": ["--planner", "--hot-spares", "1", "--planner-interval", "0.5"],
    "cold": ["--planner", "--hot-spares", "0", "--planner-interval", "0.5"],
    "restart": [],
}


def _workers(url: str) -> list[dict[str, object]]:
    return list(httpx.get(url + "/admin/workers", timeout=5).json()["workers"])


def _spares_ready(url: str) -> float:
    found = re.findall(r'kvmesh_planner_workers\{role="spare"\} ([0-9.e+]+)', httpx.get(url + "/metrics").text)
    return float(found[0]) if found else 0.0


def _until(predicate, timeout_s: float, what: str, poll_s: float = 0.005) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(poll_s)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def run_arm(name: str, kills: int, log_dir: Path) -> dict[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = kvmesh_command(port, workers=2, speedup=20, extra=["--admin", "--canary-interval", "1", *ARMS[name]])
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVMESH_CLUSTER_SECRET="bench-planner-spares-" + "x" * 24)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    external: list[float] = []
    try:
        _run_kills(name, url, kills, external)
    except SystemExit:
        print(f"{name}: the run's log ends with:\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-15:]))
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    internal = [float(x) for x in re.findall(r"routable ([0-9.]+) s after the loss", log_path.read_text(errors="replace"))]
    return {"arm": name, "external_s": external, "internal_s": internal}


def _run_kills(name: str, url: str, kills: int, external: list[float]) -> None:
    """SIGKILL a routed worker ``kills`` times; the time until capacity is back, each."""
    _until(lambda: _healthy(url) and len(_workers(url)) == 2, 120, "two workers", 0.05)
    for _ in range(kills):
        if name == "promote":
            _until(lambda: _spares_ready(url) == 1, 120, "a checked spare", 0.05)
        victim = _workers(url)[0]
        t0 = time.monotonic()
        os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        _until(lambda: len(w := _workers(url)) == 2 and all(x["pid"] != victim["pid"] for x in w), 120, "capacity back")
        external.append(time.monotonic() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--arms", default="promote,cold,restart")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.arms.split(","):
            results.append(run_arm(name, args.kills, Path(tmp)))
    med: dict[str, float] = {}
    print(f"{'arm':10} {'external median s':>18} {'internal median s':>18}  external per kill")
    for r in results:
        ext, inn = r["external_s"], r["internal_s"]
        med[str(r["arm"])] = statistics.median(ext)  # type: ignore[arg-type]
        inner = f"{statistics.median(inn):.3f}" if inn else "-"  # type: ignore[arg-type]
        print(f"{r['arm']!s:10} {statistics.median(ext):18.3f} {inner:>18}  {[round(x, 3) for x in ext]}")  # type: ignore[arg-type]
    if "promote" in med:
        for other in ("cold", "restart"):
            if other in med:
                print(f"capacity back: {other} / promote = {med[other] / med['promote']:.1f}x (medians, same run)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
