"""Migration cost model, migratable errors, budget, and the resumed request."""

from __future__ import annotations

import pytest

from kvmesh.errors import (
    Cancelled,
    CannotConnect,
    ConnectionTimeout,
    Disconnected,
    EngineShutdown,
    InvalidArgument,
    ResourceExhausted,
    ResponseTimeout,
    StreamIncomplete,
)
from kvmesh.health.migration import (
    LINK_BYTES_PER_S,
    MigrationBudget,
    estimate_migration,
    is_migratable,
    prefill_ms_at,
    resume_request,
)
from kvmesh.protocol import PreprocessedRequest, StopConditions

# Llama-70B at TP=8: 640 KB per 16-token block per shard = 40 KB per token.
KV_PER_TOKEN = 655_360 // 16
PREFILL = prefill_ms_at(5000.0)


def test_nvlink_always_transfers() -> None:
    cost = estimate_migration(2048, 256, KV_PER_TOKEN, LINK_BYTES_PER_S["nvlink"], PREFILL)
    assert cost.method == "kv_transfer"
    assert cost.tokens == 2304 and cost.total_bytes == 2304 * KV_PER_TOKEN
    assert cost.reprefill_ms == pytest.approx(2304 / 5.0)
    assert cost.transfer_ms < 1.0


def test_pcie_transfers_until_the_time_budget() -> None:
    # 40 KB/token at 28 GB/s: the 500 ms budget is reached near 342K tokens
    pcie = LINK_BYTES_PER_S["pcie"]
    assert estimate_migration(300_000, 0, KV_PER_TOKEN, pcie, PREFILL).method == "kv_transfer"
    assert estimate_migration(350_000, 0, KV_PER_TOKEN, pcie, PREFILL).method == "re_prefill"


def test_a_link_slower_than_prefill_re_prefills() -> None:
    # 100 MB/s: 0.41 ms per token to copy vs 0.2 ms per token to recompute
    assert estimate_migration(1000, 0, KV_PER_TOKEN, 100e6, PREFILL, max_transfer_ms=1e9).method == "re_prefill"
    assert estimate_migration(1000, 0, KV_PER_TOKEN, 1e9, PREFILL, max_transfer_ms=1e9).method == "kv_transfer"


def test_a_transfer_over_the_time_budget_re_prefills() -> None:
    # 16K tokens over PCIe: ~23 ms transfer vs 3.3 s re-prefill, but the budget is 10 ms
    pcie = LINK_BYTES_PER_S["pcie"]
    assert estimate_migration(16_384, 0, KV_PER_TOKEN, pcie, PREFILL).method == "kv_transfer"
    assert estimate_migration(16_384, 0, KV_PER_TOKEN, pcie, PREFILL, max_transfer_ms=10.0).method == "re_prefill"


@pytest.mark.parametrize("link", [None, 0.0])
def test_no_link_re_prefills(link: float | None) -> None:
    assert estimate_migration(10, 5, KV_PER_TOKEN, link, PREFILL).method == "re_prefill"


def test_prefill_fn_is_any_callable() -> None:
    assert estimate_migration(1000, 0, KV_PER_TOKEN, 1e9, lambda tokens: 1e6).method == "kv_transfer"
    assert estimate_migration(1000, 0, KV_PER_TOKEN, 1e9, lambda tokens: 0.0).method == "re_prefill"


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError):
        estimate_migration(-1, 0, 1, 1.0, PREFILL)
    with pytest.raises(ValueError):
        prefill_ms_at(0.0)


@pytest.mark.parametrize(
    "error", [CannotConnect(), Disconnected(), ConnectionTimeout(), ResponseTimeout(), EngineShutdown()]
)
def test_migratable_errors(error: Exception) -> None:
    assert is_migratable(error)


@pytest.mark.parametrize(
    "error", [InvalidArgument(), Cancelled(), ResourceExhausted(), StreamIncomplete(), RuntimeError("x")]
)
def test_not_migratable_errors(error: Exception) -> None:
    assert not is_migratable(error)


def test_budget() -> None:
    budget = MigrationBudget()
    assert budget.limit == 3
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    assert budget.remaining == 0 and budget.used == 3
    assert not MigrationBudget(0).try_spend()
    with pytest.raises(ValueError):
        MigrationBudget(-1)


def test_resume_request_appends_generated_tokens() -> None:
    req = PreprocessedRequest("r", "m", [1, 2, 3], stop=StopConditions(max_tokens=10, min_tokens=4))
    resumed = resume_request(req, [7, 8, 9])
    assert resumed.token_ids == [1, 2, 3, 7, 8, 9]
    assert (resumed.stop.max_tokens, resumed.stop.min_tokens) == (7, 1)
    assert req.token_ids == [1, 2, 3] and req.stop.max_tokens == 10  # the original is unchanged
    assert resume_request(req, []) is req
