"""Hand-off on health ejection, the pure parts (kvmesh.health.migration): which workers
may hand their KV off, in which order requests leave, which target each one takes, and
the 500 ms rule that sends a long sequence to re-prefill."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.health.migration import (
    MAX_HANDOFFS,
    CapacityLedger,
    HandedOff,
    HandOffReport,
    TargetCapacity,
    handoff_allowed,
    handoff_order,
    migration_method,
)
from kvmesh.protocol import DisaggregatedParams, KvLayout

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    "reason, allowed",
    [
        ("check: latency_spike", True),
        ("check: timeout", True),
        ("check: error", True),
        ("stream: failure", True),
        ("recovery failed: latency_spike", True),
        ("check: wrong_tokens", False),
        ("check: logit_out_of_range", False),
        ("recovery failed: wrong_tokens", False),
    ],
)
def test_a_corrupt_worker_never_hands_its_kv_off(reason: str, allowed: bool) -> None:
    assert handoff_allowed(reason) is allowed


def test_premium_leaves_first_then_standard_then_best_effort_arrival_order_kept() -> None:
    live = [("a", "best_effort"), ("b", None), ("c", "premium"), ("d", "standard"), ("e", "premium"), ("f", "bogus")]
    order = [rid for rid, _ in handoff_order(live, lambda item: item[1])]
    assert order == ["c", "e", "b", "d", "f", "a"]


def test_the_ledger_takes_the_most_free_blocks_per_request_and_books_them() -> None:
    ledger = CapacityLedger([TargetCapacity(1, 100, 0), TargetCapacity(2, 300, 1), TargetCapacity(3, 1000, 9)], 16)
    # free / (1 + load): 100, 150, 100 -> worker 2; it then holds 300 - 4 blocks and 2 requests (98.7)
    assert ledger.claim(64) == 2
    assert ledger.targets[1].free_blocks == 296 and ledger.targets[1].load == 2
    assert ledger.claim(64) == 1  # 100 vs 98.7 vs 100: a tie goes to the lower id
    assert ledger.claim(64) == 3  # 96 / 2 = 48 vs 98.7 vs 100

def test_the_ledger_skips_targets_without_room_and_excluded_ones() -> None:
    ledger = CapacityLedger([TargetCapacity(1, 3, 0), TargetCapacity(2, 10, 5)], 16)
    assert ledger.claim(16 * 4) == 2  # worker 1 has 3 blocks free: the request needs 4
    assert ledger.claim(16 * 4, exclude=[2]) is None  # nothing left that fits
    assert ledger.claim(16 * 7) is None  # worker 2 has 6 left
    assert ledger.claim(1) == 1


def test_the_ledger_copies_its_input() -> None:
    targets = [TargetCapacity(1, 10, 0)]
    CapacityLedger(targets, 16).claim(160)
    assert targets[0].free_blocks == 10
    with pytest.raises(ValueError):
        CapacityLedger(targets, 0)


def _handoff(bytes_per_s: float) -> DisaggregatedParams:
    layout = KvLayout("mocker", 16, 1024, (1,), "float32", 16 * 40_000, 16, simulated_bytes_per_s=bytes_per_s or 0.0)
    return DisaggregatedParams(kind="kv_source", worker_id=1, block_ids=[0], num_tokens=16, address="127.0.0.1:1",
                               transfer_id="t", layout=layout)  # fmt: skip


def test_a_hand_off_copies_the_kv_within_500_ms_and_re_prefills_past_it() -> None:
    # 40 KB a token over 1 GB/s: 10K tokens = 400 ms (copied), 20K = 800 ms (re-prefilled, > 500 ms)
    assert migration_method(9_000, 1_000, _handoff(1e9)) == "kv_transfer"
    assert migration_method(19_000, 1_000, _handoff(1e9)) == "re_prefill"
    assert migration_method(100, 10, None) == "re_prefill"  # no hand-off: nothing to copy


def test_the_report_is_bounded_on_the_wire() -> None:
    too_many = HandOffReport([HandedOff(f"r{i}") for i in range(MAX_HANDOFFS + 1)])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(too_many), type=HandOffReport)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(HandedOff("x" * 300)), type=HandedOff)
    ok = HandOffReport([HandedOff("a", "premium", 40)], kept=1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ok), type=HandOffReport) == ok
