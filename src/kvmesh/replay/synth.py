"""Synthetic Mooncake-format traces. The shifting one: a prefill-heavy phase (long
prompts, short answers), then a decode-heavy one (short prompts, long answers). The
day-shaped one (``--day``): one day's load curve compressed into ``--day-s`` seconds,
the rate rising from ``trough`` to ``peak`` requests/s (e.g. 10x) and back as a
cosine, trough at both ends, its mix ``--day-mix`` INPUT:OUTPUT throughout.

    python -m kvmesh.replay.synth OUT.jsonl [--phase-s 60] [--seed 0]
        [--prefill-phase 16000:40:7] [--decode-phase 1000:3000:10]   INPUT:OUTPUT[:RATE]
    python -m kvmesh.replay.synth OUT.jsonl --day [--day-s 600] [--day-rates 0.8:8] [--day-mix 4000:300]

Arrivals are Poisson, at each phase's rate (the day: a Poisson process of varying rate) (default: ``--rate`` requests/s). Lengths are drawn
uniformly within ±25 % of each phase's means. Every prompt starts with the same block
(a system prompt, hash id 0); its other blocks are its own, so the prefix cache helps
only with that block. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass

from kvmesh.replay.trace import TRACE_BLOCK_TOKENS

__all__ = ["Phase", "SHIFTING", "Day", "day_rate", "day_trace", "shifting_trace", "main"]


@dataclass(frozen=True, slots=True)
class Phase:
    seconds: float
    input_tokens: int
    output_tokens: int
    rate: float | None = None  # requests/s in this phase (None: the trace's rate)


SHIFTING = (Phase(60.0, 16_000, 40, 7.0), Phase(60.0, 1_000, 3_000, 10.0))


@dataclass(frozen=True, slots=True)
class Day:
    """One day in ``seconds``: the rate goes trough → peak (at the middle) → trough."""

    seconds: float = 600.0
    trough_rps: float = 0.8
    peak_rps: float = 8.0
    input_tokens: int = 4_000
    output_tokens: int = 300

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and 0 < self.trough_rps <= self.peak_rps):
            raise ValueError("a day needs --day-s > 0 and 0 < trough <= peak requests/s")
        if min(self.input_tokens, self.output_tokens) < 1:
            raise ValueError("a day's mix needs INPUT and OUTPUT >= 1 token")


def day_rate(day: Day, t_s: float) -> float:
    """Requests/s at ``t_s`` seconds into the day."""
    phase = (1.0 - math.cos(2.0 * math.pi * t_s / day.seconds)) / 2.0
    return day.trough_rps + (day.peak_rps - day.trough_rps) * phase


def day_trace(day: Day = Day(), seed: int = 0) -> list[dict[str, object]]:
    """The rows of a day, in arrival order: a Poisson process of rate :func:`day_rate`
    (drawn by thinning one at the peak rate)."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    t, next_id = 0.0, 1
    while True:
        t += rng.expovariate(day.peak_rps)
        if t >= day.seconds:
            return rows
        if rng.random() * day.peak_rps <= day_rate(day, t):
            next_id = _row(rows, rng, t, day.input_tokens, day.output_tokens, next_id)


def _row(rows: list[dict[str, object]], rng: random.Random, t: float, n_in_mean: int, n_out_mean: int, next_id: int) -> int:
    n_in = max(1, round(n_in_mean * rng.uniform(0.75, 1.25)))
    n_out = max(1, round(n_out_mean * rng.uniform(0.75, 1.25)))
    blocks = -(-n_in // TRACE_BLOCK_TOKENS)
    rows.append({"timestamp": round(t * 1000.0), "input_length": n_in, "output_length": n_out,
                 "hash_ids": [0, *range(next_id, next_id + blocks - 1)]})  # fmt: skip
    return next_id + blocks - 1


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
            next_id = _row(rows, rng, t, phase.input_tokens, phase.output_tokens, next_id)
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
    p.add_argument("--day", action="store_true", help="a day-shaped trace instead of the shifting one")
    p.add_argument("--day-s", type=float, default=600.0, help="seconds the day is compressed into (default 600)")
    p.add_argument("--day-rates", default="0.8:8", help="TROUGH:PEAK requests/s (default 0.8:8)")
    p.add_argument("--day-mix", default="4000:300", help="INPUT:OUTPUT mean tokens of the day (default 4000:300)")
    a = p.parse_args(argv)
    try:
        rows = _day(a) if a.day else _shifting(a)
    except ValueError as exc:
        print(f"synth: {exc}", file=sys.stderr)
        return 2
    with open(a.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} requests to {a.out}")
    return 0


def _day(a: argparse.Namespace) -> list[dict[str, object]]:
    rates = a.day_rates.split(":")
    try:
        trough, peak = (float(x) for x in rates)
    except ValueError:
        raise ValueError(f"--day-rates is TROUGH:PEAK requests/s, got {a.day_rates!r}") from None
    n_in, n_out, _ = _phase(a.day_mix)
    return day_trace(Day(a.day_s, trough, peak, n_in, n_out), a.seed)


def _shifting(a: argparse.Namespace) -> list[dict[str, object]]:
    phases = tuple(Phase(a.phase_s, *_phase(x)) for x in (a.prefill_phase, a.decode_phase))
    if a.phase_s <= 0:
        raise ValueError("--phase-s must be positive")
    return shifting_trace(phases, a.rate, a.seed)


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
