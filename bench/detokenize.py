"""What detokenization costs per generated token on the frontend.

The frontend turns each stream's ids into text with
:class:`kvmesh.preprocess.tokenizer.IncrementalDetokenizer` (``tokenizers``'
``DecodeStream``, Rust), inline on its event loop, once per chunk the worker sends.
This measures the cost per token of that step, for chunks of 1 id (a stream's first
token, and every token of a slow stream) and of 4 ids (what the worker's coalescing
sends under load), over a stream of random drawable ids (the mocker's) and over a
stream that re-encodes real text; then compares it with the cost of handing one chunk
to a thread (``loop.run_in_executor``), which is what moving it off the loop would
cost. Arms alternate in every round (the machine is shared); medians of the rounds,
with the spread, are printed.

    python bench/detokenize.py [--tokens 20000] [--rounds 5] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence

from kvmesh.preprocess.model import bundled_model_path, load_model_folder
from kvmesh.preprocess.tokenizer import Tokenizer


def _random_ids(tok: Tokenizer, n: int) -> list[int]:
    vocab = tok.raw.get_vocab_size()
    special = {i for i in range(vocab) if (t := tok.id_to_token(i)) is not None and t.startswith("<")}
    ids = [i for i in range(vocab) if i not in special]
    rng = random.Random(0)
    return [rng.choice(ids) for _ in range(n)]


def _text_ids(tok: Tokenizer, n: int) -> list[int]:
    rng = random.Random(1)
    words = ["the", "model", "streams", "tokens", "über", "naïve", "日本語", "emoji", "🙂", "data", "and", "of"]
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" ".join(rng.choice(words) for _ in range(200)))
    return ids[:n]


def _per_token_us(tok: Tokenizer, ids: Sequence[int], chunk: int) -> float:
    detok = tok.detokenizer()
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    t0 = time.perf_counter()
    for c in chunks:
        detok.step(c)
    detok.flush()
    return (time.perf_counter() - t0) * 1e6 / len(ids)


def _executor_hop_us(n: int) -> float:
    async def go() -> float:
        loop = asyncio.get_running_loop()
        noop: Callable[[], None] = lambda: None  # noqa: E731
        await loop.run_in_executor(None, noop)
        t0 = time.perf_counter()
        for _ in range(n):
            await loop.run_in_executor(None, noop)
        return (time.perf_counter() - t0) * 1e6 / n

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model-path", default=None, help="model folder (default: the bundled kvmesh-tiny)")
    a = ap.parse_args()
    folder = load_model_folder(a.model_path or bundled_model_path())
    tok = Tokenizer.from_file(folder.tokenizer_path)
    streams = {"random ids": _random_ids(tok, a.tokens), "real text": _text_ids(tok, a.tokens)}
    arms: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for name, ids in streams.items():
            for chunk in (1, 4):
                arms.setdefault(f"{name}, chunks of {chunk}", []).append(_per_token_us(tok, ids, chunk))
        arms.setdefault("executor hop (one chunk to a thread and back)", []).append(_executor_hop_us(2000))
    print(f"detokenization per token, {a.tokens} tokens, {a.rounds} rounds alternated (median, min-max), "
          f"tokenizer of {folder.path.name}; the machine is shared and loaded")  # fmt: skip
    for name, vals in arms.items():
        unit = "µs per chunk" if name.startswith("executor") else "µs per token"
        print(f"  {name:48s} {statistics.median(vals):7.2f} {unit}  ({min(vals):.2f}-{max(vals):.2f})")


if __name__ == "__main__":
    main()
