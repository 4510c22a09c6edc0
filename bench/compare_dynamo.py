#!/usr/bin/env python3
"""A/B comparison of kvmesh against NVIDIA Dynamo 1.6.1 (frontend + mocker).

Both systems serve the same model folder (kvmesh's bundled ``kvmesh-tiny``) and
are driven by the same closed-loop load generator (``bench/_lib.py``). For each
router mode the runs alternate: kvmesh, Dynamo, kvmesh, Dynamo (``--rounds``).
Every run is a fresh launch, so launch-to-first-completion and idle RSS are
measured each time. The table shows, per metric, the better value over the rounds
(max for throughput, min for everything else) and the ratio kvmesh/Dynamo.

    python bench/compare_dynamo.py --json /tmp/cmp.json
    python bench/compare_dynamo.py --modes kv --levels 8 --rounds 1

Dynamo lives in its own virtualenv (default ``bench/.venv-dynamo``). With
``--install`` a missing venv is created (needs network; done before entering the
namespace). Dynamo's ZMQ publishers bind 0.0.0.0, so the whole benchmark re-executes
itself inside a private network namespace (``unshare --net``, loopback only); pass
``--no-netns`` to skip that (only if you know what you are doing).
kvmesh runs from a venv of its own too (``--kvmesh-python venv``, the default): one
over this interpreter that lists its packages as path lines, so neither system starts
by running the code in the system site-packages' ``.pth`` files (``system`` measures
kvmesh on this interpreter as it is).

Like-for-like settings: kvmesh runs with ``--canary-interval 0`` (Dynamo has no
canaries), one worker, ``--speedup 1e9``; the Dynamo mocker runs with
``--speedup-ratio 1000``. Requests are /v1/completions, 128 prompt token ids,
``max_tokens`` 64, ``ignore_eos``, streaming with usage. ``min_tokens`` is sent to
both only if Dynamo accepts it (probed at start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _lib import (
    HttpConnection,
    LaunchedServer,
    Workload,
    free_port,
    kvmesh_command,
    launch_server,
    measure_cpu,
    path_only_venv,
    precompile_kvmesh,
    read_mem,
    run_async,
    run_load,
    wait_ready,
)

NETNS_MARK = "KVMESH_CMP_IN_NETNS"
DEFAULT_VENV = HERE / ".venv-dynamo"
DYNAMO_VERSION = "1.6.1"
MODEL_NAME = "kvmesh-tiny"
DYNAMO_DEPS = ["aiohttp", "certifi", "kubernetes", "msgspec", "prometheus-client", "pyzmq",
               "redis", "tqdm", "transformers", "typing-extensions", "zstandard"]
# kvmesh mode name -> Dynamo frontend spelling (checked against `--help` at run time)
DYNAMO_MODES = {"round_robin": ["round-robin", "round_robin"], "kv": ["kv"],
                "random": ["random"]}


def log(*a) -> None:
    print("[cmp]", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Dynamo install / namespace
# ---------------------------------------------------------------------------

def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def dynamo_installed(venv: Path) -> bool:
    py = venv_python(venv)
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", "import dynamo.frontend, dynamo.mocker"],
                       capture_output=True, check=False)
    return r.returncode == 0


def install_dynamo(venv: Path) -> None:
    """ai-dynamo pins things pip cannot resolve; install its runtime and the
    mocker/frontend's real dependencies, then ai-dynamo itself without deps.
    Refuses to go on if torch got pulled in."""
    log(f"installing Dynamo {DYNAMO_VERSION} into {venv} ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run(pip + [f"ai-dynamo-runtime=={DYNAMO_VERSION}"] + DYNAMO_DEPS, check=True)
    subprocess.run(pip + ["--no-deps", f"ai-dynamo=={DYNAMO_VERSION}"], check=True)
    r = subprocess.run([str(venv_python(venv)), "-c", "import torch"], capture_output=True,
                       check=False)
    if r.returncode == 0:
        raise SystemExit(f"torch was installed into {venv}; it is not wanted (remove the venv)")


def reexec_in_netns(argv: list[str], script: str | None = None) -> int:
    """Run ``script`` (default: this file) again with ``argv`` in a new network namespace."""
    if shutil.which("unshare") is None:
        raise SystemExit("unshare not found; use --no-netns")
    env = dict(os.environ)
    env[NETNS_MARK] = "1"
    cmd = ["unshare", "--net", "--", sys.executable, script or str(Path(__file__).resolve())] + argv
    log("re-executing inside a private network namespace (loopback only)")
    p = subprocess.Popen(cmd, env=env)
    try:
        return p.wait()
    except KeyboardInterrupt:
        p.wait()
        return 130


def loopback_up() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


# ---------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------

class DynamoServer:
    """Mocker + frontend, each started in its own session; the frontend is metered."""

    def __init__(self, venv: Path, model_path: str, mode: str, speedup_ratio: float,
                 log_dir: str, mocker_extra: list[str] | None = None) -> None:
        self.venv = venv
        self.port = free_port()
        self.kv_dir = tempfile.mkdtemp(prefix="dyn-file-kv-", dir=log_dir)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update({
            "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": self.kv_dir,
            "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_HTTP_RPC_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_LOG": "warn", "HF_HUB_OFFLINE": "1",
        })
        py = str(venv_python(venv))
        fe_cmd = [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                  "--http-port", str(self.port), "--router-mode", mode]
        mk_cmd = [py, "-m", "dynamo.mocker", "--model-path", model_path,
                  "--model-name", MODEL_NAME, "--speedup-ratio", str(speedup_ratio)]
        mk_cmd += mocker_extra or []  # e.g. bench/trace_replay.py's fleet: --num-workers, --block-size ...
        self.frontend: LaunchedServer | None = None
        self.mocker: LaunchedServer | None = None
        self.mocker = launch_server(mk_cmd, self.port, os.path.join(log_dir, "dynamo-mocker.log"),
                                    env=env)
        self.frontend = launch_server(fe_cmd, self.port,
                                      os.path.join(log_dir, "dynamo-frontend.log"), env=env)
        self.t_launch = self.mocker.t_launch  # the earlier of the two

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.frontend.pid

    def alive_check(self) -> None:
        for name, s in (("mocker", self.mocker), ("frontend", self.frontend)):
            if s is not None and s.proc.poll() is not None:
                raise RuntimeError(f"Dynamo {name} exited with {s.proc.returncode}:\n"
                                   + s.log_tail(30))

    def worker_pids(self) -> list[int]:
        return [self.mocker.pid] if self.mocker else []

    def stop(self) -> None:
        for s in (self.frontend, self.mocker):
            if s is not None:
                try:
                    s.stop()
                except Exception as e:  # noqa: BLE001
                    log(f"stop failed for pid {s.pid}: {e!r}")
        shutil.rmtree(self.kv_dir, ignore_errors=True)

    def log_tail(self) -> str:
        return ("--- frontend ---\n" + (self.frontend.log_tail(30) if self.frontend else "")
                + "\n--- mocker ---\n" + (self.mocker.log_tail(30) if self.mocker else ""))


class KvmeshServer:
    def __init__(self, mode: str, log_dir: str, model_path: str, extra: list[str],
                 python: str | None = None) -> None:
        self.port = free_port()
        cmd = kvmesh_command(self.port, workers=1, speedup="1e9", router_mode=mode,
                             extra=["--canary-interval", "0", "--model-path", model_path] + extra,
                             python=python)
        self.server = launch_server(cmd, self.port, os.path.join(log_dir, "kvmesh.log"))
        self.t_launch = self.server.t_launch

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        return self.server.pid

    def alive_check(self) -> None:
        if self.server.proc.poll() is not None:
            raise RuntimeError(f"kvmesh exited with {self.server.proc.returncode}:\n"
                               + self.server.log_tail(30))

    def worker_pids(self) -> list[int]:
        from _lib import descendant_pids
        return descendant_pids(self.pid)

    def stop(self) -> None:
        self.server.stop()

    def log_tail(self) -> str:
        return self.server.log_tail(30)


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------

def probe_min_tokens(url: str, model: str) -> tuple[bool, str]:
    """Does the server accept (and succeed with) a request carrying min_tokens?"""
    from _lib import check_loopback

    async def go():
        host, port = check_loopback(url)
        wl = Workload(model, 8, 4, seed=4242, min_tokens=True)
        raw = wl.requests(1, host, port)[0]
        conn = await HttpConnection.connect(host, port)
        try:
            return await conn.request(raw, 30.0)
        finally:
            conn.close()

    r = run_async(go())
    return r.ok, (r.error or "ok")


def one_run(system: str, mode: str, a: argparse.Namespace, log_dir: str) -> dict:
    if system == "kvmesh":
        srv = KvmeshServer(mode, log_dir, a.model_path, a.kvmesh_extra, a.kvmesh_py)
        proc = srv.server.proc
    else:
        srv = DynamoServer(a.venv, a.model_path, a.dynamo_mode[mode], a.dynamo_speedup, log_dir)
        proc = srv.frontend.proc
    out: dict = {"system": system, "mode": mode}
    try:
        try:
            model, t_ok = wait_ready(srv.url, a.launch_timeout, model=MODEL_NAME, proc=proc,
                                     min_tokens=a.min_tokens)
        except Exception:
            log(f"{system} did not become ready; log tail:\n{srv.log_tail()}")
            raise
        srv.alive_check()
        out["launch_to_first_completion_s"] = t_ok - srv.t_launch
        time.sleep(0.5)
        out["rss_idle_kb"] = read_mem(srv.pid)["rss_kb"]
        wl = Workload(model, a.prompt_tokens, a.output_tokens, seed=a.seed,
                      min_tokens=a.min_tokens)
        levels = {}
        for c in a.levels:
            n = a.requests_small if c <= 8 else a.requests_large
            workers = srv.worker_pids()
            wcpu0 = measure_cpu(workers)
            r = run_load(srv.url, model, c, n, a.prompt_tokens, a.output_tokens,
                         warmup=max(2, c), max_seconds=a.max_seconds,
                         frontend_pid=srv.pid, include_descendants=False, workload=wl)
            wcpu = measure_cpu(workers) - wcpu0
            levels[str(c)] = r.to_dict()
            # the engine side (kvmesh's worker process, Dynamo's mocker), same share of
            # the 2 cores as the frontend: informational, not a goal
            levels[str(c)]["worker_cpu_ms_per_req"] = (wcpu / r.completed_total
                                                       if r.completed_total else None)
            log(f"  {system:6s} {mode:11s} c={c:<3d} {r.req_per_s:8.1f} req/s  "
                f"TTFT p50 {r.ttft_p50_ms or 0:7.2f} ms  fe CPU {r.frontend_cpu_ms_per_req or 0:6.3f}"
                f" ms/req  fail {r.failures}  {r.duration_s:.1f}s"
                + (f"  errors {r.errors}" if r.errors else ""))
        mem = read_mem(srv.pid)
        peaks = [lv.get("frontend_rss_peak_kb") or 0 for lv in levels.values()]
        out["rss_peak_kb"] = max(peaks + [mem["rss_kb"]])
        out["rss_hwm_kb"] = mem["hwm_kb"]
        out["worker_rss_kb"] = read_mem(srv.worker_pids())["rss_kb"]
        out["levels"] = levels
        return out
    finally:
        srv.stop()


# ---------------------------------------------------------------------------
# Aggregation and table
# ---------------------------------------------------------------------------

def metric_specs(levels: list[int]) -> list[tuple[str, str, object]]:
    """(label, 'higher'|'lower', getter(run) -> value)."""
    specs: list[tuple[str, str, object]] = []
    for c in levels:
        k = str(c)
        specs += [
            (f"c={c} req/s", "higher", lambda r, k=k: r["levels"][k]["req_per_s"]),
            (f"c={c} out tok/s", "higher", lambda r, k=k: r["levels"][k]["output_tok_per_s"]),
            (f"c={c} TTFT p50 ms", "lower", lambda r, k=k: r["levels"][k]["ttft_p50_ms"]),
            (f"c={c} TTFT p99 ms", "lower", lambda r, k=k: r["levels"][k]["ttft_p99_ms"]),
            (f"c={c} fe CPU ms/req", "lower",
             lambda r, k=k: r["levels"][k]["frontend_cpu_ms_per_req"]),
            (f"c={c} worker CPU ms/req", "lower",
             lambda r, k=k: r["levels"][k]["worker_cpu_ms_per_req"]),
        ]
    specs += [
        ("fe RSS idle MiB", "lower", lambda r: r["rss_idle_kb"] / 1024),
        ("fe RSS peak MiB", "lower", lambda r: r["rss_peak_kb"] / 1024),
        ("launch->1st completion s", "lower", lambda r: r["launch_to_first_completion_s"]),
    ]
    return specs


def best(vals: list[float], direction: str) -> float | None:
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return max(vals) if direction == "higher" else min(vals)


def build_table(runs: list[dict], modes: list[str], levels: list[int]) -> tuple[str, list[dict]]:
    rows: list[dict] = []
    for mode in modes:
        k_runs = [r for r in runs if r["mode"] == mode and r["system"] == "kvmesh" and "levels" in r]
        d_runs = [r for r in runs if r["mode"] == mode and r["system"] == "dynamo" and "levels" in r]
        for label, direction, get in metric_specs(levels):
            def vals(rs, get=get):
                out = []
                for r in rs:
                    try:
                        out.append(get(r))
                    except (KeyError, TypeError):
                        pass
                return out
            kv_all, dy_all = vals(k_runs), vals(d_runs)
            kb, db = best(kv_all, direction), best(dy_all, direction)
            ratio = (kb / db) if (kb is not None and db) else None
            rows.append({"mode": mode, "metric": label, "better": direction,
                         "kvmesh": kb, "dynamo": db, "ratio": ratio,
                         "kvmesh_rounds": kv_all, "dynamo_rounds": dy_all})
    w = [11, 26, 7, 11, 11, 9]
    head = (f"{'mode':<{w[0]}} {'metric':<{w[1]}} {'better':<{w[2]}} {'kvmesh':>{w[3]}} "
            f"{'Dynamo':>{w[4]}} {'kv/Dyn':>{w[5]}}")
    lines = [head, "-" * len(head)]
    prev = None
    for row in rows:
        if prev is not None and row["mode"] != prev:
            lines.append("")
        prev = row["mode"]

        def f(v):
            if v is None:
                return "-"
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"{row['mode']:<{w[0]}} {row['metric']:<{w[1]}} {row['better']:<{w[2]}} "
                     f"{f(row['kvmesh']):>{w[3]}} {f(row['dynamo']):>{w[4]}} {ratio:>{w[5]}}")
    return "\n".join(lines), rows


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/compare_dynamo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="Dynamo virtualenv")
    p.add_argument("--install", action="store_true",
                   help="create the Dynamo venv if it is missing (needs network)")
    p.add_argument("--no-netns", action="store_true", help="do not enter a private network namespace")
    p.add_argument("--modes", default="round_robin,kv", help="kvmesh router modes (round_robin,kv)")
    p.add_argument("--levels", default="1,8,64", help="concurrency levels (1,8,64)")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per mode (2)")
    p.add_argument("--requests-small", type=int, default=300, help="measured requests at c<=8 (300)")
    p.add_argument("--requests-large", type=int, default=1000, help="measured requests at c>8 (1000)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="time cap per level (30 s)")
    p.add_argument("--launch-timeout", type=float, default=120.0)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--min-tokens", choices=["auto", "on", "off"], default="auto",
                   help="send min_tokens (auto: only if Dynamo accepts it)")
    p.add_argument("--dynamo-speedup", type=float, default=1000.0, help="mocker --speedup-ratio")
    p.add_argument("--model-path", default=None, help="model folder (default: kvmesh bundled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even on success")
    p.add_argument("--json", metavar="OUT", help="write all runs and the table as JSON")
    p.add_argument("--kvmesh-python", choices=["venv", "system"], default="venv",
                   help="run kvmesh from a venv of its own, as Dynamo runs from its venv (default), or "
                        "from this interpreter, whose site-packages' .pth files then run at its start")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.levels = [int(x) for x in a.levels.split(",") if x.strip()]
    a.venv = a.venv.resolve()
    a.kvmesh_extra = []
    a.kvmesh_py = None
    return a


def resolve_dynamo_modes(a: argparse.Namespace) -> dict:
    r = subprocess.run([str(venv_python(a.venv)), "-m", "dynamo.frontend", "--help"],
                       capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "DYN_LOG": "error"})
    help_text = r.stdout + r.stderr
    out = {}
    for m in a.modes:
        cands = DYNAMO_MODES.get(m, [m])
        out[m] = next((c for c in cands if c in help_text), cands[0])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if not dynamo_installed(a.venv):
        if not a.install:
            log(f"Dynamo is not installed in {a.venv}; rerun with --install (needs network)")
            return 2
        install_dynamo(a.venv)
    if not a.no_netns and os.environ.get(NETNS_MARK) != "1":
        return reexec_in_netns(argv)
    if os.environ.get(NETNS_MARK) == "1":
        loopback_up()
    if a.model_path is None:
        from kvmesh.preprocess import bundled_model_path
        a.model_path = str(bundled_model_path())
    log(f"byte-compiled {precompile_kvmesh()} (pip did the same for Dynamo's venv)")
    a.dynamo_mode = resolve_dynamo_modes(a)
    log(f"Dynamo router modes: {a.dynamo_mode}")
    log_dir = tempfile.mkdtemp(prefix="kvmesh-cmp-dynamo-")
    if a.kvmesh_python == "venv":
        a.kvmesh_py = path_only_venv(os.path.join(log_dir, "venv-kvmesh"))
        log(f"kvmesh runs from its own venv {a.kvmesh_py} (this interpreter's packages as path lines)")
    t_start = time.perf_counter()
    runs: list[dict] = []
    ok = False
    try:
        # Preflight: warm page caches and probe min_tokens on Dynamo.
        if a.min_tokens == "auto":
            a.min_tokens = False
            pre = DynamoServer(a.venv, a.model_path, a.dynamo_mode[a.modes[0]],
                               a.dynamo_speedup, log_dir)
            try:
                try:
                    model, _ = wait_ready(pre.url, a.launch_timeout, model=MODEL_NAME,
                                          proc=pre.frontend.proc, min_tokens=False)
                except Exception:
                    log("Dynamo preflight failed; log tail:\n" + pre.log_tail())
                    raise
                accepted, why = probe_min_tokens(pre.url, model)
                a.min_tokens = accepted
                log(f"Dynamo min_tokens probe: {'accepted' if accepted else 'rejected: ' + why}")
            finally:
                pre.stop()
        else:
            a.min_tokens = a.min_tokens == "on"
        for mode in a.modes:
            for rnd in range(a.rounds):
                for system in ("kvmesh", "dynamo"):
                    log(f"round {rnd + 1}/{a.rounds} mode {mode}: {system}")
                    try:
                        r = one_run(system, mode, a, log_dir)
                    except Exception as e:  # noqa: BLE001
                        r = {"system": system, "mode": mode, "error": repr(e)}
                        log(f"  {system} run failed: {e!r}")
                    r["round"] = rnd + 1
                    runs.append(r)
        table, rows = build_table(runs, a.modes, a.levels)
        wall = time.perf_counter() - t_start
        print(f"kvmesh vs NVIDIA Dynamo {DYNAMO_VERSION} (frontend + mocker), "
              f"{a.prompt_tokens}-token prompts, {a.output_tokens} output tokens, ignore_eos, "
              f"min_tokens {'sent' if a.min_tokens else 'not sent'}")
        print(f"kvmesh: 1 worker, --speedup 1e9, --canary-interval 0 (canaries off: Dynamo "
              f"runs none), python: {a.kvmesh_python}; Dynamo: mocker --speedup-ratio {a.dynamo_speedup:g}, file discovery, "
              f"TCP request plane; router modes {a.dynamo_mode}")
        print(f"A/B alternated kvmesh, Dynamo x {a.rounds} rounds per mode; each cell is the "
              f"BEST of the rounds (max if higher is better, min if lower); "
              f"ratio = kvmesh / Dynamo")
        print()
        print(table)
        failures = sum(lv.get("failures", 0) for r in runs for lv in r.get("levels", {}).values())
        mism = sum(lv.get("token_mismatch", 0) for r in runs for lv in r.get("levels", {}).values())
        errs = [r for r in runs if "error" in r]
        print()
        print(f"failed requests: {failures}; responses with completion tokens != "
              f"{a.output_tokens}: {mism}; failed runs: {len(errs)}; wall {wall:.1f}s")
        for r in errs:
            print(f"  {r['system']} {r['mode']} round {r['round']}: {r['error']}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"config": {k: (str(v) if isinstance(v, Path) else v)
                                      for k, v in vars(a).items()},
                           "dynamo_version": DYNAMO_VERSION, "table": rows, "runs": runs,
                           "wall_s": wall}, f, indent=1, default=str)
        ok = not errs and failures == 0
        return 0 if ok else 1
    finally:
        if ok and not a.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            log(f"server logs kept in {log_dir}")


if __name__ == "__main__":
    sys.exit(main())
