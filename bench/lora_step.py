#!/usr/bin/env python3
"""What LoRA adapters cost the hf engine's forward pass (issue 30), on the CPU.

The same batch of concurrent greedy requests on the bundled kvmesh-tiny model, three ways,
in alternating rounds on one engine (a loaded machine is noisy: read the ratios):

* ``base``: every request on the base model (no adapter work at all);
* ``one``: every request on adapter ``a``;
* ``mixed``: requests cycling base / ``a`` / ``b``: three models in every pass.

Two measures: the engine's own passes (wall time of its forward passes while serving the
requests: what a client sees, and what a loaded machine disturbs most), and the model's
forward alone on hand-made batches (``decode``: one token per sequence at position 24;
``prefill``: 24 tokens per sequence), in CPU seconds of the calling thread, the modes
alternating call by call.

Adapters are rank ``--rank`` on all seven projections of every layer (written with
:func:`kvmesh.testing.lora.write_adapter`, small non-zero values). Prints the mean forward
time per pass and per token of each mode and its ratio to ``base``.

    python bench/lora_step.py [--requests 12] [--tokens 48] [--rounds 3] [--rank 16]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
from pathlib import Path

import time

from kvmesh.engines.hf import HfEngine, HfOptions
from kvmesh.engines.hf.batch import Chunk, make_inputs
from kvmesh.preprocess.model import bundled_model_path
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.testing import mock_context
from kvmesh.testing.lora import write_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODES = {"base": (None,), "one": ("a",), "mixed": (None, "a", "b")}


def _request(i: int, adapter: str | None, tokens: int, tag: str) -> PreprocessedRequest:
    ids = [(7 * i + j) % 1900 + 20 for j in range(24)]
    return PreprocessedRequest(
        request_id=f"{tag}-{i}", model="kvmesh-tiny", token_ids=ids, adapter=adapter,
        sampling=SamplingOptions(temperature=0.0), stop=StopConditions(max_tokens=tokens, ignore_eos=True),
    )  # fmt: skip


async def _round(engine: HfEngine, mode: str, args: argparse.Namespace, tag: str) -> tuple[float, int, int]:
    cycle = MODES[mode]
    before = (engine.stats.forward_s, engine.stats.steps, engine.stats.forward_tokens)

    async def one(i: int) -> None:
        req = _request(i, cycle[i % len(cycle)], args.tokens, tag)
        async for _ in engine.generate(req, mock_context(req.request_id)):
            pass

    await asyncio.gather(*(one(i) for i in range(args.requests)))
    st = engine.stats
    return st.forward_s - before[0], st.steps - before[1], st.forward_tokens - before[2]


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvmesh-lora-bench-"))
    values = lambda i: 0.01 * math.sin(i)  # noqa: E731 - small, non-zero, deterministic
    folders = {n: write_adapter(root / n, rank=args.rank, targets=TARGETS, values=values) for n in ("a", "b")}
    opts = HfOptions(
        str(bundled_model_path()), num_blocks=512, max_num_batched_tokens=512, seed=0, threads=args.threads,
        loras=tuple(f"{n}={p}" for n, p in folders.items()), max_loras=2, max_lora_rank=args.rank,
        enable_prefix_caching=False,
    )  # fmt: skip
    engine = HfEngine(opts)
    await engine.start()
    totals = {m: [0.0, 0, 0] for m in MODES}
    try:
        for r in range(args.rounds + 1):
            for mode in MODES:
                s, steps, tokens = await _round(engine, mode, args, f"{mode}{r}")
                if r:  # round 0 warms up
                    t = totals[mode]
                    t[0], t[1], t[2] = t[0] + s, t[1] + steps, t[2] + tokens
        micro = {kind: _forward_cpu(engine, kind, args) for kind in ("decode", "prefill")}
    finally:
        await engine.cleanup()
    base = totals["base"][0] / totals["base"][1]
    print(f"hf engine, kvmesh-tiny fp32 CPU, {args.requests} requests x {args.tokens} tokens, rank {args.rank}, "
          f"{args.rounds} rounds (alternating)")  # fmt: skip
    print(f"{'mode':<6} {'passes':>7} {'ms/pass':>8} {'us/token':>9} {'vs base':>8}")
    for mode, (s, steps, tokens) in totals.items():
        per = s / steps
        print(f"{mode:<6} {steps:>7} {per * 1e3:>8.2f} {s / tokens * 1e6:>9.1f} {per / base:>8.2f}")
    print(f"\nthe model's forward alone, CPU ms per pass ({args.requests} sequences, {args.iterations} passes per mode)")
    print(f"{'batch':<8} " + " ".join(f"{m:>8}" for m in MODES) + " " + " ".join(f"{m + '/base':>11}" for m in list(MODES)[1:]))
    for kind, per_mode in micro.items():
        row = " ".join(f"{per_mode[m] * 1e3:>8.3f}" for m in MODES)
        ratios = " ".join(f"{per_mode[m] / per_mode['base']:>11.2f}" for m in list(MODES)[1:])
        print(f"{kind:<8} {row} {ratios}")


def _forward_cpu(engine: HfEngine, kind: str, args: argparse.Namespace) -> dict[str, float]:
    """CPU seconds per forward of one hand-made batch, per mode (alternating)."""
    loaded = engine._require()
    model, pool = loaded.model, loaded.pool
    slots = {None: 0, **{n: engine._lora().slot(n) for n in ("a", "b")}}
    n = 1 if kind == "decode" else 24
    start = 24 if kind == "decode" else 0

    def inputs(mode: str) -> object:
        cycle = MODES[mode]
        chunks = [
            Chunk([5 + i] * n, start, [2 * i, 2 * i + 1], True, slots[cycle[i % len(cycle)]]) for i in range(args.requests)
        ]  # fmt: skip
        return make_inputs(chunks, 16)

    prepared = {mode: inputs(mode) for mode in MODES}
    spent = {mode: 0.0 for mode in MODES}
    for _ in range(args.iterations):
        for mode in MODES:
            t0 = time.thread_time()
            model.forward(prepared[mode], pool)  # type: ignore[arg-type]
            spent[mode] += time.thread_time() - t0
    return {mode: s / args.iterations for mode, s in spent.items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iterations", type=int, default=100, help="forward passes per mode of the second measure")
    asyncio.run(main(p.parse_args()))
