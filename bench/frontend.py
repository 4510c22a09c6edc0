#!/usr/bin/env python3
"""Closed-loop streaming HTTP benchmark for the kvmesh frontend.

Launches ``kvmesh run --workers 1 --speedup 1e9`` on a free loopback port (or
targets ``--url`` with ``--frontend-pid``), waits for the first successful
completion, then runs one closed-loop level per concurrency value and prints
throughput, TTFT/ITL/e2e percentiles, frontend CPU per request and RSS.

    python bench/frontend.py                       # launch kvmesh, levels 1,8,64
    python bench/frontend.py --concurrency 8 --requests 300 --json out.json
    python bench/frontend.py --url http://127.0.0.1:8000 --frontend-pid 1234
    python bench/frontend.py --router-mode kv -- --some-extra-kvmesh-flag

Exit status is 1 when any request failed (2 on setup errors).
The load/measure API lives in ``_lib`` and is re-exported here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import (  # noqa: E402  (re-exported API)
    LaunchedServer,
    LoadResult,
    Workload,
    check_loopback,
    default_requests,
    default_warmup,
    descendant_pids,
    free_port,
    kvmesh_command,
    launch_server,
    measure_cpu,
    precompile_kvmesh,
    read_mem,
    run_async,
    run_load,
    run_load_async,
    wait_ready,
    wait_ready_async,
)

__all__ = [
    "LoadResult", "Workload", "run_load", "run_load_async", "measure_cpu", "read_mem",
    "wait_ready", "wait_ready_async", "launch_server", "kvmesh_command", "main",
    "descendant_pids", "default_requests", "default_warmup", "LaunchedServer",
]


def _parse_args(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
        prog="bench/frontend.py",
        description="Closed-loop streaming load generator for an OpenAI-compatible server "
                    "(extra args after -- go to `kvmesh run`).")
    g = p.add_argument_group("target")
    g.add_argument("--url", help="benchmark an already-running server (loopback only), "
                                 "e.g. http://127.0.0.1:8000; default: launch kvmesh")
    g.add_argument("--frontend-pid", default=None,
                   help="PID(s) of the server frontend to meter (comma separated), with --url")
    g.add_argument("--model", help="model name (default: first id from GET /v1/models)")
    g.add_argument("--workers", type=int, default=1, help="kvmesh run --workers (default 1)")
    g.add_argument("--speedup", default="1e9", help="kvmesh run --speedup (default 1e9)")
    g.add_argument("--router-mode", help="kvmesh run --router-mode")
    g.add_argument("--server-cmd", help="launch this command instead of kvmesh "
                                        "('{port}' is replaced by the chosen port)")
    g.add_argument("--server-log", help="server stdout/stderr log file (default: a temp file)")
    g.add_argument("--launch-timeout", type=float, default=180.0,
                   help="seconds to wait for the first successful completion (default 180)")
    w = p.add_argument_group("load")
    w.add_argument("--concurrency", default="1,8,64", help="comma-separated levels (default 1,8,64)")
    w.add_argument("--requests", type=int, default=None,
                   help="measured requests per level (default max(200, 20*C), capped at 2000)")
    w.add_argument("--warmup", type=int, default=None,
                   help="warm-up requests per level, excluded from stats (default max(2, C))")
    w.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop issuing requests after this many seconds per level (default 60)")
    w.add_argument("--request-timeout", type=float, default=120.0, help="per-request timeout (s)")
    w.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in token ids (128)")
    w.add_argument("--output-tokens", type=int, default=64, help="max_tokens with ignore_eos (64)")
    w.add_argument("--chat", action="store_true",
                   help="use /v1/chat/completions with a text message instead of token ids")
    w.add_argument("--chat-words", type=int, default=None,
                   help="words per chat message (default: --prompt-tokens)")
    w.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="first K prompt ids/words shared within each prefix group")
    w.add_argument("--prefix-groups", type=int, default=1, help="number of shared-prefix groups")
    w.add_argument("--no-min-tokens", action="store_true",
                   help="do not send min_tokens (servers that reject it)")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", help="also write results as JSON to OUT")
    o.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    a.extra = extra
    try:
        a.levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error("--concurrency takes comma-separated integers")
    if not a.levels or min(a.levels) < 1:
        p.error("--concurrency levels must be >= 1")
    if a.frontend_pid and not a.url:
        p.error("--frontend-pid only makes sense with --url")
    a.pids = [int(x) for x in a.frontend_pid.split(",")] if a.frontend_pid else []
    return a


def _fmt(v, nd: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}"


def format_table(levels: list[LoadResult]) -> str:
    cols = [("conc", 5), ("reqs", 6), ("req/s", 9), ("out tok/s", 10), ("TTFT p50", 9),
            ("TTFT p99", 9), ("ITL p50", 8), ("ITL p99", 8), ("e2e p50", 9),
            ("fe CPU ms/req", 13), ("fail", 5)]
    head = " ".join(f"{n:>{w}}" for n, w in cols)
    lines = [head, "-" * len(head)]
    for r in levels:
        vals = [str(r.concurrency), str(r.requests), _fmt(r.req_per_s), _fmt(r.output_tok_per_s, 0),
                _fmt(r.ttft_p50_ms, 2), _fmt(r.ttft_p99_ms, 2), _fmt(r.itl_p50_ms, 3),
                _fmt(r.itl_p99_ms, 3), _fmt(r.e2e_p50_ms, 1), _fmt(r.frontend_cpu_ms_per_req, 3),
                str(r.failures)]
        lines.append(" ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols)))
    lines.append("(latencies in ms; fe CPU = frontend utime+stime / requests incl. warm-up)")
    return "\n".join(lines)


def _mib(kb) -> str:
    return "-" if not kb else f"{kb / 1024:.1f} MiB"


async def _bench(a: argparse.Namespace, url: str, pids: list[int], server: LaunchedServer | None,
                 report: dict) -> list[LoadResult]:
    log = (lambda *x: None) if a.quiet else (lambda *x: print(*x, file=sys.stderr, flush=True))
    log(f"[bench] waiting for first completion from {url} ...")
    t_wait = time.perf_counter()
    model, t_ok = await wait_ready_async(url, a.launch_timeout, model=a.model, chat=a.chat,
                                         proc=server.proc if server else None,
                                         min_tokens=not a.no_min_tokens)
    if server is not None:
        report["launch_to_first_completion_s"] = t_ok - server.t_launch
        log(f"[bench] launch to first completion: {t_ok - server.t_launch:.2f}s (model {model!r})")
    else:
        report["ready_wait_s"] = t_ok - t_wait
        log(f"[bench] ready (model {model!r})")
    report["model"] = model
    if pids:
        await asyncio.sleep(0.5)  # let the frontend settle before the idle sample
        report["rss_idle_kb"] = read_mem(pids)["rss_kb"]
        report["descendants_at_start"] = len(descendant_pids(pids))
    wl = Workload(model, a.prompt_tokens, a.output_tokens, chat=a.chat, chat_words=a.chat_words,
                  shared_prefix_tokens=a.shared_prefix_tokens, prefix_groups=a.prefix_groups,
                  seed=a.seed, min_tokens=not a.no_min_tokens)
    results: list[LoadResult] = []
    for c in a.levels:
        n = default_requests(c) if a.requests is None else a.requests
        wu = default_warmup(c) if a.warmup is None else a.warmup
        log(f"[bench] concurrency {c}: {wu} warm-up + {n} requests (max {a.max_seconds:.0f}s) ...")
        r = await run_load_async(url, model, c, n, a.prompt_tokens, a.output_tokens, warmup=wu,
                                 max_seconds=a.max_seconds, request_timeout=a.request_timeout,
                                 frontend_pid=pids or None, workload=wl)
        results.append(r)
        log(f"[bench]   {r.req_per_s:.1f} req/s, TTFT p50 {_fmt(r.ttft_p50_ms, 2)} ms, "
            f"failures {r.failures}, {r.duration_s:.1f}s, client CPU "
            f"{r.client_cpu_ms_per_req:.3f} ms/req" + (f", errors: {r.errors}" if r.errors else ""))
    if pids:
        mem = read_mem(pids)
        peaks = [r.frontend_rss_peak_kb or 0 for r in results]
        report["rss_peak_kb"] = max(peaks + [mem["rss_kb"]])
        report["rss_hwm_kb"] = mem["hwm_kb"]
    return results


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(sys.argv[1:] if argv is None else argv)
    report: dict = {"config": {k: v for k, v in vars(a).items() if k not in ("levels", "pids")}}
    report["config"]["levels"] = a.levels
    server: LaunchedServer | None = None
    results: list[LoadResult] = []
    try:
        if a.url:
            check_loopback(a.url)
            url, pids = a.url.rstrip("/"), a.pids
        else:
            port = free_port()
            if a.server_cmd:
                cmd = shlex.split(a.server_cmd.replace("{port}", str(port))) + a.extra
            else:
                cmd = kvmesh_command(port, a.workers, a.speedup, a.router_mode, a.extra)
                precompile_kvmesh()
            report["server_cmd"] = cmd
            server = launch_server(cmd, port, a.server_log)
            url, pids = server.url, [server.pid]
            if not a.quiet:
                print(f"[bench] launched pid {server.pid}: {shlex.join(cmd)} (log {server.log_path})",
                      file=sys.stderr, flush=True)
        results = run_async(_bench(a, url, pids, server, report))
    except (RuntimeError, TimeoutError, OSError, ValueError) as e:
        print(f"[bench] error: {e}", file=sys.stderr)
        if server is not None:
            print(f"[bench] server log tail ({server.log_path}):\n{server.log_tail()}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            rc = server.stop()
            report["server_exit_code"] = rc
            report["server_leftover_processes"] = server.leftovers
            if server.leftovers:
                print("[bench] warning: server left child processes behind (killed)", file=sys.stderr)

    total_fail = sum(r.failures for r in results)
    if server is not None:
        if total_fail:
            print(f"[bench] server log: {server.log_path}", file=sys.stderr)
        else:
            server.remove_temp_log()
    report["levels"] = [r.to_dict() for r in results]
    report["failures"] = total_fail
    print(format_table(results))
    extras = []
    if "launch_to_first_completion_s" in report:
        extras.append(f"launch to first completion: {report['launch_to_first_completion_s']:.2f} s")
    if "rss_idle_kb" in report:
        extras.append(f"frontend RSS idle {_mib(report['rss_idle_kb'])}, peak "
                      f"{_mib(report.get('rss_peak_kb'))} (VmHWM {_mib(report.get('rss_hwm_kb'))})")
    for line in extras:
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if total_fail:
        print(f"[bench] {total_fail} request(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
