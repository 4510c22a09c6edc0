"""Does ``tokenizers`` release the GIL while it encodes? (decides threads vs processes
for the frontend's preprocessing pool).

A long prompt (default ~48k tokens) is encoded in a worker thread while the main
thread counts loop iterations; the same count is taken with no encoding running.
``progress`` = iterations during the encode ÷ iterations in the same time alone: near
1 means the call ran without holding the GIL (a thread pool keeps the event loop
free); near 0 means it held it (it would need processes). Run:

    python bench/tokenize_gil.py [--tokens 48000] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import random
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48_000)
    ap.add_argument("--model-path", default=None)
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


if __name__ == "__main__":
    main()
