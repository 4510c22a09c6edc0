"""The planner's glue with fakes: PlannerService rounds (decisions carried out,
logged in history, counted in the metrics; a loss wakes a round at once; a failing
action is counted and planning goes on), EmbeddedFleet (spares vetted and held back,
a loss promotes the ready spare and a new spare starts; a failed canary stops a
spare; stop drains out of routing first), and the latency window from histograms."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvmesh.assembly.embedded_fleet import EmbeddedFleet
from kvmesh.observability.metrics import PlannerMetrics
from kvmesh.planner.core import ActionKind, Observation, Planner, PlannerConfig, Role, WorkerView
from kvmesh.planner.service import PlannerService
from kvmesh.planner.signals import histogram_buckets, window_quantile
from kvmesh.protocol import EngineConfig, InstanceInfo

ENGINE = EngineConfig("m", "m", 1024, 16, 64, 8, 256)


def info(worker_id: int) -> InstanceInfo:
    return InstanceInfo(worker_id, f"127.0.0.1:{1000 + worker_id}", ENGINE)


class FakeFleet:
    """A Fleet whose observations are set by the test; actions are recorded."""

    def __init__(self, workers: list[WorkerView]) -> None:
        self.workers = workers
        self.now = 0.0
        self.actions: list[tuple[str, int | None, Role]] = []
        self.fail_on: str | None = None

    async def settled(self) -> None:
        return None

    async def observe(self) -> Observation:
        self.now += 1.0
        return Observation(self.now, tuple(self.workers))

    async def _act(self, kind: str, worker_id: int | None, role: Role) -> None:
        if kind == self.fail_on:
            raise RuntimeError("injected")
        self.actions.append((kind, worker_id, role))

    async def promote(self, worker_id: int, role: Role) -> None:
        await self._act("promote", worker_id, role)

    async def start(self, role: Role) -> None:
        await self._act("start", None, role)

    async def stop(self, worker_id: int) -> None:
        await self._act("stop", worker_id, Role.AGGREGATED)

    async def move(self, worker_id: int, role: Role) -> None:
        await self._act("move", worker_id, role)


def serving(*ids: int) -> list[WorkerView]:
    return [WorkerView(i, Role.AGGREGATED, True) for i in ids]


CONFIG = PlannerConfig(min_workers=2, max_workers=3, hot_spares=1, cooldown_s=1e9)


def metric(m: PlannerMetrics, name: str, labels: dict[str, str]) -> float:
    value = m.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_a_loss_promotes_the_spare_and_starts_a_new_one_all_logged_and_counted() -> None:
    fleet = FakeFleet([*serving(0, 1), WorkerView(2, Role.SPARE, True)])
    metrics = PlannerMetrics(CollectorRegistry())
    service = PlannerService(Planner(CONFIG), fleet, 60.0, metrics)
    assert (await service.round()).actions == ()  # the plan learns its sizes
    fleet.workers = [*serving(1), WorkerView(2, Role.SPARE, True)]  # worker 0 lost
    plan = await service.round()
    assert [a.kind for a in plan.actions] == [ActionKind.PROMOTE, ActionKind.START]
    assert fleet.actions == [("promote", 2, Role.AGGREGATED), ("start", None, Role.SPARE)]
    assert [d.action.kind for d in service.history] == [ActionKind.PROMOTE, ActionKind.START]
    assert all(d.ok and "decode_pressure" in d.action.inputs for d in service.history)
    assert metric(metrics, "kvmesh_planner_decisions_total", {"action": "promote", "role": "aggregated"}) == 1
    assert metric(metrics, "kvmesh_planner_decisions_total", {"action": "start", "role": "spare"}) == 1
    assert metric(metrics, "kvmesh_planner_workers", {"role": "spare"}) == 0  # promoted: none ready until the new one
    assert metric(metrics, "kvmesh_planner_workers", {"role": "aggregated"}) == 2


async def test_a_failing_action_is_counted_and_planning_goes_on() -> None:
    fleet = FakeFleet(serving(0, 1))
    fleet.fail_on = "start"
    metrics = PlannerMetrics(CollectorRegistry())
    service = PlannerService(Planner(CONFIG), fleet, 60.0, metrics)
    await service.round()  # wants a spare: the start fails
    assert metric(metrics, "kvmesh_planner_actions_failed_total", {"action": "start"}) == 1
    assert not service.history[-1].ok
    fleet.fail_on = None
    await service.round()
    assert fleet.actions == [("start", None, Role.SPARE)]


async def test_wake_plans_at_once_without_waiting_the_interval() -> None:
    fleet = FakeFleet(serving(0, 1))
    service = PlannerService(Planner(PlannerConfig(min_workers=2, max_workers=2)), fleet, 3600.0)
    service.start()
    try:
        while service.rounds < 1:
            await asyncio.sleep(0.001)
        service.wake()
        await asyncio.wait_for(_rounds(service, 2), 5)
    finally:
        await service.close()


async def _rounds(service: PlannerService, n: int) -> None:
    while service.rounds < n:
        await asyncio.sleep(0.001)


class FakeSupervisor:
    def __init__(self, next_id: int) -> None:
        self.next_id = next_id
        self.launched: list[int] = []
        self.terminated: list[int] = []

    def launch(self) -> int:
        self.launched.append(self.next_id)
        self.next_id += 1
        return self.launched[-1]

    def terminate(self, worker_id: int) -> bool:
        self.terminated.append(worker_id)
        return True


class Records:
    """The fleet's discovery: what is published (routable)."""

    def __init__(self) -> None:
        self.published: set[int] = set()

    async def publish(self, i: InstanceInfo) -> None:
        self.published.add(i.worker_id)

    async def unpublish(self, worker_id: int) -> None:
        self.published.discard(worker_id)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def embedded(vet_ok: bool = True) -> tuple[EmbeddedFleet, Records, FakeSupervisor]:
    records = Records()

    async def vet(i: InstanceInfo) -> tuple[bool, str]:
        return vet_ok, "fake canary"

    supervisor = FakeSupervisor(3)
    fleet = EmbeddedFleet(records, {0: Role.AGGREGATED, 1: Role.AGGREGATED, 2: Role.SPARE}, supervisor, vet=vet)
    for wid in (0, 1, 2):
        await fleet.on_ready(info(wid))
    await _settle()
    await asyncio.wait_for(fleet.settled(), 1)
    return fleet, records, supervisor


async def test_embedded_spare_is_vetted_and_held_back_then_promoted_on_a_loss() -> None:
    fleet, records, supervisor = await embedded()
    assert records.published == {0, 1}  # the spare runs, checked, not routed to
    obs = await fleet.observe()
    assert {(w.worker_id, w.role, w.routable) for w in obs.workers} == {
        (0, Role.AGGREGATED, True), (1, Role.AGGREGATED, True), (2, Role.SPARE, True)}  # fmt: skip
    service = PlannerService(Planner(CONFIG), fleet, 60.0, PlannerMetrics(CollectorRegistry()))
    fleet.attach(service)
    await service.round()
    await fleet.on_exit(0)  # SIGKILLed: unpublished, counted as a loss
    assert records.published == {1}
    await service.round()
    await _settle()
    assert records.published == {1, 2} and supervisor.launched == [3]
    obs = await fleet.observe()
    assert ("spare" in [r.value for r in obs.starting]) and len(obs.workers) == 2
    await fleet.on_ready(info(3))
    await _settle()
    assert records.published == {1, 2}  # the new spare is held back too
    assert any(w.worker_id == 3 and w.role is Role.SPARE and w.routable for w in (await fleet.observe()).workers)


async def test_a_spare_failing_its_canary_is_stopped() -> None:
    fleet, records, supervisor = await embedded(vet_ok=False)
    assert supervisor.terminated == [2] and records.published == {0, 1}
    assert all(w.worker_id != 2 for w in (await fleet.observe()).workers)


async def test_stop_takes_the_worker_out_of_routing_before_the_drain_and_is_no_loss() -> None:
    fleet, records, supervisor = await embedded()
    await fleet.stop(1)
    await _settle()
    assert records.published == {0} and supervisor.terminated == [1]
    await fleet.on_exit(1)
    assert fleet._lost == []


def test_window_quantile_of_the_observations_between_two_snapshots() -> None:
    bounds = (0.1, 0.5, 1.0, float("inf"))
    before = (10, 10, 10, 10)
    now = (10, 20, 30, 30)  # since: 10 in (0.1, 0.5], 10 in (0.5, 1.0]
    assert window_quantile(bounds, before, now, 0.5) == pytest.approx(0.5)
    assert window_quantile(bounds, before, now, 0.9) == pytest.approx(0.9)
    assert window_quantile(bounds, now, now, 0.9) == 0.0
    assert window_quantile(bounds, (0, 0, 0, 0), (0, 0, 0, 4), 0.5) == 1.0  # all past the last bound
    with pytest.raises(ValueError):
        window_quantile(bounds, before, now, 1.5)


def test_histogram_buckets_sum_every_label_set() -> None:
    h = Histogram("t_seconds", "t", ["model"], buckets=(0.1, 1.0), registry=CollectorRegistry())
    h.labels("a").observe(0.05)
    h.labels("b").observe(0.5)
    bounds, counts = histogram_buckets(h)
    assert bounds == (0.1, 1.0, float("inf")) and counts == (1.0, 2.0, 2.0)


async def test_a_move_starts_the_new_worker_and_drains_the_old_once_it_is_routable() -> None:
    fleet, records, supervisor = await embedded()
    await fleet.move(0, Role.AGGREGATED)
    assert supervisor.launched == [3] and supervisor.terminated == []  # the old one serves meanwhile
    await fleet.on_ready(info(3))
    await _settle()
    assert records.published == {1, 3} and supervisor.terminated == [0]
    await fleet.on_exit(0)
    assert fleet._lost == []  # a planned stop is no loss


async def test_ready_spares_get_idle_canaries_and_a_failing_one_is_stopped() -> None:
    results = [True]
    records = Records()

    async def vet(i: InstanceInfo) -> tuple[bool, str]:
        return results[-1], "fake canary"

    now = [0.0]
    supervisor = FakeSupervisor(2)
    fleet = EmbeddedFleet(records, {0: Role.AGGREGATED, 1: Role.SPARE}, supervisor, clock=lambda: now[0], vet=vet)
    for wid in (0, 1):
        await fleet.on_ready(info(wid))
    await _settle()
    assert any(w.worker_id == 1 and w.routable for w in (await fleet.observe()).workers)
    results.append(False)
    await fleet.observe()  # not due yet
    await _settle()
    assert supervisor.terminated == []
    now[0] += fleet.revet_s
    await fleet.observe()
    await _settle()
    assert supervisor.terminated == [1]
    assert all(w.worker_id != 1 for w in (await fleet.observe()).workers)


async def test_a_replacement_that_fails_to_start_is_forgotten_and_the_loss_kept() -> None:
    fleet, records, supervisor = await embedded()
    fleet.members[2].vetted = False  # no ready spare: the loss needs a cold start
    await fleet.on_exit(0)
    await fleet.start(Role.AGGREGATED)
    assert supervisor.launched == [3] and fleet._lost == []
    obs = await fleet.observe()
    assert obs.starting == (Role.AGGREGATED,)
    await fleet.on_failed(3, "boom")
    assert 3 not in fleet.members and len(fleet._lost) == 1
    assert (await fleet.observe()).starting == ()


async def test_live_planners_see_each_workers_batch_capacity() -> None:
    """``WorkerView.capacity`` comes from the worker's card (``max_num_seqs``, in its
    discovery record and its ready line), so the full-decode-batch rule works in the
    live planners as in replay: 8 running of 8 is a full batch, 7 of 8 is not."""
    from kvmesh.assembly.discovery_fleet import DiscoveryFleet
    from kvmesh.config import RuntimeConfig
    from kvmesh.protocol import LoadReport
    from kvmesh.runtime.discovery.memory import MemoryDiscovery
    from kvmesh.runtime.distributed import DistributedRuntime, instance_key
    from kvmesh.runtime.names import COMPONENT, GENERATE

    fleet, _, _ = await embedded()
    fleet._polling = True  # no load polling here: the test sets the loads
    fleet.members[0].load = LoadReport(0, 10, 64, num_waiting=3, num_running=8)
    fleet.members[1].load = LoadReport(1, 10, 64, num_waiting=3, num_running=7)
    views = {w.worker_id: w for w in (await fleet.observe()).workers}
    assert {w: (v.capacity, v.batch_full) for w, v in views.items()} == {0: (8, True), 1: (8, False), 2: (8, False)}
    await fleet.close()

    discovery = MemoryDiscovery()
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory", namespace="ns"), discovery, secret=None)
    await runtime.start()
    try:
        wide = EngineConfig("m", "m", 1024, 16, 64, 32, 256)
        for wid, engine in ((1, ENGINE), (2, wide)):
            record = InstanceInfo(wid, "127.0.0.1:1", engine)
            await discovery.put(instance_key("ns", COMPONENT, GENERATE, wid), msgspec.json.encode(record))
        live = DiscoveryFleet(runtime)
        await live._scan()
        live.loads = {1: LoadReport(1, 10, 64, num_waiting=1, num_running=8), 2: LoadReport(2, 10, 64, num_waiting=1, num_running=8)}
        views = {w.worker_id: w for w in (live._view(w, r) for w, (r, _) in live._serving.items())}
        assert {w: (v.capacity, v.batch_full) for w, v in views.items()} == {1: (8, True), 2: (32, False)}
    finally:
        await runtime.shutdown()
