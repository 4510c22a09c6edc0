#!/usr/bin/env python3
"""Real-traffic benchmark: a Mooncake trace replayed in real time against ``kvmesh run``.

Each arm is a fresh fleet of 4 mocker workers (block size 64, 3,072 blocks per worker,
speedup 3, vLLM-like batch limits) behind one frontend, fed the first ``--requests``
requests of the trace at their timestamps (open loop, fixed schedule, scaled by
``--time-scale``). Arms, alternated in this order in every round so that load on the
machine hits them alike:

* ``kv`` / ``round_robin`` with health checks on (``--canary-interval``, default 5 s:
  harsher than the 30 s default), and
* the same with ``--canary-interval 0`` (no health checks: the baseline);
* Dynamo 1.6.1 (kv, round-robin) with the same settings when its virtualenv exists
  (``--dynamo-venv``, as made by ``bench/compare_dynamo.py --install``; not created here).

The client is the project's own (``bench/_lib.py``'s HTTP/SSE client), not aiperf:
one connection per request, /v1/completions, a text prompt of exactly
``input_length`` tokens (each trace hash id becomes a fixed run of 512 one-token
words, so prompts share the prefixes the trace says they share), ``max_tokens`` =
``output_length`` with ``ignore_eos``, streaming with usage. ITL is per request, as
aiperf defines it: (last token − first token) ÷ (output tokens − 1).

With ``--client aiperf`` NVIDIA's aiperf replays the trace instead (fixed schedule, its own
prompts from the hash ids; see :func:`aiperf_replay`).

Printed per arm: TTFT p50/p90/p99 overall and by prompt length (<1k, 1k–4k, 4k–16k,
≥16k tokens), ITL p50/p99, errors, prefix-cache hit rate (kvmesh: cached ÷ prompt
tokens from its metrics), the prompt tokens the server counted ÷ the trace's (1.000:
both fleets prefill the same tokens), migrations, health transitions, and the routing split; then
the ratios health-on ÷ health-off (and kvmesh ÷ Dynamo). The "physics" line is what
the mocker's timing model alone gives prompts under 1k tokens (an idle worker, no
cache hit): the floor TTFT could reach.

    python bench/trace_replay.py                       # 300 requests, 1 round (~8 minutes)
    python bench/trace_replay.py --requests 1000 --rounds 2 --json /tmp/trace.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _lib import (  # noqa: E402
    HttpConnection,
    build_request,
    check_loopback,
    free_port,
    http_get,
    kvmesh_command,
    launch_server,
    percentile,
    precompile_kvmesh,
    run_async,
    wait_ready,
)

DEFAULT_TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MODEL = "kvmesh-tiny"
BUCKETS = ((0, 1024, "<1k"), (1024, 4096, "1k-4k"), (4096, 16384, "4k-16k"), (16384, 1 << 30, ">=16k"))
BLOCK = 512  # trace hash-id block, tokens
FLEET = {"workers": 4, "block_size": 64, "num_blocks": 3072, "speedup": 3.0, "max_num_seqs": 256,
         "max_num_batched_tokens": 8192}  # fmt: skip


def log(*a: object) -> None:
    print("[trace]", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- prompts


def one_token_words(model_path: str) -> list[str]:
    """Lower-case words the model's tokenizer encodes as one token each after a space."""
    from kvmesh.preprocess.tokenizer import Tokenizer

    tok = Tokenizer.from_file(Path(model_path) / "tokenizer.json")
    words = sorted(t[1:] for t in tok.raw.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower())
    if len(words) < 50:
        raise SystemExit(f"{model_path}: too few one-token words to build prompts")
    return words


class PromptSynth:
    """Text prompts from hash ids: block ``h`` is 512 words drawn by ``Random(h)``."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self._cache: dict[int, list[str]] = {}

    def block(self, h: int) -> list[str]:
        b = self._cache.get(h)
        if b is None:
            rng = random.Random(h)
            b = self._cache[h] = [rng.choice(self.words) for _ in range(BLOCK)]
        return b

    def prompt(self, hash_ids: tuple[int, ...], length: int) -> str:
        out: list[str] = []
        for h in hash_ids:
            out.extend(self.block(h))
            if len(out) >= length:
                break
        return " " + " ".join(out[:length])


def model_folder(tmp: str) -> str:
    """The bundled model with a context long enough for the trace (the mocker needs no weights)."""
    from kvmesh.preprocess.model import bundled_model_path

    src = Path(bundled_model_path())
    dst = Path(tmp) / "model" / MODEL  # the served name is the folder's
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = 262144
    (dst / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = 262144
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return str(dst)


# ---------------------------------------------------------------------------- servers


@dataclass
class Arm:
    system: str  # kvmesh | dynamo
    mode: str  # kv | round_robin
    health: bool

    @property
    def name(self) -> str:
        if self.system == "dynamo":
            return f"dynamo {self.mode}"
        return f"kvmesh {self.mode} health {'on' if self.health else 'off'}"


def kvmesh_arm(arm: Arm, a: argparse.Namespace, model_path: str, log_dir: str):  # type: ignore[no-untyped-def]
    port = free_port()
    extra = ["--model-path", model_path, "--block-size", str(FLEET["block_size"]),
             "--num-blocks", str(FLEET["num_blocks"]), "--max-num-seqs", str(FLEET["max_num_seqs"]),
             "--max-num-batched-tokens", str(FLEET["max_num_batched_tokens"]),
             "--canary-interval", str(a.canary_interval if arm.health else 0), "--admin",
             # aiperf writes a special token's text (<|im_end|>) at the start of every 512-token block
             # of a trace prompt; Dynamo (as vLLM) reads it as one control token, kvmesh's default reads a
             # user's special-token text as plain characters (8 tokens here: +1.4 % prompt tokens). The
             # client is trusted here, so kvmesh parses them too: both fleets get the same token ids
             # (the "prompt/trace" column checks it).
             "--allow-special-tokens"]  # fmt: skip
    cmd = kvmesh_command(port, FLEET["workers"], FLEET["speedup"], arm.mode, extra)
    return launch_server(cmd, port, os.path.join(log_dir, arm.name.replace(" ", "-") + ".log"))


def dynamo_arm(arm: Arm, a: argparse.Namespace, model_path: str, log_dir: str):  # type: ignore[no-untyped-def]
    """Dynamo's frontend + one mocker process running 4 workers (``--num-workers``)."""
    from compare_dynamo import DynamoServer

    mode = "round-robin" if arm.mode == "round_robin" else arm.mode
    srv = DynamoServer(a.dynamo_venv, model_path, mode, FLEET["speedup"], log_dir, mocker_extra=[
        "--num-workers", str(FLEET["workers"]), "--block-size", str(FLEET["block_size"]),
        "--num-gpu-blocks-override", str(FLEET["num_blocks"]), "--max-num-seqs", str(FLEET["max_num_seqs"]),
        "--max-num-batched-tokens", str(FLEET["max_num_batched_tokens"]),
    ])  # fmt: skip
    return srv


async def _wait_workers(url: str, n: int, timeout: float) -> None:
    host, port = check_loopback(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = await http_get(host, port, "/admin/workers")
        if r.status == 200 and len(json.loads(bytes(r.body))["workers"]) >= n:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"fewer than {n} workers after {timeout:.0f} s")


async def _metrics(url: str) -> str:
    host, port = check_loopback(url)
    r = await http_get(host, port, "/metrics", timeout=30)
    return bytes(r.body).decode() if r.status == 200 else ""


def _sum(text: str, pattern: str) -> float:
    return sum(float(v) for v in re.findall(pattern, text))


# ---------------------------------------------------------------------------- one arm


@dataclass
class Sample:
    input_length: int
    output_length: int
    ok: bool = False
    error: str = ""
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tokens: int = 0


@dataclass
class ArmResult:
    arm: Arm
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    hit_rate: float | None = None
    prompt_tokens: float | None = None  # prompt tokens the server counted (usage, or kvmesh's metrics)
    migrations: float | None = None
    transitions: float | None = None
    transitions_detail: list[str] = field(default_factory=list)
    split: list[int] = field(default_factory=list)


async def _one(url: str, body: bytes, s: Sample, timeout: float) -> None:
    host, port = check_loopback(url)
    try:
        conn = await HttpConnection.connect(host, port)
    except OSError as exc:
        s.error = repr(exc)
        return
    try:
        r = await conn.request(build_request("POST", "/v1/completions", host, port, body), timeout)
    finally:
        conn.close()
    stamps = r.token_stamps()
    s.tokens = r.n_tokens
    if not r.ok or r.status != 200 or not stamps:
        s.error = r.error or f"status {r.status}, {len(stamps)} token events"
        return
    if s.tokens != s.output_length:
        s.error = f"{s.tokens} tokens, {s.output_length} asked"
    s.ok = not s.error
    s.ttft_ms = (stamps[0] - r.t_send) * 1000.0
    if s.tokens > 1:
        s.itl_ms = (stamps[-1] - stamps[0]) * 1000.0 / (s.tokens - 1)


async def replay(url: str, trace, synth: PromptSynth, a: argparse.Namespace) -> tuple[list[Sample], float]:  # type: ignore[no-untyped-def]
    t_first = trace[0].timestamp_ms
    bodies = []
    for req in trace:
        body = {"model": MODEL, "prompt": synth.prompt(req.hash_ids, req.input_length), "max_tokens": req.output_length,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        bodies.append(json.dumps(body).encode())
    samples = [Sample(r.input_length, r.output_length) for r in trace]
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2
    tasks = []
    for req, body, s in zip(trace, bodies, samples):
        at = start + (req.timestamp_ms - t_first) / 1000.0 / a.time_scale
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(_one(url, body, s, a.request_timeout)))
    await asyncio.gather(*tasks)
    return samples, loop.time() - start


# ---------------------------------------------------------------------------- aiperf client

AIPERF_MODEL_ID = "kvmesh/kvmesh-tiny"  # the name the model folder gets in a private HF cache


def aiperf_env(model_path: str, log_dir: str) -> dict[str, str]:
    """aiperf's dataset workers force the HF hub offline, where a plain folder path is
    refused as a tokenizer: the model folder is placed in a private, offline HF cache
    under a repo id instead (nothing is downloaded)."""
    hub = Path(log_dir) / "hf" / "hub" / ("models--" + AIPERF_MODEL_ID.replace("/", "--"))
    rev = "0" * 40
    snap = hub / "snapshots" / rev
    if not snap.exists():
        snap.mkdir(parents=True)
        (hub / "refs").mkdir()
        (hub / "refs" / "main").write_text(rev)
        for f in Path(model_path).iterdir():
            shutil.copy(f, snap / f.name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HOME=str(Path(log_dir) / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def aiperf_replay(url: str, trace, model_path: str, log_dir: str, arm: Arm,  # type: ignore[no-untyped-def]
                  a: argparse.Namespace) -> tuple[list[Sample], float, float | None, float]:
    """The trace slice replayed by NVIDIA's aiperf (mooncake_trace dataset, fixed
    schedule: each request at its timestamp; prompts built from the hash ids in blocks
    of 512 tokens; ``max_tokens`` = output_length with ``ignore_eos``). Returns the
    samples, aiperf's benchmark duration, the prefix-cache hit rate the server
    reported in usage (cached ÷ prompt tokens; None if it reports none) and the prompt
    tokens it reported."""
    out = Path(log_dir) / ("aiperf-" + arm.name.replace(" ", "-") + f"-{time.monotonic_ns()}")
    out.mkdir()
    sliced = out / "trace.jsonl"
    t_first = trace[0].timestamp_ms
    sliced.write_text("".join(json.dumps({"timestamp": round((r.timestamp_ms - t_first) / a.time_scale),
                                          "input_length": r.input_length,
                                          "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                              for r in trace))  # fmt: skip
    cmd = [a.aiperf, "profile", "--model", MODEL, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", AIPERF_MODEL_ID, "--input-file", str(sliced), "--custom-dataset-type", "mooncake_trace",
           "--fixed-schedule", "--isl-block-size", str(BLOCK), "--extra-inputs", "ignore_eos:true",
           "--use-server-token-count", "--request-timeout-seconds", str(a.request_timeout),
           "--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--workers-max", str(a.aiperf_workers), "--record-processors", "1"]  # fmt: skip
    t0 = time.monotonic()
    with open(out / "aiperf.out", "w") as log_f:
        rc = subprocess.run(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=aiperf_env(model_path, log_dir),
                            timeout=a.request_timeout + 900, check=False).returncode  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"aiperf exited with {rc}; see {out / 'aiperf.out'}")
    log(f"  aiperf took {time.monotonic() - t0:.0f} s (dataset build + replay)")
    return _aiperf_samples(out, len(trace))


def _metric(m: dict, key: str) -> float | None:  # type: ignore[type-arg]
    v = m.get(key)
    return float(v["value"]) if isinstance(v, dict) and v.get("value") is not None else None


def _aiperf_samples(out: Path, n: int) -> tuple[list[Sample], float, float | None, float]:
    samples: list[Sample] = []
    prompt = cached = 0.0
    for line in (out / "profile_export.jsonl").read_text().splitlines():
        rec = json.loads(line)
        m = rec.get("metrics") or {}
        isl = _metric(m, "input_sequence_length") or 0.0
        s = Sample(int(isl), 0)
        err = rec.get("error")
        s.ttft_ms, s.itl_ms = _metric(m, "time_to_first_token"), _metric(m, "inter_token_latency")
        s.tokens = int(_metric(m, "output_sequence_length") or 0)
        s.ok = not err and s.ttft_ms is not None
        s.error = json.dumps(err)[:200] if err else ("" if s.ok else "no first token")
        prompt += _metric(m, "usage_prompt_tokens") or 0.0
        cached += _metric(m, "usage_prompt_cache_read_tokens") or 0.0
        samples.append(s)
    samples += [Sample(0, 0, error="no record from aiperf") for _ in range(n - len(samples))]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    duration = summary.get("benchmark_duration", {}).get("avg") or 0.0
    return samples, float(duration), (cached / prompt if prompt and cached else None), prompt


def run_arm(arm: Arm, a: argparse.Namespace, trace, synth: PromptSynth, model_path: str, log_dir: str) -> ArmResult:  # type: ignore[no-untyped-def]
    launch = dynamo_arm if arm.system == "dynamo" else kvmesh_arm
    srv = launch(arm, a, model_path, log_dir)
    res = ArmResult(arm)
    try:
        proc = srv.frontend.proc if arm.system == "dynamo" else srv.proc
        wait_ready(srv.url, a.launch_timeout, model=MODEL, proc=proc, min_tokens=False)
        if arm.system == "kvmesh":
            run_async(_wait_workers(srv.url, FLEET["workers"], a.launch_timeout))
            if arm.health:  # let the first canary round (idle baselines) finish
                time.sleep(1.0)
        before = run_async(_metrics(srv.url)) if arm.system == "kvmesh" else ""
        if a.client == "aiperf":
            res.samples, res.wall_s, res.hit_rate, res.prompt_tokens = aiperf_replay(
                srv.url, trace, model_path, log_dir, arm, a)
        else:
            res.samples, res.wall_s = run_async(replay(srv.url, trace, synth, a))
        if arm.system == "kvmesh":
            after = run_async(_metrics(srv.url))
            _kvmesh_counters(res, before, after)
    finally:
        srv.stop()
    return res


def _kvmesh_counters(res: ArmResult, before: str, after: str) -> None:
    def delta(pattern: str) -> float:
        return _sum(after, pattern) - _sum(before, pattern)

    prompt = delta(r'kvmesh_frontend_input_tokens_total\{model="[^"]+"\} ([0-9.e+]+)')
    cached = delta(r'kvmesh_frontend_cached_tokens_total\{model="[^"]+"\} ([0-9.e+]+)')
    if res.hit_rate is None:
        res.hit_rate = cached / prompt if prompt else None
    if not res.prompt_tokens:
        res.prompt_tokens = prompt
    res.migrations = delta(r"kvmesh_migration_total\{[^}]*\} ([0-9.e+]+)")
    res.transitions = delta(r"kvmesh_health_transitions_total\{[^}]*\} ([0-9.e+]+)")
    res.transitions_detail = [
        f"{w}->{to} ({cause}) x{float(n):g}"
        for cause, to, w, n in re.findall(r'kvmesh_health_transitions_total\{cause="([^"]*)",to="([a-z]+)",worker_id="([0-9a-f]+)"\} ([0-9.e+]+)', after)
        if float(n) > 0
    ]
    res.split = sorted(int(float(n)) for n in re.findall(r"kvmesh_router_decisions_total\{[^}]*\} ([0-9.e+]+)", after))


# ---------------------------------------------------------------------------- report


def summary(res: ArmResult, trace_tokens: int) -> dict[str, object]:
    ok = [s for s in res.samples if s.ok]
    ttft = [s.ttft_ms for s in ok if s.ttft_ms is not None]
    itl = [s.itl_ms for s in ok if s.itl_ms is not None]
    out: dict[str, object] = {
        "arm": res.arm.name, "requests": len(res.samples), "errors": len(res.samples) - len(ok),
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
        "hit_rate": res.hit_rate, "migrations": res.migrations, "transitions": res.transitions,
        "transitions_detail": res.transitions_detail, "split": res.split, "wall_s": res.wall_s,
        "prompt_ratio": res.prompt_tokens / trace_tokens if res.prompt_tokens and trace_tokens else None,
    }  # fmt: skip
    for lo, hi, name in BUCKETS:
        b = [s.ttft_ms for s in ok if lo <= s.input_length < hi and s.ttft_ms is not None]
        out[f"n {name}"] = len(b)
        out[f"ttft_p50 {name}"] = percentile(b, 50)
        out[f"ttft_p90 {name}"] = percentile(b, 90)
    errors = [s.error for s in res.samples if not s.ok][:3]
    if errors:
        out["first_errors"] = errors
    return out


def physics_ms(trace) -> float | None:  # type: ignore[no-untyped-def]
    """p50 TTFT the mocker's model alone gives prompts under 1k tokens (idle, no cache hit)."""
    from kvmesh.engines.mocker.options import MockerOptions

    opts = MockerOptions(block_size=FLEET["block_size"], speedup=FLEET["speedup"])
    short = [opts.step_ms(r.input_length, 0, 0.0) for r in trace if r.input_length < 1024]
    return percentile(short, 50)


def _f(v: object, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def table(rows: list[dict[str, object]]) -> str:
    cols = [("arm", "arm", 0), ("errors", "err", 0), ("ttft_p50", "TTFT p50", 0), ("ttft_p90", "p90", 0),
            ("ttft_p99", "p99", 0)]  # fmt: skip
    cols += [(f"ttft_p50 {n}", f"p50 {n}", 0) for _, _, n in BUCKETS]
    cols += [(f"ttft_p90 <1k", "p90 <1k", 0), ("itl_p50", "ITL p50", 1), ("itl_p99", "ITL p99", 1),
             ("hit_rate", "hit", 3), ("prompt_ratio", "prompt/trace", 3), ("migrations", "migr", 0),
             ("transitions", "health tr", 0)]  # fmt: skip
    head = " | ".join(h for _, h, _ in cols)
    lines = [f"| {head} |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_f(r.get(k), d) for k, _, d in cols) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, object]]) -> list[str]:
    """Arm A ÷ arm B per metric, each arm's value the median over its rounds."""
    by: dict[str, list[dict[str, object]]] = {}
    for r in rows:
        by.setdefault(str(r["arm"]), []).append(r)

    def med(arm: str, key: str) -> float | None:
        vals = [v for r in by[arm] if isinstance(v := r.get(key), float)]
        return percentile(vals, 50)

    out = []
    for mode in ("kv", "round_robin"):
        for num, den in ((f"kvmesh {mode} health on", f"kvmesh {mode} health off"),
                         (f"kvmesh {mode} health on", f"dynamo {mode}")):  # fmt: skip
            if num not in by or den not in by:
                continue
            parts = []
            for k in ("ttft_p50", "ttft_p90", "ttft_p99", "ttft_p50 <1k", "ttft_p90 <1k", "itl_p99"):
                x, y = med(num, k), med(den, k)
                parts.append(f"{k} {x / y:.2f}" if x is not None and y else f"{k} -")
            out.append(f"{num} / {den} (medians over {len(by[num])} round(s)): " + ", ".join(parts))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    ap.add_argument("--requests", type=int, default=300, help="replay the first N requests (300)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="2: arrivals twice as fast (1: real time)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the alternated arms (1)")
    ap.add_argument("--modes", default="kv,round_robin", help="router modes (kv,round_robin)")
    ap.add_argument("--canary-interval", type=float, default=5.0, help="the health-on arms' canary interval (5 s)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the --canary-interval 0 arms")
    ap.add_argument("--dynamo-venv", type=Path, default=HERE / ".venv-dynamo", help="Dynamo 1.6.1's virtualenv (used if present)")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--launch-timeout", type=float, default=120.0)
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--client", choices=("own", "aiperf"), default="own",
                    help="own: the bench's HTTP client; aiperf: NVIDIA's aiperf (fixed schedule)")
    ap.add_argument("--aiperf", default=str(HERE / ".venv-aiperf" / "bin" / "aiperf"),
                    help="the aiperf executable (bench/.venv-aiperf: python -m venv bench/.venv-aiperf && "
                         "bench/.venv-aiperf/bin/pip install aiperf)")
    ap.add_argument("--aiperf-workers", type=int, default=2, help="aiperf --workers-max (2: the machine is small)")
    ap.add_argument("--no-netns", action="store_true", help="with Dynamo arms: do not enter a private network namespace")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from kvmesh.replay.trace import load_trace

    trace = load_trace(a.trace, limit=a.requests)
    span = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0 / a.time_scale
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    dynamo = (a.dynamo_venv / "bin" / "python").exists()
    if a.client == "aiperf" and not Path(a.aiperf).exists():
        raise SystemExit(f"no aiperf at {a.aiperf} (python -m venv bench/.venv-aiperf && bench/.venv-aiperf/bin/pip install aiperf)")
    if dynamo and not a.no_netns:
        # Dynamo's ZMQ publishers bind 0.0.0.0: everything runs in a private network
        # namespace with loopback only (as bench/compare_dynamo.py does)
        from compare_dynamo import NETNS_MARK, loopback_up, reexec_in_netns

        if os.environ.get(NETNS_MARK) != "1":
            raise SystemExit(reexec_in_netns(list(argv if argv is not None else sys.argv[1:]), str(Path(__file__).resolve())))
        loopback_up()
    arms = []
    for mode in modes:
        arms.append(Arm("kvmesh", mode, True))
        if not a.no_baseline:
            arms.append(Arm("kvmesh", mode, False))
        if dynamo:
            arms.append(Arm("dynamo", mode, False))
    if not dynamo:
        log(f"no Dynamo virtualenv at {a.dynamo_venv}: kvmesh arms only")
    precompile_kvmesh()
    tmp = tempfile.mkdtemp(prefix="kvmesh-trace-")
    try:
        model_path = model_folder(tmp)
        synth = PromptSynth(one_token_words(model_path))
        log(f"{len(trace)} requests over {span:.0f} s per arm; arms: {', '.join(x.name for x in arms)}; logs in {tmp}")
        rows = []
        for rnd in range(a.rounds):
            for arm in arms:
                t0 = time.monotonic()
                res = run_arm(arm, a, trace, synth, model_path, tmp)
                row = summary(res, sum(r.input_length for r in trace))
                row["round"] = rnd + 1
                rows.append(row)
                log(f"round {rnd + 1} {arm.name}: TTFT p50 {_f(row['ttft_p50'])} ms p99 {_f(row['ttft_p99'])} ms, "
                    f"errors {row['errors']}, migrations {_f(row['migrations'])}, transitions {_f(row['transitions'])} "
                    f"{row['transitions_detail']} split {row['split']} ({time.monotonic() - t0:.0f} s)")  # fmt: skip
    finally:
        if a.json is None:
            shutil.rmtree(tmp, ignore_errors=True)
    lengths = sorted(r.input_length for r in trace)
    print(f"\n{len(trace)} requests of {Path(a.trace).name} (input p50 {percentile(lengths, 50):,.0f} tokens, "
          f"max {lengths[-1]:,}), {span:.0f} s real time per arm; {FLEET['workers']} mocker workers, block "
          f"{FLEET['block_size']}, {FLEET['num_blocks']} blocks/worker, speedup {FLEET['speedup']:g}; "
          f"health-on arms: --canary-interval {a.canary_interval:g}; times in ms\n")  # fmt: skip
    print(table(rows))
    phys = physics_ms(trace)
    if phys is not None:
        print(f"\nmocker physics, prompts < 1k tokens (idle worker, no cache hit): TTFT p50 {phys:.1f} ms")
        for r in rows:
            x = r.get("ttft_p50 <1k")
            if isinstance(x, float):
                print(f"  {r['arm']} (round {r['round']}): p50 <1k / physics = {x / phys:.2f}")
    print()
    for line in ratios(rows):
        print(line)
    for r in rows:
        if r.get("transitions_detail") or r.get("first_errors"):
            print(f"{r['arm']}: transitions {r['transitions_detail']}, errors {r.get('first_errors', [])}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
