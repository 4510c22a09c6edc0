"""The GPU check (issue 28): kvmesh's hf engine on a CUDA card against transformers (the
anchor) and the memory-bandwidth limit, all measured in this one run, then ``kvmesh run``
on the card under HTTP load, aggregated and disaggregated. Prints one table.

On the GPU machine (no package index there: carry the wheels ``scripts/gpu_wheels.sh``
downloads into ``.whl/``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:src python3 bench/gpu.py --out $OUT/gpu.md          # ~7 minutes
    PYTHONPATH=/tmp/site:src python3 bench/gpu.py --quick                      # ~2 minutes

Sections (each skipped, and said so, when ``--budget-s`` would be overrun):

* ``checks``: the Triton paged decode kernel against its plain-torch reference; the
  bundled model in float32 gives the same greedy tokens on cuda as on the CPU; decode
  through CUDA graphs gives the same tokens as eager passes.
* ``bandwidth``: a device-to-device copy (bytes read + written per second); the
  batch-1 decode limit of a shape is that ÷ its weight bytes.
* ``llama-1b`` / ``llama-8b`` (synthetic bf16 weights, seed 0, the same tensors for
  both engines): transformers ``generate`` (batch 1, 128-token prompt, 256 new) and
  ``generate_batch`` (256 × 512 → 128); kvmesh's engine in-process on the same
  workloads, the TTFT of a 4k-token prompt, and (1B) the first 32 greedy tokens of 10
  prompts against transformers'.
* ``serve``: ``kvmesh run --engine hf --device cuda --workers 2 --router-mode kv`` with
  the bundled model, then with ``--random-weights llama-1b``, under a closed-loop
  streaming load (bench/_lib.py): errors and output tokens/s.
* ``disagg``: 1 prefill + 1 decode worker on the card: greedy text identical to the
  aggregated run's, and the KV bytes / transfer seconds the workers report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import random
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402

from kvmesh.engines.hf import HfEngine, HfOptions  # noqa: E402
from kvmesh.preprocess.model import bundled_model_path  # noqa: E402
from kvmesh.protocol import PreprocessedRequest, SamplingOptions, StopConditions  # noqa: E402
from kvmesh.testing import mock_context  # noqa: E402

T0 = time.perf_counter()
ROWS: list[tuple[str, str, str]] = []  # (what, figure, note)
NOTES: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


OUT_PATH: Path | None = None  # --out: rewritten after every row, so a run cut short keeps what it measured


def row(what: str, figure: str, note: str = "") -> None:
    ROWS.append((what, figure, note))
    log(f"{what}: {figure} {note}")
    if OUT_PATH is not None:
        OUT_PATH.write_text(table())


DEVICE = "cuda"  # --device cpu: a dry run of the serve and disagg sections on a machine without a GPU


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- in-process engine


def _request(ids: list[int], rid: str, max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model="m", token_ids=list(ids), sampling=SamplingOptions(temperature=0.0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )  # fmt: skip


async def _generate(eng: HfEngine, ids: list[int], rid: str, max_tokens: int) -> tuple[list[int], float, float]:
    """Tokens, seconds to the first, seconds to the last."""
    t0 = time.perf_counter()
    first, tokens = 0.0, []
    async for chunk in eng.generate(_request(ids, rid, max_tokens), mock_context(rid)):
        if not first and chunk.token_ids:
            first = time.perf_counter() - t0
        tokens.extend(chunk.token_ids)
    return tokens, first, time.perf_counter() - t0


def _prompts(n: int, length: int, seed: int, vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def hf_options(**kw: Any) -> HfOptions:
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    base: dict[str, Any] = dict(device=DEVICE, dtype=dtype, seed=0, max_num_seqs=256,
                                max_num_batched_tokens=8192, gpu_memory_fraction=0.85)  # fmt: skip
    return HfOptions(str(bundled_model_path()), **(base | kw))


async def engine_figures(shape: str, quick: bool, greedy_prompts: list[list[int]] | None) -> dict[str, Any]:
    eng = HfEngine(hf_options(random_weights=shape))
    t0 = time.perf_counter()
    await eng.start()
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0, "capture_s": eng.graph_capture_s}
    try:
        loaded = eng._require()  # the bench compares with transformers over the shape's whole vocabulary
        eng._loaded = dataclasses.replace(loaded, sample_vocab=0)
        out["kv_blocks"] = loaded.pool.num_blocks
        await _generate(eng, _prompts(1, 128, 99)[0], "warm", 16)
        toks, first, total = await _generate(eng, _prompts(1, 128, 1)[0], "b1", 256)
        out["b1_tok_s"] = len(toks) / total
        out["b1_decode_tok_s"] = (len(toks) - 1) / (total - first)
        n, plen, new = (32, 512, 32) if quick else (256, 512, 128)
        prompts = _prompts(n, plen, 2)
        steps0 = eng.stats.steps
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_generate(eng, p, f"j{i}", new) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        made = sum(len(r[0]) for r in results)
        out["batch"] = f"{n} x {plen} -> {new}"
        out["batch_tok_s"], out["batch_s"], out["batch_steps"] = made / wall, wall, eng.stats.steps - steps0
        long_len = 4096 if DEVICE == "cuda" else 200
        await _generate(eng, _prompts(1, long_len, 98)[0], "warm4k", 1)
        _, ttft, _ = await _generate(eng, _prompts(1, long_len, 3)[0], "t4k", 1)
        out["ttft_4k_ms"] = ttft * 1000
        if greedy_prompts is not None:
            out["greedy"] = [(await _generate(eng, p, f"g{i}", 32))[0] for i, p in enumerate(greedy_prompts)]
        out["kv_host_gb_s"] = _kv_round_trip(loaded.pool)
    finally:
        await eng.cleanup()
        del eng
        free_gpu()
    return out


def _kv_round_trip(pool: Any) -> float:
    """GB/s of export (device → host bytes) + import (host → device) of 256 blocks: the
    TCP path's two device crossings."""
    ids = list(range(min(256, pool.num_blocks // 2)))
    _sync()
    t0 = time.perf_counter()
    data = pool.export(ids)
    pool.import_([i + len(ids) for i in ids], data)
    _sync()  # no gc.collect or cache release inside the timed span
    return 2 * len(data) / (time.perf_counter() - t0) / 1e9


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- sections


def section_checks(args: argparse.Namespace) -> None:
    from kvmesh.engines.hf import paged_attention

    errs = paged_attention.self_check(torch.device("cuda"))
    worst = max(errs.values())
    row("paged decode kernel vs reference (bf16)", f"max |err| {worst:.2e}", "OK" if worst < 2e-2 else "MISMATCH")

    async def tokens(**kw: Any) -> list[list[int]]:
        eng = HfEngine(HfOptions(str(bundled_model_path()), seed=0, num_blocks=512, **kw))
        await eng.start()
        try:
            out = []
            for i, p in enumerate(_prompts(4, 40, 7)):
                out.append((await _generate(eng, p, f"c{i}", 32))[0])
            gathered = await asyncio.gather(*(_generate(eng, p, f"d{i}", 32) for i, p in enumerate(_prompts(4, 40, 7))))
            out += [g[0] for g in gathered]
            return out
        finally:
            await eng.cleanup()

    cpu = asyncio.run(tokens(device="cpu", dtype="float32"))
    gpu = asyncio.run(tokens(device="cuda", dtype="float32"))
    same = sum(a == b for a, b in zip(cpu, gpu, strict=True))
    row("bundled model fp32: greedy tokens cuda == cpu", f"{same}/{len(cpu)} sequences", "OK" if same == len(cpu) else "DIFF")
    eager = asyncio.run(tokens(device="cuda", dtype="bfloat16", enforce_eager=True))
    graphs = asyncio.run(tokens(device="cuda", dtype="bfloat16"))
    same = sum(a == b for a, b in zip(eager, graphs, strict=True))
    row("bundled model bf16: CUDA graphs == eager", f"{same}/{len(eager)} sequences", "OK" if same == len(eager) else "DIFF")
    free_gpu()


def section_bandwidth(args: argparse.Namespace) -> float:
    import gpu_anchor

    gbs = gpu_anchor.copy_bandwidth(2 << 30)
    row("device copy bandwidth (read + write)", f"{gbs:,.0f} GB/s")
    return gbs


def section_shape(args: argparse.Namespace, shape: str, bandwidth: float) -> None:
    import gpu_anchor
    from kvmesh.engines.hf.model import LlamaSpec
    from kvmesh.engines.hf.shapes import hf_state_dict, random_weights, shape_config

    cfg = shape_config(shape)
    spec = LlamaSpec.from_config(cfg)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    weights = random_weights(spec, seed=0, device=DEVICE, dtype=dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    limit = bandwidth * 1e9 / weight_bytes
    row(f"{shape}: weights / bandwidth limit, batch-1 decode", f"{weight_bytes / 2**30:.2f} GiB / {limit:,.0f} tok/s")
    model = gpu_anchor.build_hf_model(cfg, hf_state_dict(spec, weights), dtype, device=DEVICE)
    del weights
    want_greedy = shape == "llama-1b"
    greedy_prompts = _prompts(10, 24, 11, vocab=spec.vocab_size) if want_greedy else None
    try:
        hf1 = gpu_anchor.hf_generate_tps(model, 128, 32 if args.quick else 256, reps=1)
        row(f"{shape}: transformers generate, batch 1", f"{hf1['tokens_per_s']:,.1f} tok/s",
            f"{hf1['tokens_per_s'] / limit:.1%} of the limit")  # fmt: skip
        n, plen, new = (32, 512, 32) if args.quick else (256, 512, 128)
        hfb = {"tokens_per_s": float("nan"), "seconds": float("nan")}
        if DEVICE == "cuda":  # on the CPU it sizes its cache from the host's memory
            hfb = gpu_anchor.hf_generate_batch_tps(model, n, plen, new)
        row(f"{shape}: transformers generate_batch {n} x {plen} -> {new}", f"{hfb['tokens_per_s']:,.0f} out tok/s",
            f"{hfb['seconds']:.1f} s")  # fmt: skip
        theirs = gpu_anchor.hf_greedy_tokens(model, greedy_prompts, 32) if greedy_prompts else None
    finally:
        del model
        free_gpu()
    ours = asyncio.run(engine_figures(shape, args.quick, greedy_prompts))
    row(f"{shape}: kvmesh engine start (graph capture)", f"{ours['start_s']:.1f} s ({ours['capture_s'] or 0:.1f} s)",
        f"{ours['kv_blocks']} KV blocks")  # fmt: skip
    row(f"{shape}: kvmesh batch-1 decode", f"{ours['b1_tok_s']:,.1f} tok/s",
        f"{ours['b1_tok_s'] / limit:.1%} of the limit ({ours['b1_decode_tok_s']:,.1f} decode only); "
        f"{ours['b1_tok_s'] / hf1['tokens_per_s']:.1f}x transformers")  # fmt: skip
    row(f"{shape}: kvmesh batch job {ours['batch']}", f"{ours['batch_tok_s']:,.0f} out tok/s",
        f"{ours['batch_s']:.1f} s, {ours['batch_steps']} passes; {ours['batch_tok_s'] / hfb['tokens_per_s']:.1f}x "
        "transformers generate_batch")  # fmt: skip
    row(f"{shape}: kvmesh TTFT, 4,096-token prompt", f"{ours['ttft_4k_ms']:,.0f} ms")
    row(f"{shape}: KV export + import through the host", f"{ours['kv_host_gb_s']:.1f} GB/s")
    if theirs is not None:
        first = [sum(1 for _ in _common(a, b)) for a, b in zip(ours["greedy"], theirs, strict=True)]
        same = sum(a == b for a, b in zip(ours["greedy"], theirs, strict=True))
        row(f"{shape}: first 32 greedy tokens == transformers'", f"{same}/10 prompts",
            f"common prefix lengths {first}")  # fmt: skip
        agree, steps, gap = teacher_forced(spec, dtype, greedy_prompts, theirs)
        row(f"{shape}: teacher-forced on transformers' tokens: theirs is our argmax", f"{agree}/{steps} steps",
            f"largest gap where not: {gap:.4f} (a bf16 ulp is 0.0156 at logits of 2-4, 0.031 at 4-8)")  # fmt: skip


def teacher_forced(
    spec: Any, dtype: torch.dtype, prompts: list[list[int]], theirs: list[list[int]]
) -> tuple[int, int, float]:
    """kvmesh's model (paged passes, as the engine on a GPU runs them) fed transformers'
    greedy tokens: at how many steps their token is also our argmax, and by how much our
    max beats it where it is not. Separates a real difference from the near-ties of
    random weights, where one rounding step flips a greedy choice and the rest diverges."""
    from kvmesh.engines.hf.batch import Chunk, make_paged_inputs
    from kvmesh.engines.hf.kv import KvPool
    from kvmesh.engines.hf.model import LlamaModel
    from kvmesh.engines.hf.shapes import random_weights

    model = LlamaModel(spec, random_weights(spec, seed=0, device=DEVICE, dtype=dtype))
    agree, steps, gap = 0, 0, 0.0
    for prompt, tokens in zip(prompts, theirs, strict=True):
        blocks = -(-(len(prompt) + len(tokens)) // 16)
        pool = KvPool(blocks, 16, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=DEVICE)
        table, seq = list(range(blocks)), list(prompt)
        logits = model.forward(make_paged_inputs([Chunk(seq, 0, table, True)], 16, DEVICE), pool)[0].float()
        for tok in tokens:
            best = float(logits.max())
            steps += 1
            agree += int(logits.argmax()) == tok
            gap = max(gap, best - float(logits[tok]))
            seq.append(tok)
            step = make_paged_inputs([Chunk([tok], len(seq) - 1, table, True)], 16, DEVICE)
            logits = model.forward(step, pool)[0].float()
    del model
    free_gpu()
    return agree, steps, gap


def _common(a: list[int], b: list[int]) -> list[int]:
    out = []
    for x, y in zip(a, b):
        if x != y:
            break
        out.append(x)
    return out


@contextlib.contextmanager
def _server(cmd: list[str], port: int) -> Iterator[tuple[Any, str]]:
    """A ``kvmesh run`` process, ready: (its LaunchedServer, the served model). Its log's
    tail is printed when the body fails; it is stopped by PID in any case."""
    from _lib import launch_server, wait_ready

    server = launch_server(cmd, port)
    try:
        model, _ = wait_ready(server.url, timeout=240, proc=server.proc)
        yield server, model
    except Exception:
        print(server.log_tail(60), flush=True)
        raise
    finally:
        server.stop()
        server.remove_temp_log()


def _serve(extra: list[str], seconds: float, concurrency: int, texts: list[str] | None) -> dict[str, Any]:
    from _lib import free_port, kvmesh_command, run_load

    port = free_port()
    cmd = kvmesh_command(port, workers=2, router_mode="kv", extra=["--engine", "hf", "--device", DEVICE, *extra])
    cmd = [a for a in cmd if a not in ("--speedup", "1000000000.0")]
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    with _server(cmd, port) as (server, model):
        out["ready_s"] = time.perf_counter() - t0
        if texts is not None:
            out["texts"] = [_complete(server.url, model, t) for t in texts]
        res = run_load(server.url, model, concurrency, requests=100_000, prompt_tokens=128, output_tokens=64,
                       max_seconds=seconds, warmup=concurrency, request_timeout=30)  # fmt: skip
        out |= {"ok": res.ok, "failures": res.failures, "tok_s": res.output_tok_per_s,
                "ttft_p50": res.ttft_p50_ms, "itl_p50": res.itl_p50_ms, "errors": res.errors}  # fmt: skip
        out["canaries"] = _canary_results(_get(server.url + "/metrics"))
    return out


def _canary_results(metrics: str) -> dict[str, int]:
    """Canary checks so far by result (ok, wrong_tokens, logit_out_of_range, ...), every worker."""
    counts: dict[str, int] = {}
    for m in re.finditer(r'health_check_duration_seconds_count\{check_type="canary",result="(\w+)"[^}]*\} ([0-9.e+]+)', metrics):
        counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def _complete(url: str, model: str, prompt: str) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


TEXTS = [
    "def read_config(path):\n    \"\"\"Read a TOML configuration file and return it as a dict.\"\"\"\n",
    "import os\nimport sys\n\n\nclass Cache:\n    \"\"\"A small LRU cache with a fixed capacity.\"\"\"\n\n    def",
    "The history of the printing press begins in the fifteenth century, when",
    "Q: What is the capital of France? Explain your reasoning step by step.\nA:",
]


def section_serve(args: argparse.Namespace, state: dict[str, Any], shape: str) -> None:
    seconds = 10 if args.quick else args.load_s
    extra = ["--gpu-memory-fraction", "0.4", "--hf-max-num-seqs", "64", "--hf-max-num-batched-tokens", "2048",
             "--canary-interval", "2"]  # the canaries' token and logprob checks on real logits, under the load
    if shape:
        extra += ["--random-weights", shape]
    res = _serve(extra, seconds, 32, None if shape else TEXTS)
    if not shape:
        state["aggregated_texts"] = res["texts"]
    _serve_rows(f"{shape} (synthetic)" if shape else "bundled model", res)


def _serve_rows(what: str, res: dict[str, Any]) -> None:
    checks = res.get("canaries") or {}
    bad = sum(v for k, v in checks.items() if k != "ok")
    row(f"kvmesh run, {what}: canary checks (tokens + top logprob, real logits)", f"{checks.get('ok', 0)} ok, {bad} not",
        ", ".join(f"{k} {v}" for k, v in sorted(checks.items())))  # fmt: skip
    row(f"kvmesh run, 2 workers, kv router, {what}", f"{res['tok_s']:,.0f} out tok/s",
        f"{res['ok']} ok, {res['failures']} failed; TTFT p50 {res['ttft_p50'] or 0:.0f} ms, ITL p50 "
        f"{res['itl_p50'] or 0:.1f} ms; ready in {res['ready_s']:.0f} s {res['errors'][:2] or ''}")  # fmt: skip


def section_disagg(args: argparse.Namespace, state: dict[str, Any]) -> None:
    from _lib import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "kvmesh.cli.main", "run", "--engine", "hf", "--device", DEVICE,
           "--prefill-workers", "1", "--decode-workers", "1", "--max-local-prefill-length", "4",
           "--gpu-memory-fraction", "0.4", "--hf-max-num-seqs", "64", "--hf-max-num-batched-tokens", "2048",
           "--http-host", "127.0.0.1", "--http-port", str(port)]  # fmt: skip
    with _server(cmd, port) as (server, model):
        texts = [_complete(server.url, model, t) for t in TEXTS]
        metrics = _get(server.url + "/metrics")
    agg = state.get("aggregated_texts")
    same = sum(a == b for a, b in zip(texts, agg or [], strict=False))
    row("disaggregated 1P + 1D: greedy text == aggregated", f"{same}/{len(TEXTS)}" if agg else "no aggregated run",
        "" if agg is None or same == len(TEXTS) else f"e.g. {texts[0]!r} vs {agg[0]!r}")  # fmt: skip
    moved, seconds = _metric_sum(metrics, "kv_bytes_received"), _metric_sum(metrics, "kv_transfer_s")
    remote = _metric_sum(metrics, "remote_prefills")
    gbs = f"{moved / seconds / 1e9:.2f} GB/s" if seconds else "n/a"
    row("disaggregated: KV moved (TCP through host memory)", gbs,
        f"{moved / 1e6:.1f} MB in {seconds * 1000:.0f} ms, {remote:.0f} remote prefills")  # fmt: skip


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("#") and re.search(rf"{name}(_total)?(\{{|\s)", line):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


# ---------------------------------------------------------------------------- main


def run_section(name: str, est_s: float, args: argparse.Namespace, fn: Callable[[], Any]) -> Any:
    left = args.budget_s - (time.perf_counter() - T0)
    if left < est_s:
        NOTES.append(f"section {name} skipped: {left:.0f} s left of the budget, it needs ~{est_s:.0f} s")
        log(NOTES[-1])
        return None
    log(f"section {name} (~{est_s:.0f} s)")
    try:
        return fn()
    except Exception as exc:  # one section's failure is reported, the rest still run
        import traceback

        traceback.print_exc()
        NOTES.append(f"section {name} failed: {type(exc).__name__}: {exc}"[:600])
        free_gpu()
        return None


def _dry_run_shapes() -> None:
    """--device cpu: the shapes shrunk to a few MB, so the sections' code runs here."""
    from kvmesh.engines.hf import shapes

    small = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096, "max_position_embeddings": 4096}  # fmt: skip
    for name in shapes.SHAPES:
        shapes.SHAPES[name] = shapes.SHAPES[name] | small


def table() -> str:
    card = "no GPU (dry run)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        card = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    head = [
        f"# kvmesh on a GPU: bench/gpu.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"{card}; torch {torch.__version__}, transformers {_version('transformers')}, triton {_version('triton')}",
        "",
        "| what | figure | note |",
        "| --- | --- | --- |",
    ]
    body = [f"| {w} | {f} | {n} |" for w, f, n in ROWS]
    tail = ["", *[f"- {n}" for n in NOTES], "", f"total {time.perf_counter() - T0:.0f} s"]
    return "\n".join(head + body + tail) + "\n"


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, 1B only, short loads (~2 minutes)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="skip sections that would end past this")
    ap.add_argument("--load-s", type=float, default=20.0, help="seconds of HTTP load per kvmesh run")
    ap.add_argument("--sections", default="checks,bandwidth,llama-1b,llama-8b,serve,disagg")
    ap.add_argument("--out", default="", help="also write the table here (markdown)")
    ap.add_argument("--device", default="cuda", help="cpu: dry-run the serve and disagg sections without a GPU")
    args = ap.parse_args()
    global DEVICE, OUT_PATH
    DEVICE = args.device
    OUT_PATH = Path(args.out) if args.out else None
    if DEVICE == "cpu":  # a dry run: sections that need no GPU kernel, tiny sizes
        args.sections = ",".join(s for s in args.sections.split(",") if s not in ("checks", "bandwidth"))
        _dry_run_shapes()
    elif not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("KVMESH_LOG_LEVEL", "warning")
    wanted = args.sections.split(",")
    state: dict[str, Any] = {}
    # the most telling first: a run cut short (budget, device time) keeps what it measured
    bandwidth = run_section("bandwidth", 5, args, lambda: section_bandwidth(args)) if "bandwidth" in wanted else None
    if DEVICE == "cpu":
        bandwidth = 10.0
    for shape, est in (("llama-1b", 90), ("llama-8b", 130)):
        if shape in wanted and not (args.quick and shape == "llama-8b") and bandwidth:
            run_section(shape, 20 if args.quick else est, args, lambda s=shape: section_shape(args, s, bandwidth))
    if "checks" in wanted:
        run_section("checks", 30, args, lambda: section_checks(args))
    if "serve" in wanted:
        run_section("serve", 50 + args.load_s, args, lambda: section_serve(args, state, ""))
    if "disagg" in wanted:
        run_section("disagg", 45, args, lambda: section_disagg(args, state))
    if "serve" in wanted and not args.quick:
        run_section("serve llama-1b", 60 + args.load_s, args, lambda: section_serve(args, state, "llama-1b"))
    text = table()
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
