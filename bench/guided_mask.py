#!/usr/bin/env python3
"""Structured outputs: what a token mask costs (issue 18).

    python bench/guided_mask.py                       # both grammar engines, bundled model (+ SmolLM2 if converted)
    python bench/guided_mask.py --rounds 5 --tokens 64

Part 1, engine choice: for each model's tokenizer and each grammar engine (llguidance,
xgrammar; both from PyPI, CPU wheels), compile one JSON schema (compile time, then a
second compile of the same schema: the cache), then walk a generation of ``--tokens``
tokens, each step computing the next-token mask and drawing a random allowed token
(an adversarial "model": every branch of the grammar gets exercised). Reported per
token: the mask's compute time, and compute + applying it to a logits row (numpy
unpack + ``masked_fill_``, the same code for both engines). Arms alternate
(A B A B ...) each round; medians over rounds.

Part 2, the budget: the hf engine at batch 8 (8 concurrent greedy requests, 48 tokens
each) with and without a JSON-schema constraint, alternating per round; prints decode
ms per token (per row) and the median of per-round ratios guided / free. Goal: the
mask adds at most 10 % (ratio ≤ 1.10). The grammar's own work inside those steps is also
timed directly (the sampler's mask function, the guide's settle and consume, wrapped), as a
share of the guided step time: the same goal, far less exposed to a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
}


def _models() -> list[tuple[str, Path, int, list[int]]]:
    from kvmesh.preprocess.catalog import cache_dir
    from kvmesh.preprocess.model import bundled_model_path, load_model_folder

    out = []
    for name, folder in (("kvmesh-tiny", bundled_model_path()), ("smollm2", cache_dir() / "models" / "smollm2")):
        if (folder / "tokenizer.json").is_file():
            info = load_model_folder(folder)
            out.append((name, folder, info.vocab_size, list(info.eos_token_ids)))
    return out


def _apply(mask_bytes: np.ndarray, vocab: int, logits: torch.Tensor) -> np.ndarray:
    allowed = np.unpackbits(mask_bytes.view(np.uint8), bitorder="little")[:vocab].astype(np.bool_)
    logits.masked_fill_(~torch.from_numpy(allowed), float("-inf"))
    return allowed


class LlgArm:
    name = "llguidance"

    def __init__(self, folder: Path, vocab: int, eos: list[int]) -> None:
        from kvmesh.preprocess.guided import GuidedTokenizer

        self.tok = GuidedTokenizer.from_folder(folder, vocab, eos)
        self.vocab = vocab

    def compile(self, schema: str) -> Any:
        from kvmesh.preprocess.guided import GuidedDecoding

        return self.tok.compile(GuidedDecoding("json_schema", schema))

    def walk(self, compiled: Any, tokens: int, rng: random.Random) -> tuple[float, float, int]:
        m = compiled.deep_copy()
        logits = torch.zeros(self.vocab)
        compute = total = 0.0
        n = 0
        for _ in range(tokens):
            t0 = time.perf_counter()
            raw = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
            t1 = time.perf_counter()
            allowed = _apply(raw, self.vocab, logits)
            t2 = time.perf_counter()
            compute, total, n = compute + t1 - t0, total + t2 - t0, n + 1
            ids = np.flatnonzero(allowed)
            tok = int(ids[rng.randrange(len(ids))])
            if m.is_stopped() or not m.consume_token(tok):
                break
        return compute, total, n


class XgrArm:
    name = "xgrammar"

    def __init__(self, folder: Path, vocab: int, eos: list[int]) -> None:
        import transformers
        import xgrammar as xgr

        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab = vocab

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def walk(self, compiled: Any, tokens: int, rng: random.Random) -> tuple[float, float, int]:
        m = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
        logits = torch.zeros(self.vocab)
        compute = total = 0.0
        n = 0
        for _ in range(tokens):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            allowed = _apply(bitmask[0].numpy(), self.vocab, logits)
            t2 = time.perf_counter()
            compute, total, n = compute + t1 - t0, total + t2 - t0, n + 1
            ids = np.flatnonzero(allowed)
            tok = int(ids[rng.randrange(len(ids))])
            if m.is_terminated() or not m.accept_token(tok):
                break
        return compute, total, n


def part1(rounds: int, tokens: int) -> list[dict[str, Any]]:
    rows = []
    schema = json.dumps(SCHEMA)
    for model, folder, vocab, eos in _models():
        arms = []
        for cls in (LlgArm, XgrArm):
            try:
                arms.append(cls(folder, vocab, eos))
            except ImportError as exc:
                print(f"{cls.name}: not importable ({exc}); skipped", file=sys.stderr)
        stats: dict[str, dict[str, list[float]]] = {a.name: {"compile": [], "cached": [], "mask": [], "applied": []} for a in arms}
        for r in range(rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for arm in order:
                unique = schema.replace('"name"', f'"name{r}"')  # a new schema each round: a real compile
                t0 = time.perf_counter()
                compiled = arm.compile(unique)
                t1 = time.perf_counter()
                arm.compile(unique)
                t2 = time.perf_counter()
                compute, total, n = arm.walk(compiled, tokens, random.Random(r))
                s = stats[arm.name]
                s["compile"].append((t1 - t0) * 1e3)
                s["cached"].append((t2 - t1) * 1e3)
                s["mask"].append(compute / n * 1e6)
                s["applied"].append(total / n * 1e6)
        for arm in arms:
            s = stats[arm.name]
            rows.append({"model": model, "vocab": vocab, "engine": arm.name, **{k: statistics.median(v) for k, v in s.items()}})
    return rows


async def _batch(engine: Any, guided: Any, tokens: int, tag: str) -> tuple[float, int]:
    from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
    from kvmesh.runtime.context import Context

    async def one(i: int) -> int:
        req = PreprocessedRequest(
            request_id=f"{tag}-{i}", model="m", token_ids=[5 + i, 17, 99, 230, 41 + i],
            sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=tokens, min_tokens=0 if guided else tokens, ignore_eos=guided is None),
            guided=guided,
        )  # fmt: skip
        n = 0
        async for c in engine.generate(req, Context(req.request_id)):
            n += len(c.token_ids)
        return n

    s0, f0 = engine.stats.steps, engine.stats.forward_s
    counts = await asyncio.gather(*(one(i) for i in range(8)))
    steps = engine.stats.steps - s0
    return (engine.stats.forward_s - f0) / max(steps, 1), sum(counts)


async def part2(rounds: int, tokens: int) -> dict[str, Any]:
    from kvmesh.engines.hf.engine import HfEngine
    from kvmesh.engines.hf.options import HfOptions
    from kvmesh.preprocess.model import bundled_model_path
    from kvmesh.protocol import GuidedDecoding

    from kvmesh.engines.hf import sampling
    from kvmesh.preprocess.guided import Guide

    spent = [0.0]  # seconds inside the grammar's work (mask + apply, consume), guided rounds
    guide_fn, consume_fn = sampling._guide, Guide.consume

    def timed_guide(*args: Any) -> None:
        t0 = time.perf_counter()
        guide_fn(*args)
        spent[0] += time.perf_counter() - t0

    def timed_consume(self: Any, token: int) -> bool:
        t0 = time.perf_counter()
        ok = consume_fn(self, token)
        spent[0] += time.perf_counter() - t0
        return ok

    settle_fn = Guide.settle

    def timed_settle(self: Any, token: int, remaining: int | None) -> int:
        t0 = time.perf_counter()
        out = settle_fn(self, token, remaining)
        spent[0] += time.perf_counter() - t0
        return out

    Guide.settle = timed_settle  # type: ignore[method-assign]
    sampling._guide = timed_guide  # type: ignore[assignment]
    Guide.consume = timed_consume  # type: ignore[method-assign]
    engine = HfEngine(HfOptions(str(bundled_model_path())))
    await engine.start()
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    await _batch(engine, guided, 8, "warm")  # compile + warm-up
    await _batch(engine, None, 8, "warm2")
    free, con, ratios, shares = [], [], [], []
    tokens_made: list[tuple[int, int]] = []
    for r in range(rounds):
        arms = [("free", None), ("guided", guided)]
        res = {}
        for name, g in arms if r % 2 == 0 else arms[::-1]:
            spent[0], s0, f0 = 0.0, engine.stats.steps, engine.stats.forward_s
            res[name] = await _batch(engine, g, tokens, f"{name}{r}")
            if g is not None:
                shares.append(spent[0] / (engine.stats.forward_s - f0))
        tokens_made.append((res["free"][1], res["guided"][1]))
        free.append(res["free"][0] * 1e3)
        con.append(res["guided"][0] * 1e3)
        ratios.append(res["guided"][0] / res["free"][0])
    await engine.cleanup()
    return {
        "step_ms_free": statistics.median(free),
        "step_ms_guided": statistics.median(con),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "mask_share_median": statistics.median(shares),
        "mask_share_max": max(shares),
        "tokens_free_guided": tokens_made,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=48, help="tokens per request in part 2")
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = part1(ns.rounds, ns.tokens)
    print("| model | vocab | engine | compile ms | cached compile ms | mask µs/token | mask + apply µs/token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['vocab']} | {r['engine']} | {r['compile']:.1f} | {r['cached']:.3f} | "
            f"{r['mask']:.1f} | {r['applied']:.1f} |"
        )
    torch.set_num_threads(threads)
    b = asyncio.run(part2(ns.rounds, ns.batch_tokens))
    print()
    print(f"hf engine, kvmesh-tiny, batch 8, greedy, {ns.batch_tokens} tokens per request (per forward step, all 8 rows):")
    print("| step ms free | step ms guided | guided/free median | min | max |")
    print("|---|---|---|---|---|")
    print(f"| {b['step_ms_free']:.2f} | {b['step_ms_guided']:.2f} | {b['ratio_median']:.3f} | {b['ratio_min']:.3f} | {b['ratio_max']:.3f} |")
    print(f"tokens made per round (free, guided): {b['tokens_free_guided']}")
    print(
        f"grammar work (masks for 8 rows, applied, settle + consume) as a share of the guided step time: median "
        f"{b['mask_share_median']:.3f}, max {b['mask_share_max']:.3f} (goal <= 0.10)"
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps({"engines": rows, "batch8": b}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
