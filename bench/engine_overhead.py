#!/usr/bin/env python3
"""What kvmesh costs on top of an engine: tokens/s of the engine called directly
(``Engine.generate`` in this process) vs the same engine behind kvmesh
(``kvmesh run --workers 1``: frontend + one worker process, streaming over HTTP).

    python bench/engine_overhead.py                     # hf engine, batch 1 and 8
    python bench/engine_overhead.py --engine mocker -- --speedup 200
    python bench/engine_overhead.py --batch 1,8 --max-tokens 64 --requests 16 --json out.json
    python bench/engine_overhead.py -- --model smollm2  # args after -- go to `kvmesh run`
    python bench/engine_overhead.py --vs-transformers --models tiny,smollm2 --rounds 3

``--vs-transformers`` instead compares the hf engine with transformers' own
``generate`` on the same model and prompts (batch-1 decode, batch-8 aggregate, first
token on a 512-token prompt; alternating arms, medians): see ``bench/_reference.py``.

Both sides get the same prompts (token ids from ``_lib.Workload``, seeded), greedy
(temperature 0), ``ignore_eos`` with ``min_tokens = max_tokens``, so every request
makes exactly ``--max-tokens`` tokens. Each batch size B is a closed loop of B
clients, each sending its next request when the previous one ended; tokens/s is the
measured requests' output tokens over the time from the first measured send to the
last measured end (warm-up requests first, not measured), the same definition on both
sides. The direct engine is built from the same ``kvmesh run`` arguments as the
worker (kvmesh's own parser and ``build_engine``), and stays idle while kvmesh is
measured; the sides alternate per batch size (``--repeat`` rounds, best of each).

Prints one table: tokens/s direct, tokens/s through kvmesh, and their ratio (goal:
kvmesh ≥ 0.95 × direct). Exit status 1 when a request failed or made another number
of tokens than asked. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _reference  # noqa: E402
from _lib import (  # noqa: E402
    HttpConnection,
    Workload,
    build_request,
    descendant_pids,
    free_port,
    launch_server,
    measure_cpu,
    run_async,
    wait_ready_async,
)

_perf = time.perf_counter
GOAL = 0.95


@dataclass
class Side:
    batch: int
    requests: int
    tokens: int
    seconds: float
    failures: int
    wrong_length: int
    frontend_cpu_s: float = 0.0  # kvmesh side only: CPU time of the frontend process
    worker_cpu_s: float = 0.0  # ... and of its worker process(es)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _parse(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="bench/engine_overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="hf", help="kvmesh engine (default hf; mocker works too)")
    p.add_argument("--batch", default="1,8", help="comma-separated concurrency levels (default 1,8)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in token ids (64)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (64)")
    p.add_argument("--requests", type=int, default=None, help="measured requests per level (default max(16, 4 x batch))")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests per level (default batch)")
    p.add_argument("--repeat", type=int, default=1, help="alternating rounds per level; best of each side (1)")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds for kvmesh to answer (600)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    _reference.add_arguments(p)
    a = p.parse_args(argv)
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    a.extra = extra
    a.levels = [int(x) for x in a.batch.split(",") if x.strip()]
    if not a.levels or min(a.levels) < 1:
        p.error("--batch takes positive integers")
    return a


def _log(*parts: object) -> None:
    print("[engine_overhead]", *parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- prompts


class Prompts:
    """The same seeded prompts for both sides: level L, round r, request i."""

    def __init__(self, a: argparse.Namespace, vocab_hi: int) -> None:
        self.a = a
        self.vocab_hi = vocab_hi

    def for_level(self, batch: int, round_: int) -> list[list[int]]:
        a = self.a
        n = self.warmup(batch) + self.measured(batch)
        wl = Workload("m", a.prompt_tokens, a.max_tokens, seed=1000 * batch + round_)
        # NOTE: Workload draws ids in 100..1999; fold them into small vocabularies.
        return [[t % self.vocab_hi for t in wl.next_prompt()] for _ in range(n)]

    def warmup(self, batch: int) -> int:
        return self.a.warmup if self.a.warmup is not None else batch

    def measured(self, batch: int) -> int:
        return self.a.requests if self.a.requests is not None else max(16, 4 * batch)


async def _closed_loop(batch: int, prompts: list[list[int]], warmup: int, one) -> Side:
    """``batch`` clients over ``prompts``; ``one(slot, i, prompt)`` returns the output tokens
    of request i (or raises). Measured: requests ``warmup`` onwards."""
    next_i = 0
    stamps: list[tuple[float, float, int]] = []
    failures = 0

    async def client(slot: int) -> None:
        nonlocal next_i, failures
        while next_i < len(prompts):
            i = next_i
            next_i += 1
            t0 = _perf()
            try:
                n = await one(slot, i, prompts[i])
            except Exception as exc:  # noqa: BLE001 - counted and reported
                failures += 1
                _log(f"request {i} failed: {exc!r}")
                continue
            if i >= warmup:
                stamps.append((t0, _perf(), n))

    await asyncio.gather(*(client(s) for s in range(batch)))
    if not stamps:
        return Side(batch, 0, 0, 0.0, failures, 0)
    seconds = max(e for _, e, _ in stamps) - min(s for s, _, _ in stamps)
    tokens = sum(n for _, _, n in stamps)
    return Side(batch, len(stamps), tokens, seconds, failures, 0)


# ---------------------------------------------------------------------------- direct


async def _direct(engine, batch: int, prompts: list[list[int]], a: argparse.Namespace, eos: list[int]) -> Side:
    from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions
    from kvmesh.runtime.context import Context

    wrong = 0

    async def one(slot: int, i: int, prompt: list[int]) -> int:
        nonlocal wrong
        rid = f"direct-{batch}-{i}-{time.monotonic_ns()}"
        req = PreprocessedRequest(
            request_id=rid, model="m", token_ids=prompt, sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=a.max_tokens, min_tokens=a.max_tokens, ignore_eos=True),
            eos_token_ids=eos,
        )  # fmt: skip
        n = 0
        async for chunk in engine.generate(req, Context(rid)):
            n += len(chunk.token_ids)
            if chunk.finish_reason not in (None, "length", "stop"):
                raise RuntimeError(f"finish_reason={chunk.finish_reason} {chunk.error or ''}")
        wrong += n != a.max_tokens
        return n

    side = await _closed_loop(batch, prompts, _warm(a, batch), one)
    side.wrong_length = wrong
    return side


def _warm(a: argparse.Namespace, batch: int) -> int:
    return a.warmup if a.warmup is not None else batch


# ---------------------------------------------------------------------------- through kvmesh


async def _through_kvmesh(port: int, model: str, batch: int, prompts: list[list[int]], a: argparse.Namespace) -> Side:
    host = "127.0.0.1"
    conns = [await HttpConnection.connect(host, port) for _ in range(batch)]
    wrong = 0

    async def one(slot: int, i: int, prompt: list[int]) -> int:
        nonlocal wrong
        body = {
            "model": model, "prompt": prompt, "max_tokens": a.max_tokens, "min_tokens": a.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        if conns[slot].closed:
            conns[slot] = await HttpConnection.connect(host, port)
        raw = build_request("POST", "/v1/completions", host, port, json.dumps(body).encode())
        r = await conns[slot].request(raw, timeout=600.0)
        if not r.ok:
            raise RuntimeError(r.error)
        wrong += r.n_tokens != a.max_tokens
        return r.n_tokens

    try:
        side = await _closed_loop(batch, prompts, _warm(a, batch), one)
    finally:
        for c in conns:
            c.close()
    side.wrong_length = wrong
    return side


# ---------------------------------------------------------------------------- main


def _kvmesh_args(a: argparse.Namespace) -> list[str]:
    return ["--engine", a.engine, *a.extra]


async def _build_direct(a: argparse.Namespace):
    from kvmesh.cli.main import _worker_config, build_parser
    from kvmesh.preprocess.model import bundled_model_path, load_model_folder
    from kvmesh.worker.main import build_engine

    ns = build_parser().parse_args(["run", *_kvmesh_args(a)])
    cfg = _worker_config(ns)
    engine, model_path = build_engine(cfg)
    info = load_model_folder(model_path or bundled_model_path())
    config = await engine.start()
    return engine, config, info


async def _main(a: argparse.Namespace) -> int:
    _log("starting the direct engine:", " ".join(_kvmesh_args(a)))
    engine, config, info = await _build_direct(a)
    port = free_port()
    cmd = [sys.executable, "-m", "kvmesh.cli.main", "run", "--workers", "1", "--http-host", "127.0.0.1",
           "--http-port", str(port), "--canary-interval", "0", *_kvmesh_args(a)]  # fmt: skip
    server = launch_server(cmd, port)
    results: list[dict] = []
    ok = True
    try:
        _log(f"launched kvmesh (pid {server.pid}, log {server.log_path}); waiting for it to answer")
        model, _ = await wait_ready_async(server.url, a.launch_timeout, proc=server.proc)
        prompts = Prompts(a, min(info.vocab_size, 2000))
        eos = list(info.eos_token_ids)
        for batch in a.levels:
            best_d: Side | None = None
            best_k: Side | None = None
            for r in range(a.repeat):
                ps = prompts.for_level(batch, r)
                pcpu0 = time.process_time()
                d = await _direct(engine, batch, ps, a, eos)
                d.worker_cpu_s = time.process_time() - pcpu0  # the engine runs in this process
                workers = descendant_pids(server.pid)
                cpu0 = measure_cpu(server.pid), measure_cpu(workers)
                k = await _through_kvmesh(port, model, batch, ps, a)
                k.frontend_cpu_s = (measure_cpu(server.pid) - cpu0[0]) / 1000.0
                k.worker_cpu_s = (measure_cpu(workers) - cpu0[1]) / 1000.0
                _log(f"batch {batch} round {r}: direct {d.tok_per_s:.1f} tok/s, kvmesh {k.tok_per_s:.1f} tok/s")
                best_d = d if best_d is None or d.tok_per_s > best_d.tok_per_s else best_d
                best_k = k if best_k is None or k.tok_per_s > best_k.tok_per_s else best_k
            ok &= not (best_d.failures or best_k.failures or best_d.wrong_length or best_k.wrong_length)
            results.append({"batch": batch, "direct": asdict(best_d), "kvmesh": asdict(best_k),
                            "direct_tok_per_s": best_d.tok_per_s, "kvmesh_tok_per_s": best_k.tok_per_s,
                            "ratio": best_k.tok_per_s / best_d.tok_per_s if best_d.tok_per_s else None})  # fmt: skip
    finally:
        server.stop()
        await engine.cleanup()
    if ok:
        server.remove_temp_log()
    _print(a, config, results)
    if a.json:
        Path(a.json).write_text(json.dumps({"engine": a.engine, "args": a.extra, "results": results}, indent=2))
    return 0 if ok else 1


def _print(a: argparse.Namespace, config, results: list[dict]) -> None:
    print(f"engine {a.engine}, model {config.served_model_name}, prompt {a.prompt_tokens} tokens, "
          f"{a.max_tokens} output tokens, greedy, ignore_eos")  # fmt: skip
    head = (f"{'batch':>5} {'reqs':>5} {'direct tok/s':>13} {'CPU %':>6} {'kvmesh tok/s':>13} {'fe CPU %':>9} {'wk CPU %':>9}"
            f" {'ratio':>7}  goal >= {GOAL}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in results:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        mark = "" if r["ratio"] is None else ("  ok" if r["ratio"] >= GOAL else "  below goal")
        k = r["kvmesh"]
        fe, wk = (100.0 * k[f"{n}_cpu_s"] / k["seconds"] if k["seconds"] else 0.0 for n in ("frontend", "worker"))
        d = r["direct"]
        dc = 100.0 * d["worker_cpu_s"] / d["seconds"] if d["seconds"] else 0.0
        print(f"{r['batch']:>5} {k['requests']:>5} {r['direct_tok_per_s']:>13.1f} {dc:>6.0f} "
              f"{r['kvmesh_tok_per_s']:>13.1f} {fe:>9.0f} {wk:>9.0f} {ratio:>7}{mark}")  # fmt: skip
    print("(CPU %: the direct engine's process; fe/wk CPU %: the kvmesh frontend's and worker's, "
          "over the measured window; 100 = one core; this machine has", os.cpu_count(), "cores)")


def main(argv: list[str] | None = None) -> int:
    a = _parse(sys.argv[1:] if argv is None else argv)
    if a.vs_transformers:
        return run_async(_reference.run(a))
    return run_async(_main(a))


if __name__ == "__main__":
    sys.exit(main())
