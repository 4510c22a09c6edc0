"""Does ``tokenizers`` release the GIL while it encodes? (decides threads vs processes
for the frontend's preprocessing pool).

A long prompt (default ~48k tokens) is encoded in a worker thread while the main
thread counts loop iterations; the same count is taken with no encoding running.
``progress`` = iterations during the encode ÷ iterations in the same time alone: near
1 means the call ran without holding the GIL (a thread pool keeps the event loop
free); near 0 means it held it (it would need processes).

Then **scaling**: k threads each encode the prompt at once, against the same k encodes
one after another, alternated over ``--rounds``; speed-up = sequential ÷ threads wall
(medians). Near min(k, free cores) means threads scale (no process pool needed). Run:

    python bench/tokenize_gil.py [--tokens 48000] [--rounds 5] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

from kvmesh.preprocess.model import bundled_model_path, load_model_folder
from kvmesh.preprocess.tokenizer import Tokenizer


def _spin(seconds: float) -> int:
    """Main-thread work: iterations of a trivial Python loop in ``seconds``."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def _text(tokenizer: Tokenizer, tokens: int) -> str:
    rng = random.Random(0)
    words = [f"w{rng.randrange(5000)}" for _ in range(tokens)]
    text = " ".join(words)
    while len(tokenizer.encode(text)) > tokens:
        text = text[: int(len(text) * 0.9)]
    return text


def measure(call, seconds_alone: float) -> tuple[float, float]:
    """(wall seconds of ``call`` in a thread, main-thread progress ratio meanwhile)."""
    alone = _spin(seconds_alone)
    done = threading.Event()
    t0 = time.perf_counter()

    def run() -> None:
        call()
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    n, start = 0, time.perf_counter()
    while not done.is_set():
        n += 1
        if n % 1000 == 0 and time.perf_counter() - start > 30:
            break
    wall = time.perf_counter() - t0
    thread.join()
    rate_alone = alone / seconds_alone
    return wall, (n / wall) / rate_alone


def scaling(call, threads: int, rounds: int) -> tuple[float, float]:
    """(median wall ms of ``threads`` concurrent calls, median speed-up over sequential)."""
    walls, speedups = [], []
    for r in range(rounds):
        def concurrent() -> float:
            ts = [threading.Thread(target=call) for _ in range(threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            return time.perf_counter() - t0

        def sequential() -> float:
            t0 = time.perf_counter()
            for _ in range(threads):
                call()
            return time.perf_counter() - t0

        if r % 2:
            seq, wall = sequential(), concurrent()
        else:
            wall, seq = concurrent(), sequential()
        walls.append(wall)
        speedups.append(seq / wall)
    return statistics.median(walls) * 1000, statistics.median(speedups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48_000)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    info = load_model_folder(a.model_path or str(bundled_model_path()))
    tok = Tokenizer.from_file(info.tokenizer_path)
    text = _text(tok, a.tokens)
    n = len(tok.encode(text))
    raw = tok.raw
    t0 = time.perf_counter()
    raw.encode(text, add_special_tokens=False)
    single = time.perf_counter() - t0
    print(f"prompt: {len(text):,} characters, {n:,} tokens; Tokenizer.encode alone {single * 1000:.1f} ms")
    cases = {
        "tokenizers.Tokenizer.encode (offsets)": lambda: raw.encode(text, add_special_tokens=False),
        "encode_batch_fast([text]) (kvmesh's long path)": lambda: raw.encode_batch_fast([text], add_special_tokens=False),
        "pure-Python loop (holds the GIL: reference)": lambda: _spin(single),
    }
    print(f"{'call':<48} {'wall ms':>8} {'main-thread progress':>21}")
    for name, call in cases.items():
        wall, progress = measure(call, max(0.05, single))
        print(f"{name:<48} {wall * 1000:>8.1f} {progress:>21.2f}")
    fast = cases["encode_batch_fast([text]) (kvmesh's long path)"]
    cores = os.cpu_count() or 1
    print(f"\nscaling of encode_batch_fast, {cores} cores, load average {os.getloadavg()[0]:.1f} "
          f"(medians of {a.rounds} rounds, arms alternated)")
    print(f"{'threads':>7} {'wall ms':>8} {'speed-up vs sequential':>23}")
    for k in sorted({1, 2, cores}):
        wall, speedup = scaling(fast, k, a.rounds)
        print(f"{k:>7} {wall:>8.1f} {speedup:>23.2f}")


if __name__ == "__main__":
    main()
