"""A synthetic Mooncake-format trace whose load shifts: a prefill-heavy phase (long
prompts, short answers), then a decode-heavy one (short prompts, long answers).

    python -m kvmesh.replay.synth OUT.jsonl [--phase-s 60] [--seed 0]
        [--prefill-phase 16000:40:7] [--decode-phase 1000:3000:10]   INPUT:OUTPUT[:RATE]

Arrivals are Poisson, at each phase's rate (default: ``--rate`` requests/s). Lengths are drawn
uniformly within ±25 % of each phase's means. Every prompt starts with the same block
(a system prompt, hash id 0); its other blocks are its own, so the prefix cache helps
only with that block. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

from kvmesh.replay.trace import TRACE_BLOCK_TOKENS

__all__ = ["Phase", "SHIFTING", "shifting_trace", "main"]


@dataclass(frozen=True, slots=True)
class Phase:
    seconds: float
    input_tokens: int
    output_tokens: int
    rate: float | None = None  # requests/s in this phase (None: the trace's rate)


SHIFTING = (Phase(60.0, 16_000, 40, 7.0), Phase(60.0, 1_000, 3_000, 10.0))


def shifting_trace(phases: tuple[Phase, ...] = SHIFTING, rate: float = 4.0, seed: int = 0) -> list[dict[str, object]]:
    """The rows, in arrival order (timestamps in ms)."""
    if rate <= 0 or not phases:
        raise ValueError("--rate must be positive and there must be a phase")
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    start, next_id = 0.0, 1
    for phase in phases:
        r = phase.rate if phase.rate is not None else rate
        if r <= 0:
            raise ValueError("a phase's rate must be positive")
        t = start + rng.expovariate(r)
        while t < start + phase.seconds:
            n_in = max(1, round(phase.input_tokens * rng.uniform(0.75, 1.25)))
            n_out = max(1, round(phase.output_tokens * rng.uniform(0.75, 1.25)))
            blocks = -(-n_in // TRACE_BLOCK_TOKENS)
            ids = [0, *range(next_id, next_id + blocks - 1)]
            next_id += blocks - 1
            rows.append({"timestamp": round(t * 1000.0), "input_length": n_in, "output_length": n_out, "hash_ids": ids})
            t += rng.expovariate(r)
        start += phase.seconds
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.replay.synth", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds of each phase (default 60)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-phase", default="16000:40:7",
                   help="INPUT:OUTPUT mean tokens of phase 1 [:RATE requests/s] (default 16000:40:7)")  # fmt: skip
    p.add_argument("--decode-phase", default="1000:3000:10",
                   help="INPUT:OUTPUT mean tokens of phase 2 [:RATE requests/s] (default 1000:3000:10)")  # fmt: skip
    a = p.parse_args(argv)
    try:
        phases = tuple(Phase(a.phase_s, *_phase(x)) for x in (a.prefill_phase, a.decode_phase))
        if a.phase_s <= 0:
            raise ValueError("--phase-s must be positive")
        rows = shifting_trace(phases, a.rate, a.seed)
    except ValueError as exc:
        print(f"synth: {exc}", file=sys.stderr)
        return 2
    with open(a.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} requests to {a.out}")
    return 0


def _phase(text: str) -> tuple[int, int, float | None]:
    parts = text.split(":")
    bad = ValueError(f"a phase is INPUT:OUTPUT tokens (both >= 1) with an optional :RATE > 0, got {text!r}")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) >= 1 for p in parts[:2]):
        raise bad
    try:
        rate = float(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise bad from None
    if rate is not None and not rate > 0:
        raise bad
    return int(parts[0]), int(parts[1]), rate


if __name__ == "__main__":
    sys.exit(main())
