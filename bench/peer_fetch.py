#!/usr/bin/env python3
"""A prefix from a peer vs prefilling it (issue 33, item 3), on the real clock.

Two mocker workers in this process (``--speedup`` 1: the mocker's timing model in real
time), each behind a DisaggEngine front whose KV-transfer server serves prefixes, over
loopback TCP with a cluster secret. Each round, for each prefix length, worker A
computes a fresh prefix (prompt = prefix + 8 tokens); then worker B serves a prompt with
that prefix and its own 8-token tail, in alternating order:

* **prefill**: B computes the whole prompt (no hint);
* **peer**: B gets the router's hint and reads the prefix's blocks from A (the transfer
  charged at the mocker's ``--kv-bandwidth``, as the disaggregated transfers are), then
  computes the tail.

Printed per prefix length: B's TTFT median over rounds (request → first token) for both
arms, and the ratio. A fresh prefix per round and arm: B never holds it itself.

    python bench/peer_fetch.py --rounds 5 --prefix 512,1024,1920
    python bench/peer_fetch.py --kv-bytes-per-token 131072 --kv-bandwidth 12.5e9   # 8B-class KV, 100 Gb/s
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kvmesh.disagg.engine import DisaggEngine  # noqa: E402
from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector  # noqa: E402
from kvmesh.engines.mocker import MockerEngine, MockerOptions  # noqa: E402
from kvmesh.protocol import PeerPrefix, PreprocessedRequest, RoutingHints, StopConditions  # noqa: E402
from kvmesh.runtime.auth import ClusterSecret  # noqa: E402
from kvmesh.runtime.context import Context  # noqa: E402

BS = 16
SECRET = ClusterSecret(b"bench-peer-fetch-secret-32-bytes")


def front(worker_id: int, args: argparse.Namespace) -> DisaggEngine:
    opts = MockerOptions(
        worker_id=worker_id, speedup=args.speedup, block_size=BS, num_blocks=8192, kv_bandwidth=args.kv_bandwidth,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )  # fmt: skip
    inner = MockerEngine(opts)
    server = KvTransferServer(inner, serve_prefixes=True, secret=SECRET, tls=None)
    return DisaggEngine(inner, worker_id=worker_id, transfer=server, connector=TcpKvConnector(secret=SECRET, tls=None))


def prompt(seed: int, prefix: int, tail: int) -> list[int]:
    return [(i * 7 + seed * 131) % 1900 + 10 for i in range(prefix)] + [(seed + i) % 1900 + 10 for i in range(tail)]


async def ttft(engine: DisaggEngine, req: PreprocessedRequest) -> float:
    started = time.perf_counter()
    first = None
    async for chunk in engine.generate(req, Context(req.request_id)):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
    assert first is not None
    return first


async def one(a: DisaggEngine, b: DisaggEngine, seed: int, prefix: int, peer: bool) -> float:
    stop = StopConditions(max_tokens=2, ignore_eos=True)
    await ttft(a, PreprocessedRequest(f"a{seed}", "m", prompt(seed, prefix, 0) + [5] * 8, stop=stop))
    routing = None
    if peer:
        kv = a.kv_endpoint
        assert kv is not None
        routing = RoutingHints(peer=PeerPrefix(1, kv, prefix // BS))
    req = PreprocessedRequest(f"b{seed}", "m", prompt(seed, prefix, 8), stop=stop, routing=routing)
    return await ttft(b, req)


async def main(args: argparse.Namespace) -> None:
    a, b = front(1, args), front(2, args)
    await a.start()
    await b.start()
    seed = 0
    results: dict[tuple[int, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for prefix in args.prefix:
                order = ("prefill", "peer") if r % 2 == 0 else ("peer", "prefill")
                for arm in order:
                    seed += 1
                    results.setdefault((prefix, arm), []).append(await one(a, b, seed, prefix, arm == "peer"))
    finally:
        await b.cleanup()
        await a.cleanup()
    s = b.disagg_stats()
    print(f"{'prefix':>7}{'prefill TTFT':>14}{'peer TTFT':>11}{'ratio':>7}")
    for prefix in args.prefix:
        pre = statistics.median(results[(prefix, "prefill")]) * 1000
        peer = statistics.median(results[(prefix, "peer")]) * 1000
        print(f"{prefix:>7}{pre:>12.1f}ms{peer:>9.1f}ms{pre / peer:>6.2f}×")
    print(f"B: {s.peer_fetches} peer fetches, {s.peer_fetch_blocks} blocks, {s.peer_fetch_fallbacks} fallbacks, "
          f"{s.kv_bytes_received / 1e6:.0f} MB modelled at {args.kv_bandwidth / 1e9:g} GB/s")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix", type=lambda t: [int(x) for x in t.split(",")], default=[512, 1024, 1920])
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--kv-bandwidth", type=float, default=25e9, help="the KV link, bytes/s (the mocker's --kv-bandwidth)")
    p.add_argument("--kv-bytes-per-token", type=int, default=4096, help="the mocker's KV bytes per token")
    asyncio.run(main(p.parse_args()))
