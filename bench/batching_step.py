"""The batching core's CPU per request-step (issue 36: the single-threaded worker caps
req/s at c=64, and its step is most of its CPU).

Each arm is a ``src`` directory (``LABEL=SRC``; e.g. a ``git archive`` of a commit
unpacked in /tmp, and ``src`` for the tree). Every round runs each arm once, in
alternating order, in its own child process (``python -c`` with that arm's src first on
``sys.path``), so the machine's background load hits every arm alike. A child drives the
mocker's scheduler (``MockScheduler.step``: the batching core's ``schedule`` and
``complete``, the oracle's draws) with ``--concurrency`` requests kept in flight (each
ending after ``--output-tokens`` is replaced by a new one, prefix caching on, KV events
recorded), warms up, then measures the process CPU time (``time.process_time``) of
``--steps`` steps and divides it by the request-steps they carried (one decode or
prefill entry = one). Prints per arm the median µs per request-step and, per round, its
ratio to the first arm (paired), then the median ratio. Workloads: ``turnover`` (the
c=64 bench's shape: 64-token streams over ~100-token prompts sharing a 64-token prefix)
and ``decode`` (nobody ends: only decode steps).

    python bench/batching_step.py --arm base=/tmp/b36base/src --arm new=src --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.scheduler import Scheduler
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.runtime.events import RecordingPublisher

cfg = json.loads(sys.argv[1])
conc, out_tokens, steps, workload = cfg["concurrency"], cfg["output_tokens"], cfg["steps"], cfg["workload"]
opts = MockerOptions(eos_rate=0.0, num_blocks=cfg["num_blocks"], max_num_seqs=max(conc, 1))
pub = RecordingPublisher()
sched = Scheduler(opts, pub)
shared = list(range(1000, 1064))
n = 0

def submit():
    global n
    n += 1
    prompt = shared + [(n * 7919 + i) % 1500 for i in range(36)]
    max_tokens = out_tokens if workload == "turnover" else 10**6
    sched.submit(PreprocessedRequest(
        request_id=f"r{n}", model="mock", token_ids=prompt, sampling=SamplingOptions(seed=n),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True)))

for _ in range(conc):
    submit()

def run(k):
    carried = 0
    for _ in range(k):
        out = sched.step()
        carried += out.decode_seqs + (out.prefill_tokens and 1)
        for _f in out.finished:
            submit()
        if len(pub.kv_events) > 10000:
            pub.kv_events.clear()
    return carried

run(cfg["warmup"])
t0 = time.process_time()
carried = run(steps)
cpu = time.process_time() - t0
print(json.dumps({"us_per_request_step": cpu / max(carried, 1) * 1e6, "request_steps": carried, "cpu_s": cpu}))
"""


def _child(src: str, cfg: dict[str, object]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), PYTHONHASHSEED="0")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cfg)], env=env, check=True, capture_output=True, text=True
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", default=[], help="LABEL=SRC (repeatable; the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--workload", choices=("turnover", "decode"), default="turnover")
    args = ap.parse_args()
    arms = [a.split("=", 1) for a in (args.arm or ["new=src"])]
    cfg = {
        "concurrency": args.concurrency,
        "output_tokens": args.output_tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "num_blocks": args.num_blocks,
        "workload": args.workload,
    }
    per_arm: dict[str, list[float]] = {label: [] for label, _ in arms}
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else list(reversed(arms))
        for label, src in order:
            per_arm[label].append(_child(src, cfg)["us_per_request_step"])
        row = "  ".join(f"{label} {per_arm[label][-1]:.2f}" for label, _ in arms)
        print(f"round {r + 1}: µs/request-step  {row}", flush=True)
    base = arms[0][0]
    print(f"workload {args.workload}, c={args.concurrency}, {args.steps} steps, load {os.getloadavg()[0]:.1f}")
    for label, _ in arms:
        ratios = [x / b for x, b in zip(per_arm[label], per_arm[base])]
        print(
            f"{label:>8}: median {statistics.median(per_arm[label]):.2f} µs/request-step"
            f"  paired ratio to {base}: median {statistics.median(ratios):.3f}"
            f" (min {min(ratios):.3f}, max {max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
