"""The migration policy alone: what a request does after its worker failed, as a
function of the failure, the tokens delivered and the budget (no I/O, no loop)."""

from __future__ import annotations

import pytest

from kvmesh.errors import Cancelled, Disconnected, EngineShutdown, InvalidArgument, ResponseTimeout, Unknown
from kvmesh.health.migration import RETRIES_BEFORE_OUTPUT, migration_method, next_step
from kvmesh.protocol import DisaggregatedParams


def step(failure: BaseException = Disconnected("gone"), **kw: object) -> str:
    args: dict[str, object] = dict(stopped=False, delivered=0, max_tokens=16, attempts=1, migrations_left=3)
    args.update(kw)
    return next_step(failure, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("failure", [Disconnected("x"), EngineShutdown("x"), ResponseTimeout("x")])
def test_a_migratable_failure_before_output_is_retried_elsewhere(failure: BaseException) -> None:
    assert step(failure) == "retry"


def test_retries_before_output_are_bounded() -> None:
    assert step(attempts=RETRIES_BEFORE_OUTPUT) == "retry"
    assert step(attempts=RETRIES_BEFORE_OUTPUT + 1) == "fail"


@pytest.mark.parametrize("failure", [InvalidArgument("x"), Unknown("x"), Cancelled("x"), ValueError("x")])
def test_other_failures_are_not_moved(failure: BaseException) -> None:
    assert step(failure) == "fail"
    assert step(failure, delivered=4) == "fail"


def test_a_stopped_request_never_moves() -> None:
    assert step(stopped=True) == "fail"
    assert step(stopped=True, delivered=5) == "fail"


def test_after_output_it_migrates_while_the_budget_lasts() -> None:
    assert step(delivered=5, attempts=9) == "migrate"  # the retry bound is for requests with no output
    assert step(delivered=5, migrations_left=1) == "migrate"
    assert step(delivered=5, migrations_left=0) == "fail"


def test_every_token_delivered_finishes_instead_of_moving() -> None:
    assert step(delivered=16, max_tokens=16) == "finish"
    assert step(delivered=16, max_tokens=16, migrations_left=0) == "fail"
    assert step(delivered=15, max_tokens=16) == "migrate"
    assert step(delivered=15, max_tokens=None) == "migrate"


def test_method_without_a_handoff_is_re_prefill() -> None:
    assert migration_method(100, 10, None) == "re_prefill"
    assert migration_method(100, 10, DisaggregatedParams(kind="remote_prefill")) == "re_prefill"
