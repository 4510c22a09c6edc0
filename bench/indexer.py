"""KV indexer benchmark: a fleet-sized index, its memory, lookups, event apply and
router decisions, with a brute-force baseline measured in the same run.

    python bench/indexer.py                                # 1,000 workers, 10M blocks
    python bench/indexer.py --blocks 1000000 --workers 100 --json out.json

Workload (seeded): ``--families`` shared prefixes ("system prompts", 8..128 blocks,
Zipf-popular) and, per worker, conversations = one family's prefix + a private tail
of 32..512 blocks, until the worker holds ``blocks / workers`` private blocks. Each
chain is announced the way an engine does it: ``BlockStored`` events of 1..64 blocks
with chained sequence hashes and parent hashes (event 0 of each worker is
``AllBlocksCleared``, as at an engine start). ``--blocks`` counts distinct blocks.

Measured:

* **build**: time to apply every event, and the RSS the index adds per block;
* **find_matches**: queries of 64..512 blocks, each a sampled conversation (family
  prefix held by many workers + one worker's tail) extended with fresh blocks;
  queries/s and latency, against the brute-force baseline on the same queries (each
  worker walks the query from the first block, one membership test per block: what
  a design with one hash set per worker does);
* **apply**: a churn of new chains stored then removed (tail first): events/s and
  blocks/s, bare ``KvIndexer.apply`` and through ``KvRouterCore.apply_event``
  (event-id sequencing included);
* **decision**: ``KvRouterCore.route`` p50/p99 with every worker a candidate (when
  the core is not implemented, or with ``--indexer-only``: ``find_matches`` plus a
  minimal cost loop over the workers, labelled so).

Each timed phase stops after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import percentile  # noqa: E402
from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventData  # noqa: E402
from kvmesh.kv.hashing import chain_hashes  # noqa: E402
from kvmesh.router.indexer import KvIndexer  # noqa: E402

BLOCK_SIZE = 16
QUERY_SIZES = (64, 128, 256, 512)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------- workload


@dataclass
class Workload:
    rng: random.Random
    workers: int
    families: list[list[int]]
    cum_weights: list[float]
    per_worker: int
    samples: list[tuple[int, list[int]]] = field(default_factory=list)

    def fresh_chain(self, n: int, parent: int | None) -> list[int]:
        bits = self.rng.getrandbits
        return chain_hashes([bits(64) for _ in range(n)], parent)

    def chunks(self, hashes: list[int], parent: int | None) -> Iterator[BlockStored]:
        """``hashes`` as engine-like stores of 1..64 blocks."""
        i = 0
        while i < len(hashes):
            j = min(len(hashes), i + self.rng.randint(1, 64))
            yield BlockStored(block_hashes=hashes[i:j], parent_hash=parent if i == 0 else hashes[i - 1])
            i = j

    def pick_family(self) -> list[int]:
        return self.rng.choices(self.families, cum_weights=self.cum_weights)[0]


def make_workload(blocks: int, workers: int, n_families: int, seed: int) -> Workload:
    rng = random.Random(seed)
    lengths = [rng.randint(8, 128) for _ in range(n_families)]
    while sum(lengths) > blocks // 10 and len(lengths) > 1:  # small runs: keep prefixes a minority
        lengths.pop()
    cum = list(itertools.accumulate(1 / (i + 1) for i in range(len(lengths))))
    wl = Workload(rng, workers, [], cum, max(1, (blocks - sum(lengths)) // workers))
    wl.families = [wl.fresh_chain(n, None) for n in lengths]
    return wl


def build_events(wl: Workload, sample_every: int) -> Iterator[tuple[int, KvEventData]]:
    """Every worker's events; keeps one conversation in ``sample_every`` as a query seed."""
    k = 0
    for w in range(wl.workers):
        yield w, AllBlocksCleared()
        held: set[int] = set()
        left = wl.per_worker
        while left > 0:
            fam = wl.pick_family()
            if fam[0] not in held:
                held.add(fam[0])
                yield from ((w, e) for e in wl.chunks(fam, None))
            n = min(left, wl.rng.randint(32, 512))
            tail = wl.fresh_chain(n, fam[-1])
            left -= n
            yield from ((w, e) for e in wl.chunks(tail, fam[-1]))
            k += 1
            if k % sample_every == 0:
                wl.samples.append((w, fam + tail))


def make_queries(wl: Workload, size: int, count: int) -> list[list[int]]:
    out = []
    for _ in range(count):
        _w, conv = wl.rng.choice(wl.samples)
        q = conv[:size]
        if len(q) < size:
            q = q + wl.fresh_chain(size - len(q), q[-1])
        out.append(q)
    return out


# ---------------------------------------------------------------------------- phases


class Target:
    """The system under test: a KvRouterCore when implemented, else a bare KvIndexer."""

    def __init__(self, workers: int, use_core: bool = True) -> None:
        self.core = None
        self.indexer = KvIndexer()
        try:
            if not use_core:
                raise NotImplementedError
            from kvmesh.router.core import KvRouterCore, RouterSettings

            core = KvRouterCore(RouterSettings(block_size=BLOCK_SIZE, seed=0))
            for w in range(workers):
                core.add_worker(w)
            self.core = core
            self.indexer: KvIndexer = core.indexer
        except NotImplementedError:
            pass
        self.next_id = [0] * workers

    def apply(self, w: int, data: KvEventData) -> None:
        if self.core is not None:
            eid = self.next_id[w]
            self.next_id[w] = eid + 1
            if self.core.apply_event(KvEvent(worker_id=w, event_id=eid, data=data)) != "apply":
                raise RuntimeError("event not applied")
        else:
            self.indexer.apply(w, data)


def phase_build(target: Target, wl: Workload, sample_every: int) -> dict:
    gc.collect()
    rss0 = rss_mb()
    apply = target.apply
    spent = 0.0
    events = blocks = 0
    clock = time.perf_counter
    for w, data in build_events(wl, sample_every):
        t = clock()
        apply(w, data)
        spent += clock() - t
        events += 1
        if isinstance(data, BlockStored):
            blocks += len(data.block_hashes)
    gc.collect()
    ix = target.indexer
    added_mb = rss_mb() - rss0
    entries = sum(ix.worker_block_count(w) for w in range(wl.workers))
    return {
        "events": events,
        "stored_blocks": blocks,
        "distinct_blocks": ix.num_blocks,
        "worker_block_entries": entries,
        "apply_s": spent,
        "rss_added_mb": added_mb,
        "bytes_per_block": added_mb * 2**20 / max(1, ix.num_blocks),
        "bytes_per_entry": added_mb * 2**20 / max(1, entries),
        "via": "KvRouterCore.apply_event" if target.core is not None else "KvIndexer.apply",
    }


def naive_matches(nodes: dict[int, int], bits: Sequence[int], ids: Sequence[int | None], query: Sequence[int]) -> dict[int, int]:
    """The baseline: every worker walks the query from the first block, one membership
    test per block (what a design with one hash set per worker does)."""
    out = {}
    get = nodes.get
    for bit, w in zip(bits, ids):
        if w is None:
            continue
        n = 0
        for h in query:
            if not get(h, 0) & bit:
                break
            n += 1
        if n:
            out[w] = n
    return out


def timed(fn, items: Sequence, max_s: float, keep: int = 0, reduce=None) -> tuple[list[float], list, list]:
    """Per-call latency (µs) of ``fn(item)``, stopping after ``max_s``; the first ``keep``
    results, and ``reduce(result)`` of every call (results are not all kept: a pile of
    live result dicts would make the garbage collector, not the code, the measurement)."""
    lat, kept, reduced = [], [], []
    clock = time.perf_counter
    end = clock() + max_s
    for n, item in enumerate(items):
        t = clock()
        r = fn(item)
        t2 = clock()
        lat.append((t2 - t) * 1e6)
        if n < keep:
            kept.append(r)
        if reduce is not None:
            reduced.append(reduce(r))
        if t2 > end:
            break
    return lat, kept, reduced


def summary(lat: list[float]) -> dict:
    total = sum(lat) / 1e6
    return {
        "n": len(lat),
        "per_s": len(lat) / total if total else float("nan"),
        "p50_us": percentile(lat, 50),
        "p99_us": percentile(lat, 99),
    }


def phase_find(target: Target, queries: dict[int, list[list[int]]], naive_queries: int, max_s: float) -> list[dict]:
    ix = target.indexer
    rows = []
    for size, qs in queries.items():
        lat, res, stats = timed(
            ix.find_matches, qs, max_s, keep=naive_queries, reduce=lambda r: (len(r), max(r.values(), default=0))
        )
        row = {"size": size, **summary(lat)}
        row["matched_workers"] = sum(m for m, _ in stats) / len(stats)
        row["best_overlap"] = sum(b for _, b in stats) / len(stats)
        # the baseline walks the indexer's own table once per worker (same data, no mask intersection)
        nodes, bits, ids = ix._nodes, ix._bits, ix._ids  # noqa: SLF001 - the bench compares algorithms
        nlat, nres, _ = timed(lambda q: naive_matches(nodes, bits, ids, q), qs[: len(res)], max_s, keep=len(res))
        if nres != res[: len(nres)]:
            raise RuntimeError("find_matches disagrees with the brute-force baseline")
        row["naive"] = summary(nlat)
        rows.append(row)
    return rows


def churn_events(wl: Workload, n_chains: int) -> list[tuple[int, KvEventData]]:
    """New chains stored, each removed (tail first, in evictions of 1..64) 8 chains later."""
    events: list[tuple[int, KvEventData]] = []
    pending: list[tuple[int, list[int]]] = []
    for _ in range(n_chains):
        w = wl.rng.randrange(wl.workers)
        fam = wl.pick_family()
        tail = wl.fresh_chain(wl.rng.randint(32, 512), fam[-1])
        events.extend((w, e) for e in wl.chunks(tail, fam[-1]))
        pending.append((w, tail))
        if len(pending) > 8:
            ow, old = pending.pop(0)
            events.extend((ow, e) for e in evictions(wl, old))
    for ow, old in pending:
        events.extend((ow, e) for e in evictions(wl, old))
    return events


def evictions(wl: Workload, chain: list[int]) -> Iterator[BlockRemoved]:
    rest = chain[::-1]
    while rest:
        n = wl.rng.randint(1, 64)
        yield BlockRemoved(block_hashes=rest[:n])
        rest = rest[n:]


def phase_apply(target: Target, wl: Workload, n_chains: int, max_s: float) -> list[dict]:
    rows = []
    for via in ("KvIndexer.apply", "KvRouterCore.apply_event"):
        if via.startswith("KvRouterCore") and target.core is None:
            continue
        events = churn_events(wl, n_chains)
        apply = target.indexer.apply if via == "KvIndexer.apply" else target.apply
        per_kind: dict[str, list[float]] = {"stored": [0, 0, 0.0], "removed": [0, 0, 0.0]}
        clock = time.perf_counter
        end = clock() + max_s
        before = target.indexer.num_blocks
        for w, data in events:
            t = clock()
            apply(w, data)
            t2 = clock()
            acc = per_kind["stored" if isinstance(data, BlockStored) else "removed"]
            acc[0] += 1
            acc[1] += len(data.block_hashes)
            acc[2] += t2 - t
            if t2 > end:
                break
        for kind, (n, blocks, spent) in per_kind.items():
            rows.append(
                {"via": via, "kind": kind, "events": n, "events_per_s": n / spent, "blocks_per_s": blocks / spent}
            )
        if target.indexer.num_blocks != before and clock() <= end:
            raise RuntimeError("churn did not return the index to its size")
    return rows


def phase_decision(target: Target, workers: int, queries: dict[int, list[list[int]]], max_s: float) -> list[dict]:
    rows = []
    core = target.core
    for size, qs in queries.items():
        tokens = [0] * (size * BLOCK_SIZE)
        if core is not None:
            counter = itertools.count()

            def decide(q: list[int]) -> int:
                rid = f"r{next(counter)}"
                d = core.route(rid, tokens, now=0.0, block_hashes=q)
                core.finished(rid, now=0.0)
                return d.worker_id

            label = "KvRouterCore.route"
        else:
            def decide(q: list[int]) -> int:  # find_matches + the cost loop of a minimal router
                m = target.indexer.find_matches(q)
                return min(range(workers), key=lambda w: size - m.get(w, 0))

            label = "find_matches + cost loop"
        lat, _, _ = timed(decide, qs, max_s)
        rows.append({"size": size, "how": label, **summary(lat)})
    return rows


# ---------------------------------------------------------------------------- report


def fmt(x: float, nd: int = 1) -> str:
    return f"{x:,.{nd}f}"


def report(cfg: dict, build: dict, finds: list[dict], applies: list[dict], decisions: list[dict]) -> None:
    print(
        f"\nindex: {cfg['workers']:,} workers, {build['distinct_blocks']:,} distinct blocks, "
        f"{build['worker_block_entries']:,} (worker, block) entries, {build['events']:,} build events"
    )
    print(
        f"build: {fmt(build['apply_s'], 2)} s applying via {build['via']} "
        f"({fmt(build['stored_blocks'] / build['apply_s'], 0)} blocks/s); "
        f"RSS +{fmt(build['rss_added_mb'], 0)} MiB = {fmt(build['bytes_per_block'])} B/block, "
        f"{fmt(build['bytes_per_entry'])} B/entry"
    )
    print("\nfind_matches (×naive: speed-up over walking the query once per worker)")
    print(f"{'blocks':>7} {'queries/s':>11} {'p50 µs':>9} {'p99 µs':>9} {'matched':>8} {'best':>6} "
          f"{'naive q/s':>10} {'×naive':>7}")
    for r in finds:
        n = r["naive"]
        print(
            f"{r['size']:>7} {fmt(r['per_s'], 0):>11} {fmt(r['p50_us']):>9} {fmt(r['p99_us']):>9} "
            f"{fmt(r['matched_workers'], 0):>8} {fmt(r['best_overlap'], 0):>6} {fmt(n['per_s'], 1):>10} "
            f"{fmt(r['per_s'] / n['per_s'], 0):>7}"
        )
    print("\nevent apply (churn: new chains stored, then removed tail first)")
    print(f"{'via':>26} {'kind':>8} {'events':>8} {'events/s':>10} {'blocks/s':>11}")
    for r in applies:
        print(
            f"{r['via']:>26} {r['kind']:>8} {r['events']:>8,} {fmt(r['events_per_s'], 0):>10} "
            f"{fmt(r['blocks_per_s'], 0):>11}"
        )
    print(f"\nrouting decision over {cfg['workers']:,} candidates (goal: p99 < 1,000 µs)")
    print(f"{'blocks':>7} {'how':>26} {'decisions/s':>12} {'p50 µs':>9} {'p99 µs':>9} {'find p50 share':>15}")
    for r, f in zip(decisions, finds):
        print(
            f"{r['size']:>7} {r['how']:>26} {fmt(r['per_s'], 0):>12} {fmt(r['p50_us']):>9} {fmt(r['p99_us']):>9} "
            f"{fmt(100 * f['p50_us'] / r['p50_us'], 0):>14}%"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=10_000_000, help="distinct blocks to index")
    p.add_argument("--families", type=int, default=256, help="shared prefixes")
    p.add_argument("--queries", type=int, default=2000, help="queries per size")
    p.add_argument("--naive-queries", type=int, default=50, help="baseline queries per size")
    p.add_argument("--churn-chains", type=int, default=2000, help="chains stored+removed per apply run")
    p.add_argument("--max-seconds", type=float, default=20.0, help="cap per timed phase")
    p.add_argument("--indexer-only", action="store_true", help="bare KvIndexer, even if KvRouterCore works")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write config and figures here")
    args = p.parse_args(argv)
    if args.workers <= 0 or args.blocks < args.workers:
        p.error("need --workers > 0 and --blocks >= --workers")

    cfg = {k: v for k, v in vars(args).items() if k != "json"}
    t0 = time.perf_counter()
    wl = make_workload(args.blocks, args.workers, args.families, args.seed)
    target = Target(args.workers, use_core=not args.indexer_only)
    print(f"building: {args.blocks:,} blocks over {args.workers:,} workers ...", file=sys.stderr)
    sample_every = max(1, args.blocks // 270 // 4000)  # ~4,000 query seeds
    build = phase_build(target, wl, sample_every)
    print("find_matches ...", file=sys.stderr)
    queries = {size: make_queries(wl, size, args.queries) for size in QUERY_SIZES}
    finds = phase_find(target, queries, args.naive_queries, args.max_seconds)
    print("apply ...", file=sys.stderr)
    applies = phase_apply(target, wl, args.churn_chains, args.max_seconds)
    print("decisions ...", file=sys.stderr)
    decisions = phase_decision(target, args.workers, queries, args.max_seconds)
    report(cfg, build, finds, applies, decisions)
    total = time.perf_counter() - t0
    print(f"\ntotal {fmt(total, 0)} s, peak RSS {fmt(rss_peak_mb(), 0)} MiB", file=sys.stderr)
    if args.json:
        out = {"config": cfg, "build": build, "find_matches": finds, "apply": applies, "decision": decisions}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def rss_peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    sys.exit(main())
