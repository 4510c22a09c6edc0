"""The batching core's step, pinned: fixed random workloads (arrivals, shared prefixes,
LoRA adapters, priorities, EOS / stop ids / min_tokens, preemption in a small pool,
chunked long prefills, KV tiers, reservations, remote prefills, aborts between a pass's
schedule and its completion) run through the mocker's scheduler, and everything they
produce (each step's tokens, finishes, preemptions and timing inputs, every KV event in
order, the load reports) hashes to what commit 3c7d6f7 produced, recorded as expected
data before the step's fast paths (issue 36) went in. A change of any scheduling
decision or KV event, its content or its order, changes the digest."""

from __future__ import annotations

import hashlib
import random

import msgspec
import pytest

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.scheduler import Scheduler
from kvmesh.protocol import PreprocessedRequest, RoutingHints, SamplingOptions, StopConditions
from kvmesh.runtime.events import RecordingPublisher

_PREFIXES = [[1000 + 37 * p + i for i in range(40)] for p in range(4)]


class _Workload:
    def __init__(self, options: MockerOptions, seed: int) -> None:
        self.pub = RecordingPublisher()
        self.sched = Scheduler(options, self.pub)
        self.rng = random.Random(seed)
        self.digest = hashlib.sha256()
        self.n = 0
        self.counts = {"preempted": 0, "finished": 0, "stop": 0, "length": 0, "tokens": 0, "aborted": 0}

    def request(self, long: bool = False) -> PreprocessedRequest:
        rng = self.rng
        self.n += 1
        tail = [rng.randrange(2000) for _ in range(rng.randrange(150, 300) if long else rng.randrange(1, 40))]
        prompt = (rng.choice(_PREFIXES) if rng.random() < 0.7 else []) + tail
        return PreprocessedRequest(
            request_id=f"r{self.n}",
            model="mock",
            token_ids=prompt or [7],
            sampling=SamplingOptions(seed=self.n),
            stop=StopConditions(
                max_tokens=rng.randrange(1, 48),
                min_tokens=rng.choice((0, 0, 3)),
                ignore_eos=rng.random() < 0.3,
                stop_token_ids=[rng.randrange(2048) for _ in range(rng.choice((0, 0, 40)))],
            ),
            eos_token_ids=[rng.randrange(2048)] if rng.random() < 0.2 else [],
            routing=RoutingHints(priority=rng.choice((None, None, "premium", "best_effort"))),
            adapter=rng.choice((None, None, "a1")),
        )

    def record(self, *items: object) -> None:
        self.digest.update(msgspec.json.encode(items))

    def step(self, abort_in_pass: bool) -> None:
        sched, rng = self.sched, self.rng
        if not abort_in_pass:
            out = sched.step()
            tokens, finished, preempted = out.tokens, out.finished, out.preempted
            self.record("step", list(tokens.items()), out.prefill_tokens, out.decode_seqs, out.duration_ms)
        else:  # abort a sequence between the pass's schedule and its completion (blocks freed after it)
            plan = sched.schedule()
            victims = [s.id for s, _ in plan.entries]
            if victims:
                sched.abort(rng.choice(victims))
                self.counts["aborted"] += 1
            drawn = sched._draw_all(plan.samples)
            done, emitted = sched.complete(plan, drawn)
            tokens = {sid: drawn[sid] for sid in emitted}
            finished, preempted = plan.failed + done, plan.preempted
            self.record("pass", [(s.id, n) for s, n in plan.entries], list(tokens.items()), plan.kv_usage)
        self.record([(f.seq_id, f.request_id, f.reason, f.usage, f.error) for f in finished], preempted)
        self.counts["preempted"] += len(preempted)
        self.counts["finished"] += len(finished)
        self.counts["tokens"] += len(tokens)
        for f in finished:
            if f.reason in ("stop", "length"):
                self.counts[f.reason] += 1

    def run(self, steps: int) -> tuple[str, dict[str, int]]:
        sched, rng = self.sched, self.rng
        held: list[int] = []
        for i in range(steps):
            for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
                sched.submit(self.request(long=rng.random() < 0.1))
            roll = rng.random()
            if roll < 0.04:  # a reservation, queued at once or later
                req = self.request()
                seq = sched.reserve_request(req)
                self.record("reserve", seq.id if seq is not None else None)
                if seq is not None and rng.random() < 0.7:
                    sched.submit(req)
            elif roll < 0.07:  # a remote prefill, held when done, released later
                req = self.request()
                upto = len(req.token_ids)
                seq = sched.submit_prefill(req, rng.randrange(0, upto) // 16 * 16, upto)
                if seq is not None:
                    held.append(seq.id)
            elif roll < 0.09 and held:
                sched.release_held(held.pop(0))
            elif roll < 0.11 and self.n:  # an abort between steps (maybe unknown or ended)
                sched.abort(rng.randrange(self.n + 2))
            self.step(abort_in_pass=rng.random() < 0.08)
            if i % 25 == 0:
                report = sched.load_report()
                self.record("load", report)
        self.record("events", [msgspec.json.encode(e).decode() for e in self.pub.kv_events])
        self.record("dump", sorted(sched.kv_dump()), {t: sorted(h) for t, h in sched.blocks.dump_tiers().items()})
        self.counts["events"] = len(self.pub.kv_events)
        return self.digest.hexdigest(), self.counts


_BASE = dict(eos_rate=0.05, num_blocks=96, max_num_seqs=16, max_num_batched_tokens=256)
CASES = {
    "small pool": MockerOptions(**_BASE),  # type: ignore[arg-type]
    "chunked long prefills": MockerOptions(
        **_BASE, long_prefill_token_threshold=64, max_num_partial_prefills=3  # type: ignore[arg-type]
    ),
    "tiers": MockerOptions(**_BASE, host_kv_blocks=48, disk_kv_blocks=64),  # type: ignore[arg-type]
    "no prefix caching": MockerOptions(**_BASE, enable_prefix_caching=False),  # type: ignore[arg-type]
    "roomy pool": MockerOptions(eos_rate=0.02, num_blocks=4096, max_num_seqs=64),
}

# recorded from commit 3c7d6f7 (before issue 36's batching fast paths), 600 steps each;
# a change meant to alter decisions or events re-records them: python tests/unit/mocker/test_step_trace.py
EXPECTED: dict[str, tuple[str, dict[str, int]]] = {
    "chunked long prefills": (
        "bb89fe648b34f80299e7f5456fa3ee2fe408924de7fa9a62b988817a1a594c43",
        {"preempted": 105, "finished": 462, "stop": 240, "length": 222, "tokens": 7352, "aborted": 47, "events": 1935},
    ),
    "no prefix caching": (
        "dce163695e8932b4bd01e5cf41374c4448c05e00a45f16883d86c16fa05ffc49",
        {"preempted": 43, "finished": 315, "stop": 163, "length": 152, "tokens": 4923, "aborted": 46, "events": 0},
    ),
    "roomy pool": (
        "6b5b2894b1b3c1198896c606dcbd7dfd78ebf2cab90a5ca87928e80d18ad9b1b",
        {"preempted": 0, "finished": 699, "stop": 258, "length": 441, "tokens": 12753, "aborted": 46, "events": 1355},
    ),
    "small pool": (
        "fb50e10d6edf58b86d1c79ecf7fa702c6cc740076ab3d7e4e1239185a69d17cd",
        {"preempted": 74, "finished": 456, "stop": 216, "length": 240, "tokens": 7605, "aborted": 40, "events": 1596},
    ),
    "tiers": (
        "ba1417fef10e0d99a8c8e28944247db9633e4acf2b93e549082465b5a3e551cc",
        {"preempted": 59, "finished": 533, "stop": 250, "length": 283, "tokens": 8006, "aborted": 61, "events": 4933},
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fixed_workload_steps_and_emits_exactly_as_recorded(case: str) -> None:
    digest, counts = _Workload(CASES[case], seed=sorted(CASES).index(case) + 1).run(600)
    want_digest, want_counts = EXPECTED[case]
    assert counts == want_counts
    assert digest == want_digest


@pytest.mark.timeout(10)
def test_the_workloads_exercise_what_they_pin() -> None:
    """The recorded runs preempt, finish by stop and length, abort in a pass and evict."""
    assert sum(c["preempted"] for _, c in EXPECTED.values()) > 0
    assert all(c["stop"] > 0 and c["length"] > 0 and c["aborted"] > 0 for _, c in EXPECTED.values())
    assert all(c["events"] > 0 for case, (_, c) in EXPECTED.items() if case != "no prefix caching")


if __name__ == "__main__":  # print EXPECTED for this tree (PYTHONPATH=<its src>)
    for name in sorted(CASES):
        print(f"    {name!r}: {_Workload(CASES[name], seed=sorted(CASES).index(name) + 1).run(600)!r},")
