"""kvmesh run --planner's first workers: one that fails to start before the planner's
first round is started again by the fleet (after a backoff; the plan's sizes are not
known yet, so the planner could not miss it), and the fleet is not settled meanwhile;
after the first round a failed start is the planner's to replace. The supervisor counts
the failed starts of the workers it launches for the planner, so a crash loop under
the planner ends the run (kvmesh run exits 1 with the worker's error)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.assembly.embedded_fleet import EmbeddedFleet
from kvmesh.config import WorkerConfig
from kvmesh.planner.core import Planner, PlannerConfig, Role
from kvmesh.planner.service import PlannerService
from kvmesh.worker.supervisor import Supervisor
from tests.unit.test_planner_service import FakeSupervisor, Records, info

pytestmark = pytest.mark.timeout(30)


async def _until(predicate, what: str) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_first_worker_that_fails_to_start_is_started_again_before_the_first_round(monkeypatch) -> None:
    monkeypatch.setattr("kvmesh.assembly.embedded_fleet._RETRY_S", 0.01)
    supervisor, records = FakeSupervisor(2), Records()
    fleet = EmbeddedFleet(records, {0: Role.AGGREGATED, 1: Role.AGGREGATED}, supervisor, vet=None)
    await fleet.on_ready(info(0))
    await _until(lambda: records.published == {0}, "the first worker published")
    await fleet.on_failed(1, "boom")
    assert not fleet._settled.is_set(), "not settled while a first worker is to start again"
    assert (await fleet.observe()).starting == (Role.AGGREGATED,)  # on its way: never planned twice
    await _until(lambda: supervisor.launched == [2], "the worker started again")
    assert (await fleet.observe()).starting == (Role.AGGREGATED,) and not fleet._settled.is_set()
    await fleet.on_ready(info(2))
    await asyncio.wait_for(fleet.settled(), 1)
    await _until(lambda: records.published == {0, 2}, "the started-again worker published")
    # after the planner's first round a failed start is the planner's: not started here
    service = PlannerService(Planner(PlannerConfig(min_workers=2, max_workers=2)), fleet, 60.0)
    fleet.attach(service)
    await service.round()
    await fleet.start(Role.AGGREGATED)
    await fleet.on_failed(3, "boom")
    await asyncio.sleep(0.05)
    assert supervisor.launched == [2, 3] and (await fleet.observe()).starting == ()
    await fleet.close()


async def test_failed_starts_of_launched_workers_count_toward_giving_up(monkeypatch) -> None:
    sup = Supervisor(WorkerConfig(), 0, restart=False, max_failed_starts=2)

    async def fails(cfg: WorkerConfig) -> tuple[bool, str]:
        return False, "RuntimeError: no engine"

    monkeypatch.setattr(sup, "_run_once", fails)
    sup.launch()
    await asyncio.sleep(0.01)
    assert not sup.failed.is_set() and sup.failed_starts == 1
    sup.launch()
    await asyncio.wait_for(sup.failed.wait(), 5)
    assert sup.error == "2 worker starts in a row failed; the last: RuntimeError: no engine"
    await sup.stop()
