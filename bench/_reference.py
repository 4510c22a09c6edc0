"""The hf engine against transformers' own ``generate`` (``engine_overhead.py --vs-transformers``).

For each model, in one process and on the same torch threads, the two arms take turns
on the same prompts, ``--rounds`` times: each figure's two runs back to back (A B, the
next round B A). The table shows each arm's median and the median of the rounds'
paired ratios (a shared machine's load drifts less within a pair than across a run):

* **batch-1 decode tokens/s**: one greedy request, ``--prompt-tokens`` prompt,
  ``--max-tokens`` output (EOS ignored); (tokens - 1) over the time from the first
  token to the last (kvmesh: its stream; transformers: a streamer's ``put`` calls).
* **batch-8 aggregate tokens/s**: ``--batch8`` concurrent requests of the same shape
  through kvmesh's continuous batching, all output tokens over the wall time (prefill
  included); transformers' row is one padded-free batched ``generate`` of the same
  prompts (all equally long). Goal: kvmesh ≥ 3 × transformers' batch-1 decode.
* **first-token latency, 512-token prompt**: kvmesh ``max_tokens=1`` until the first
  token arrives; transformers ``generate(max_new_tokens=1)``. Goal: ≤ 1.0 × transformers'.

Every prompt is fresh (seeded random ids; kvmesh's prefix cache never hits). The
kvmesh arm is ``HfEngine.generate`` in this process (the engine ``kvmesh run --engine
hf`` builds, no HTTP: ``engine_overhead.py`` without ``--vs-transformers`` measures
that part). The machine's load average is printed before and after: on a shared
machine the figures are loaded ones; compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_perf = time.perf_counter
BUNDLED = ("tiny", "kvmesh-tiny", "bundled")


def _log(*parts: object) -> None:
    print("[vs-transformers]", *parts, file=sys.stderr, flush=True)


@dataclass
class Samples:
    """Per-round figures of one model, by (arm, metric)."""

    values: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, arm: str, metric: str, value: float) -> None:
        self.values.setdefault((arm, metric), []).append(value)

    def median(self, arm: str, metric: str) -> float:
        v = self.values.get((arm, metric))
        return statistics.median(v) if v else float("nan")

    def ratio(self, a: tuple[str, str], b: tuple[str, str]) -> float:
        """Median over rounds of a/b, each round's pair measured back to back (load
        drifts less within a pair than across the run)."""
        pairs = zip(self.values.get(a, []), self.values.get(b, []), strict=False)
        return statistics.median(x / y for x, y in pairs) if a in self.values else float("nan")


# ---------------------------------------------------------------------------- prompts


class Prompts:
    """Fresh seeded prompts: ids in [100, hi) (skips the small ids special tokens use)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.hi = min(vocab, 30000)
        self.rng = random.Random(seed)

    def one(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.hi) for _ in range(n)]


# ---------------------------------------------------------------------------- kvmesh arm


class KvmeshArm:
    """``HfEngine.generate`` in this process."""

    name = "kvmesh"

    def __init__(self, engine: Any, eos: list[int]) -> None:
        self.engine = engine
        self.eos = eos
        self._n = 0

    async def one(self, prompt: list[int], max_tokens: int) -> tuple[float, float, float, int]:
        """(start, first token, last token, tokens) of one greedy request."""
        from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
        from kvmesh.runtime.context import Context

        self._n += 1
        rid = f"ref-{self._n}-{time.monotonic_ns()}"
        req = PreprocessedRequest(
            request_id=rid, model="m", token_ids=prompt, sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True), eos_token_ids=self.eos,
        )  # fmt: skip
        t0, first, n = _perf(), 0.0, 0
        async for chunk in self.engine.generate(req, Context(rid)):
            if chunk.token_ids and not n:
                first = _perf()
            n += len(chunk.token_ids)
            if chunk.finish_reason not in (None, "length", "stop"):
                raise RuntimeError(f"finish_reason={chunk.finish_reason} {chunk.error or ''}")
        return t0, first, _perf(), n

    async def decode(self, prompt: list[int], max_tokens: int) -> float:
        _, first, last, n = await self.one(prompt, max_tokens)
        return (n - 1) / (last - first)

    async def batch(self, prompts: list[list[int]], max_tokens: int) -> float:
        t0 = _perf()
        res = await asyncio.gather(*(self.one(p, max_tokens) for p in prompts))
        return sum(r[3] for r in res) / (_perf() - t0)

    async def ttft(self, prompt: list[int]) -> float:
        t0, first, _, _ = await self.one(prompt, 1)
        return first - t0


# ---------------------------------------------------------------------------- transformers arm


class TransformersArm:
    """transformers' ``AutoModelForCausalLM.generate`` on the same folder, fp32."""

    name = "transformers"

    def __init__(self, path: str, pad: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.pad = pad

    def _generate(self, prompts: list[list[int]], max_tokens: int, streamer: Any = None) -> int:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=self.pad, streamer=streamer,
            )  # fmt: skip
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))

    async def decode(self, prompt: list[int], max_tokens: int) -> float:
        stamps = _Stamps()
        n = self._generate([prompt], max_tokens, stamps)
        return (n - 1) / (stamps.times[-1] - stamps.times[0])

    async def batch(self, prompts: list[list[int]], max_tokens: int) -> float:
        t0 = _perf()
        n = self._generate(prompts, max_tokens)
        return n / (_perf() - t0)

    async def ttft(self, prompt: list[int]) -> float:
        t0 = _perf()
        self._generate([prompt], 1)
        return _perf() - t0


class _Stamps:
    """A transformers streamer that only notes when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() puts the prompt first
            self._prompt_seen = True
            return
        self.times.append(_perf())

    def end(self) -> None:
        pass


# ---------------------------------------------------------------------------- driver


async def _build_kvmesh(model: str) -> tuple[Any, str, Any]:
    from kvmesh.cli.main import _worker_config, build_parser
    from kvmesh.preprocess.model import load_model_folder
    from kvmesh.worker.main import build_engine

    args = ["run", "--engine", "hf"] + ([] if model in BUNDLED else ["--model", model])
    engine, path = build_engine(_worker_config(build_parser().parse_args(args)))
    await engine.start()
    return engine, path, load_model_folder(path)


async def measure_model(model: str, a: argparse.Namespace) -> tuple[str, Samples]:
    import torch

    engine, path, info = await _build_kvmesh(model)
    threads = torch.get_num_threads()
    _log(f"{info.name}: {path}; torch threads {threads} (the engine's choice, both arms)")
    try:
        arms: list[Any] = [KvmeshArm(engine, list(info.eos_token_ids)), TransformersArm(path, info.eos_token_ids[0])]
        prompts = Prompts(info.vocab_size, seed=a.seed)
        samples = Samples()
        for arm in arms:  # warm-up: first calls allocate and pick kernels
            await arm.decode(prompts.one(a.prompt_tokens), 4)
            await arm.ttft(prompts.one(a.ttft_prompt))
        for r in range(a.rounds):
            p1 = prompts.one(a.prompt_tokens)
            p8 = [prompts.one(a.prompt_tokens) for _ in range(a.batch8)]
            pt = prompts.one(a.ttft_prompt)
            order = arms if r % 2 == 0 else arms[::-1]  # A B, then B A: neither always goes first
            for metric, call in (("decode", lambda arm: arm.decode(p1, a.max_tokens)),
                                 ("batch", lambda arm: arm.batch(p8, a.max_tokens)),
                                 ("ttft", lambda arm: arm.ttft(pt))):  # fmt: skip
                for arm in order:  # the two arms of one figure back to back: the same load
                    samples.add(arm.name, metric, await call(arm))
            _log(f"{info.name} round {r} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{arm}/{m} {v[-1]:.4g}" for (arm, m), v in samples.values.items()))  # fmt: skip
        return info.name, samples
    finally:
        await engine.cleanup()


def _row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True)))


def table(results: list[tuple[str, Samples]], a: argparse.Namespace) -> list[str]:
    head = ["model", "metric", "kvmesh", "transformers", "ratio", "goal"]
    widths = [14, 38, 9, 12, 7, 12]
    lines = [_row(head, widths), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    for name, s in results:
        kd, td = s.median("kvmesh", "decode"), s.median("transformers", "decode")
        kb, tb = s.median("kvmesh", "batch"), s.median("transformers", "batch")
        kt, tt = s.median("kvmesh", "ttft") * 1e3, s.median("transformers", "ttft") * 1e3
        k, t = "kvmesh", "transformers"
        rows: list[tuple[str, float, float, float, str, Callable[[float], bool]]] = [
            ("batch-1 decode tok/s", kd, td, s.ratio((k, "decode"), (t, "decode")), ">= 1.0x", lambda x: x >= 1.0),
            (f"batch-{a.batch8} aggregate tok/s (vs tf b1)", kb, td, s.ratio((k, "batch"), (t, "decode")), ">= 3.0x",
             lambda x: x >= 3.0),
            (f"batch-{a.batch8} aggregate tok/s (vs tf b{a.batch8})", kb, tb, s.ratio((k, "batch"), (t, "batch")), "(info)",
             lambda x: True),
            (f"first token, {a.ttft_prompt}-token prompt, ms", kt, tt, s.ratio((k, "ttft"), (t, "ttft")), "<= 1.0x",
             lambda x: x <= 1.0),
        ]  # fmt: skip
        for metric, k, t, ratio, goal, ok in rows:
            mark = goal if goal == "(info)" else goal + (" ok" if ok(ratio) else " MISS")
            lines.append(_row([name, metric, f"{k:.1f}", f"{t:.1f}", f"{ratio:.2f}x", mark], widths))
    return lines


async def run(a: argparse.Namespace) -> int:
    import torch

    load0 = os.getloadavg()
    results = []
    for model in a.models:
        results.append(await measure_model(model, a))
    load1 = os.getloadavg()
    print(f"hf engine (kvmesh, in-process HfEngine.generate) vs transformers generate; fp32, greedy, EOS ignored; "
          f"prompt {a.prompt_tokens} tokens, {a.max_tokens} output tokens; {a.rounds} rounds, arms back to back (A B, B A); "
          f"kvmesh/transformers columns: medians; ratio: median of the rounds' paired ratios; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")  # fmt: skip
    for line in table(results, a):
        print(line)
    print(f"load average (1/5/15 min): before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")  # fmt: skip
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--vs-transformers (the hf engine against transformers' generate)")
    g.add_argument("--vs-transformers", action="store_true", help="run this comparison instead of the HTTP one")
    g.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny (bundled) and/or catalog names")
    g.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians reported (5)")
    g.add_argument("--batch8", type=int, default=8, help="concurrency of the aggregate row (8)")
    g.add_argument("--ttft-prompt", type=int, default=512, help="prompt tokens of the first-token row (512)")
    g.add_argument("--seed", type=int, default=1, help="prompt seed (1)")
