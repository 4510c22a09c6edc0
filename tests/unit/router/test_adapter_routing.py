"""LoRA adapters in the router (issue 30): the load-time cost term (router/cost.py), the
affinity view (router/adapters.py), and the core's choice with both; a request's block
hashes carry its adapter and cache namespace (kv.hashing.hash_salt)."""

from __future__ import annotations

import math

import pytest

from kvmesh.kv.events import BlockStored
from kvmesh.kv.hashing import block_hashes, hash_salt
from kvmesh.protocol import EngineConfig, InstanceInfo, KvEvent, LoadReport, PreprocessedRequest, SamplingOptions, StopConditions
from kvmesh.router.service import KvRouterService
from kvmesh.runtime.instances import Instance
from kvmesh.router.adapters import AdapterAffinity
from kvmesh.router.core import KvRouterCore, RouterSettings
from kvmesh.router.cost import CostInputs, adapter_load_tokens, score_all, select_greedy, with_adapter_load

BS = 16


def test_load_tokens_are_the_load_time_at_the_prefill_rate() -> None:
    assert adapter_load_tokens(50.0, 8.0) == 400.0
    assert adapter_load_tokens(0.0, 8.0) == 0.0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            adapter_load_tokens(bad, 8.0)
        with pytest.raises(ValueError):
            adapter_load_tokens(10.0, bad)


def test_a_worker_without_the_adapter_pays_its_load_as_prefill() -> None:
    load = {1: 32, 2: 0}
    charged = with_adapter_load(load, [1, 2, 3], holders={1}, load_tokens=400.0)
    assert charged == {1: 32, 2: 400.0, 3: 400.0}
    assert load == {1: 32, 2: 0}  # the booked load is not changed
    costs = {c.worker_id: c.cost for c in score_all([1, 2, 3], CostInputs({}, 64, charged, {}, BS, 1.0))}
    # holder: (32 + 64) / 16 prefill + 4 new blocks; the others: (400 + 64) / 16 + 4
    assert costs == {1: 10.0, 2: 33.0, 3: 33.0}


def _core(load_tokens: float = 400.0, workers: int = 3) -> KvRouterCore:
    core = KvRouterCore(RouterSettings(block_size=BS, adapter_load_tokens=load_tokens, seed=1))
    for w in range(1, workers + 1):
        core.add_worker(w)
    return core


def test_the_holder_wins_while_it_is_not_busier_than_a_load() -> None:
    core = _core()
    prompt = list(range(64))  # 4 blocks
    # a request booked on the holder adds 64 prefill tokens and 4 blocks: after k of them
    # its cost is 8 (k + 1); a worker without the adapter costs (400 + 64) / 16 + 4 = 33
    for i in range(4):
        assert core.route(f"r{i}", prompt, 0.0, holders={2}).worker_id == 2
    spill = core.route("r4", prompt, 0.0, holders={2})  # the holder would cost 40 now
    assert spill.worker_id != 2  # another worker loads the adapter
    assert {c.worker_id: c.cost for c in spill.candidates} == {1: 33.0, 2: 40.0, 3: 33.0}
    # without adapter affinity (a plain request) an idle worker wins at once
    assert _core().route("p", prompt, 0.0).worker_id in (1, 3)


def test_with_no_load_cost_the_adapter_does_not_matter() -> None:
    core = _core(load_tokens=0.0)
    core.route("busy", list(range(160)), 0.0, weights={1: 0.0, 2: 1.0, 3: 0.0})  # books worker 2
    picked = {core.route(f"r{i}", list(range(64)), 0.0, holders={2}).worker_id for i in range(2)}
    assert 2 not in picked  # the holder is the busiest: nothing keeps requests on it


def test_the_fast_path_for_big_fleets_charges_the_load_too() -> None:
    workers = dict.fromkeys(range(1, 101))
    charged = with_adapter_load({}, workers, holders={42}, load_tokens=400.0)
    import random

    chosen, _ = select_greedy(workers, CostInputs({}, 64, charged, {}, BS, 1.0), None, random.Random(0))
    assert chosen.worker_id == 42
    core = _core(workers=100)
    assert core.route("r", list(range(64)), 0.0, holders={42}).worker_id == 42


def test_salted_hashes_find_only_the_same_adapters_blocks() -> None:
    core = _core(load_tokens=0.0, workers=2)
    prompt = list(range(64))
    salt = hash_salt("sql", None)
    core.apply_event(KvEvent(1, 0, BlockStored(block_hashes=block_hashes(prompt, BS, salt))))
    core.apply_event(KvEvent(2, 0, BlockStored(block_hashes=block_hashes(prompt, BS))))
    assert core.route("a", prompt, 0.0, salt=salt).overlap_blocks == 4
    assert core.route("a2", prompt, 0.0, salt=salt).worker_id == 1
    assert core.route("b", prompt, 0.0).worker_id == 2  # the base model's blocks are worker 2's
    other = hash_salt("chat", None)
    assert core.route("c", prompt, 0.0, salt=other).overlap_blocks == 0


def test_affinity_follows_the_workers_lru() -> None:
    a = AdapterAffinity()
    a.add_worker(1, max_adapters=2)
    a.add_worker(2, max_adapters=0)
    a.routed(1, "x")
    a.routed(1, "y")
    a.routed(1, "x")  # x used last: y is the least recently used
    a.routed(1, "z")  # past 2: y unloaded
    assert a.held(1) == ["x", "z"] and a.holders("y") == set()
    a.routed(2, "x")  # a worker that takes no adapters holds none
    assert a.holders("x") == {1} and not a.capable(2) and a.capable(1)
    assert a.knows("y") == {1}  # unloaded by LRU, its folder still known: worker 1 can load it again
    a.observe(1, ["q", "r", "s"])  # the worker's own list wins, bounded by its capacity
    assert a.held(1) == ["r", "s"]
    a.forget("s")
    assert a.holders("s") == set() and a.knows("s") == set()  # an admin unload forgets the folder too
    a.forget("x", worker_id=1)
    assert a.knows("x") == set() and a.knows("y") == {1}
    a.remove_worker(1)
    assert a.holders("r") == set()
    a.observe(1, ["r"])  # a removed worker is not brought back by a late answer
    assert a.holders("r") == set()


class _Reports:
    """A worker's request-plane client that answers ``load`` with a report holding ``adapters``."""

    def __init__(self, worker_id: int, adapters: list[str]) -> None:
        self.report = LoadReport(worker_id, 0, 100, 0, 0, adapters=adapters)
        self.asked = 0

    async def stream(self, endpoint: str, payload: bytes, ctx: object, decode: object = None):  # type: ignore[no-untyped-def]
        assert endpoint == "load"
        self.asked += 1
        yield self.report

    async def close(self) -> None:
        pass


def _service(clients: dict[int, _Reports], max_adapters: int = 2) -> KvRouterService:
    from kvmesh.observability.metrics import FrontendMetrics

    service = KvRouterService(RouterSettings(block_size=BS, adapter_load_tokens=400.0), None, FrontendMetrics().model("m").router)
    engine = EngineConfig("mocker", "m", 2048, BS, 1024, 8, 1024, max_adapters=max_adapters)
    for w, client in clients.items():
        service.workers[w] = Instance(InstanceInfo(w, f"127.0.0.1:{9000 + w}", engine, ""), client)  # type: ignore[arg-type]
        service.core.add_worker(w)
        service.adapters.add_worker(w, max_adapters)
    return service


def _request(i: int, adapter: str | None) -> PreprocessedRequest:
    return PreprocessedRequest(f"r{i}", "m", list(range(64)), SamplingOptions(), StopConditions(max_tokens=4), adapter=adapter)


async def test_load_reports_correct_the_routers_guess() -> None:
    clients = {1: _Reports(1, []), 2: _Reports(2, ["sql"])}
    service = _service(clients)
    service.adapters.observe(1, ["sql"])  # the router believes worker 1 holds it; worker 1 evicted it since
    service.adapters.observe(2, [])
    assert service.route(_request(0, "sql"), [1, 2]).worker_id == 1
    service.finished("r0")
    await service.refresh_adapters_once()
    assert service.adapters.holders("sql") == {2} and service.adapters.knows("sql") == {1, 2}
    assert service.route(_request(1, "sql"), [1, 2]).worker_id == 2
    await service.close()


async def test_plain_requests_ask_nothing_and_unknown_adapters_stay_off_other_workers() -> None:
    clients = {1: _Reports(1, []), 2: _Reports(2, [])}
    service = _service(clients)
    for i in range(4):
        service.route(_request(i, None), [1, 2])
    assert service._refresher is None  # no adapter request yet: no refresh loop, no calls
    service.adapters.routed(2, "sql")  # only worker 2 knows the folder
    service.core.route("busy", list(range(640)), 0.0, weights={1: 0.0, 2: 1.0})  # worker 2 is busy
    assert service.route(_request(9, "sql"), [1, 2]).worker_id == 2  # worker 1 could not load it
    assert service._refresher is not None
    await service.close()
    assert sum(c.asked for c in clients.values()) == 0


def test_another_models_events_are_skipped_not_rejected() -> None:
    """On NATS every model's router hears every worker's KV events: a worker of another
    model of this frontend is skipped quietly; a worker nobody knows is still a rejection."""
    import msgspec

    from kvmesh.kv.events import KvEventBatch
    from kvmesh.runtime.event_plane.base import Envelope

    service = _service({1: _Reports(1, [])})
    service.fleet = {1, 7}  # worker 7 serves another model here
    for worker, rejected in ((7, 0), (9, 1)):
        payload = msgspec.msgpack.encode(KvEventBatch(worker, 0, [BlockStored(block_hashes=[1, 2])]))
        assert service._on_envelope(Envelope(worker, 0, "kv_events", payload)) == (None if rejected == 0 else "unknown_worker")


def test_a_workers_known_list_replaces_the_guess() -> None:
    a = AdapterAffinity()
    a.add_worker(1, max_adapters=1)
    a.routed(1, "x")
    a.observe(1, ["x"], known=["x", "y", "z"])  # started with --lora for three, one resident
    assert a.holders("y") == set() and a.knows("y") == {1} and a.knows("z") == {1}
    a.observe(1, ["y"], known=["y"])  # x and z were unloaded by the admin since
    assert a.knows("x") == set() and a.holders("y") == {1}
    a.observe(1, ["q"])  # an engine that sends no known list: what the router learnt stays
    assert a.knows("y") == {1} and a.knows("q") == {1}
