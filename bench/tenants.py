"""Fair queuing across tenants (issue 30, item 4): does a tenant sending ten times its
share slow down a light tenant?

    PYTHONPATH=src python bench/tenants.py                  # 2 rounds, 20 s per phase
    PYTHONPATH=src python bench/tenants.py --rounds 3 --duration 30

One `kvmesh run` (mocker workers at a quarter of real speed, KV router with admission
on: past the threshold requests wait in the router's weighted fair queue), a real keys
file (tenants A and B, weight 1 each), real HTTP (httpx, streamed completions). Each
round runs two phases, alternated so that the shared machine's noise hits both:

* alone:  tenant B at ``--b-rate`` requests/s;
* beside A: B at the same rate, and tenant A at ``--ratio`` × B's rate, which with B is
  past the fleet's capacity (the fleet saturates and A's requests pile up);
* beside A FCFS: the same, B's requests sent with a key of A's tenant: one tenant, so
  the queue serves them in arrival order (what the queue did before fair queuing).

Printed: per phase and round, B's TTFT p50/p99, B's requests lost (any answer but 200), A's
answers by status (200 served, 429 limited, anything else an error), and the goal's
ratio B p99 beside / B p99 alone, fair and FCFS (goal ≤ 1.5; B loses none; A gets no
error).
Open loop: arrivals are Poisson and do not wait for answers.

    PYTHONPATH=src python bench/tenants.py --hit-rate ../shared/traces/mooncake_conversation_trace.jsonl

What ``--cache-isolation tenant`` costs in prefix-cache hit rate: the trace's
conversations dealt to ``--tenants`` tenants (a conversation is its first block after the
shared one, ``hash_ids[1]``), replayed (``kvmesh replay --policy kv``, virtual clock)
twice: as is (tenants share blocks), and with every block id made the tenant's own
(``id × tenants + tenant``: what salting the hashes does), so a prefix common to
several tenants (the system prompt, block 0) is cached once per tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _lib import percentile  # noqa: E402

from tests.helpers import kvmesh_run  # noqa: E402

MODEL = "kvmesh-tiny"
# sk-bench-b-in-a: B's traffic under A's tenant, the FCFS baseline (one tenant: arrival order)
KEYS = "sk-bench-a tenant=A weight=1\nsk-bench-b tenant=B weight=1\nsk-bench-b-in-a tenant=A\n"
PHASES = (("B alone", False, "sk-bench-b"), ("beside A", True, "sk-bench-b"), ("beside A FCFS", True, "sk-bench-b-in-a"))


@dataclass
class Result:
    tenant: str
    status: int
    ttft_s: float | None


async def _one(client: httpx.AsyncClient, tenant: str, key: str, rng: random.Random, args: argparse.Namespace,
               out: list[Result]) -> None:  # fmt: skip
    body = {"model": MODEL, "prompt": [rng.randrange(100, 2000) for _ in range(args.prompt_tokens)],
            "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}  # fmt: skip
    sent = time.monotonic()
    ttft = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
            async for line in r.aiter_lines():
                if ttft is None and line.startswith('data: {"id"') and '"text":""' not in line:
                    ttft = time.monotonic() - sent
        out.append(Result(tenant, r.status_code, ttft))
    except httpx.HTTPError:
        out.append(Result(tenant, 0, None))


async def _tenant_load(client: httpx.AsyncClient, tenant: str, key: str, rate: float, args: argparse.Namespace,
                       seed: int, out: list[Result]) -> None:  # fmt: skip
    rng = random.Random(seed)
    tasks = []
    end = time.monotonic() + args.duration
    while (now := time.monotonic()) < end:
        tasks.append(asyncio.ensure_future(_one(client, tenant, key, rng, args, out)))
        await asyncio.sleep(min(rng.expovariate(rate), max(0.0, end - now)))
    await asyncio.gather(*tasks)


async def _phase(url: str, args: argparse.Namespace, beside: bool, b_key: str, seed: int) -> list[Result]:
    out: list[Result] = []
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    async with httpx.AsyncClient(base_url=url, timeout=args.duration * 10, limits=limits) as client:
        loads = [_tenant_load(client, "B", b_key, args.b_rate, args, seed, out)]
        if beside:
            loads.append(_tenant_load(client, "A", "sk-bench-a", args.b_rate * args.ratio, args, seed + 1, out))
        await asyncio.gather(*loads)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _row(name: str, results: list[Result]) -> tuple[str, float | None]:
    b = [r for r in results if r.tenant == "B"]
    a = Counter(r.status for r in results if r.tenant == "A")
    ttft = [r.ttft_s for r in b if r.status == 200 and r.ttft_s is not None]
    p99 = percentile(ttft, 99)
    a_text = " ".join(f"{k}:{v}" for k, v in sorted(a.items())) or "-"
    lost = sum(1 for r in b if r.status != 200 or r.ttft_s is None)
    line = f"{name:<14} {len(b):>5} {lost:>6} {_ms(percentile(ttft, 50)):>8} {_ms(p99):>8}   {a_text}"
    return line, p99


def _conversation(row: dict) -> int:
    ids = row["hash_ids"]
    return ids[1] if len(ids) > 1 else ids[0]


def _replay_hit_rate(trace: Path, args: argparse.Namespace, out: Path) -> float:
    cmd = [sys.executable, "-m", "kvmesh.cli.main", "replay", str(trace), "--policy", "kv", "--no-progress",
           "--workers", str(args.workers), "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads(out.read_text())[0]["cache_hit_rate"])


def hit_rate(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in open(args.hit_rate)][: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        shared, isolated = Path(tmp) / "shared.jsonl", Path(tmp) / "isolated.jsonl"
        shared.write_text("".join(json.dumps(r) + "\n" for r in rows))
        n = args.tenants
        salted = [{**r, "hash_ids": [h * n + _conversation(r) % n for h in r["hash_ids"]]} for r in rows]
        isolated.write_text("".join(json.dumps(r) + "\n" for r in salted))
        print(f"{len(rows)} requests of {args.hit_rate}, {n} tenants, {args.workers} mocker workers, kv router "
              f"(virtual clock)")
        print(f"{'cache isolation':<16} {'hit rate':>9}")
        rate = {}
        for name, trace in (("none", shared), ("tenant", isolated)):
            rate[name] = _replay_hit_rate(trace, args, Path(tmp) / f"{name}.json")
            print(f"{name:<16} {rate[name] * 100:>8.1f}%", flush=True)
        print(f"isolation costs {100 * (rate['none'] - rate['tenant']):.1f} points of hit rate "
              f"({rate['tenant'] / rate['none']:.2f}x of the shared cache's hits)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--b-rate", type=float, default=2.0, help="tenant B's requests per second")
    p.add_argument("--ratio", type=float, default=10.0, help="tenant A's rate over B's")
    p.add_argument("--workers", type=int, default=None, help="mocker workers (default 2; --hit-rate: 4, replay's)")
    p.add_argument("--speedup", type=float, default=0.25, help="mocker speed (1: a real GPU's timing)")
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.01, help="--admission-threshold")
    p.add_argument("--extra", default="", help="more kvmesh run flags")
    p.add_argument("--hit-rate", metavar="TRACE", help="measure cache isolation's hit-rate cost on this trace instead")
    p.add_argument("--tenants", type=int, default=8, help="--hit-rate: tenants the conversations are dealt to")
    p.add_argument("--limit", type=int, default=2000, help="--hit-rate: the trace's first N requests")
    args = p.parse_args()
    if args.hit_rate:
        args.workers = args.workers or 4
        hit_rate(args)
        return
    args.workers = args.workers or 2
    flags = ["--router-mode", "kv", "--admission-threshold", str(args.threshold), "--max-num-seqs", str(args.max_num_seqs),
             "--canary-interval", "0", *args.extra.split()]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(KEYS)
        os.environ.setdefault("KVMESH_ADMIN_KEY", "sk-bench-admin")
        with kvmesh_run(Path(tmp), "--api-keys-file", str(keys), *flags, workers=args.workers, speedup=str(args.speedup)) as s:
            print(f"kvmesh run: {args.workers} mocker workers at speedup {args.speedup}, max_num_seqs {args.max_num_seqs}, "
                  f"admission threshold {args.threshold}; prompts {args.prompt_tokens} tokens, {args.max_tokens} generated; "
                  f"B {args.b_rate}/s, A {args.b_rate * args.ratio}/s; {args.duration:.0f} s per phase (shared machine)")
            print(f"{'phase':<14} {'B req':>5} {'B lost':>6} {'B p50ms':>8} {'B p99ms':>8}   A answers by status")
            pooled: dict[str, list[Result]] = {name: [] for name, _, _ in PHASES}
            for r in range(args.rounds):
                for i, (name, beside, b_key) in enumerate(PHASES):
                    got = asyncio.run(_phase(s.url, args, beside, b_key, seed=100 * r + i))
                    pooled[name].extend(got)
                    print(_row(f"{name} #{r + 1}", got)[0], flush=True)
            p99 = {}
            for name, results in pooled.items():
                line, p99[name] = _row(f"{name} (all)", results)
                print(line)
            everything = [x for results in pooled.values() for x in results]
            a_errors = sum(1 for x in everything if x.tenant == "A" and x.status not in (200, 429))
            b_lost = sum(1 for x in everything if x.tenant == "B" and (x.status != 200 or x.ttft_s is None))
            alone = p99["B alone"]
            if alone:
                fair, fcfs = p99["beside A"], p99["beside A FCFS"]
                print(f"B TTFT p99 beside A / alone: fair {fair / alone:.2f} (goal <= 1.5), FCFS {fcfs / alone:.2f}; "
                      f"B lost {b_lost}; A errors {a_errors}")


if __name__ == "__main__":
    main()
