"""The distributed planner's actuators (kvmesh.planner.actuators) and how
DiscoveryFleet uses them: a process actuator starts real (stand-in) worker processes,
learns their worker ids from their READY lines, counts them as starting until the
fleet sees them, stops only the processes it started (SIGTERM: they drain) and ends
them all on close; the fleet prefers a vetted standby to a new process, stops a worker
through the actuator that started it (else a signed order), starts the missing
minimum at start-up and ends a move once a new worker serves in the new role."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from collections.abc import Collection, Sequence
from pathlib import Path

import msgspec
import pytest

from kvmesh.assembly.discovery_fleet import DiscoveryFleet
from kvmesh.assembly.planner import runtime_env
from kvmesh.config import RuntimeConfig
from kvmesh.errors import KvmeshError
from kvmesh.planner.actuators import ProcessActuator, worker_command
from kvmesh.planner.core import Role
from kvmesh.planner.orders import Order, order_key, standby_key
from kvmesh.protocol import EngineConfig, InstanceInfo
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.discovery.memory import MemoryDiscovery
from kvmesh.runtime.distributed import DistributedRuntime, instance_key, sign_record
from kvmesh.runtime.names import COMPONENT, GENERATE
from kvmesh.worker.registration import READY_PREFIX

pytestmark = pytest.mark.timeout(60)

SECRET = ClusterSecret(b"planner-actuators-test-secret-0123456789abcdef")
ENGINE = EngineConfig("m", "m", 1024, 16, 64, 8, 256)

# a stand-in `kvmesh worker`: its argv in a file, its READY line (worker ids 100, 101, ...
# in start order), a line of output, then it waits; SIGTERM ends it with code 0
FAKE = textwrap.dedent(f"""
    import json, os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if os.environ.get("FAKE_FAIL"):
        sys.exit(3)
    card = json.loads(os.environ["FAKE_CARD"])
    card["lease_id"] = int(os.environ["FAKE_ID"]) + len(os.listdir(os.environ["FAKE_DIR"]))
    open(os.path.join(os.environ["FAKE_DIR"], str(os.getpid())), "w").write(" ".join(sys.argv[1:]))
    print("{READY_PREFIX}" + json.dumps(card), flush=True)
    print("fake worker up", flush=True)
    while True:
        time.sleep(0.05)
""")


def _actuator(tmp_path: Path, **env: str) -> ProcessActuator:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE)
    (tmp_path / "cards").mkdir(exist_ok=True)

    def command(flags: Sequence[str], role: Role) -> list[str]:
        return [sys.executable, str(script), *worker_command(flags, role)[4:]]  # the flags after `kvmesh worker`

    card = msgspec.json.encode(InstanceInfo(0, "127.0.0.1:1", ENGINE)).decode()
    env = {"FAKE_ID": "100", "FAKE_DIR": str(tmp_path / "cards"), "FAKE_CARD": card, **env}
    return ProcessActuator(["--speedup", "5"], env, READY_PREFIX, max_processes=2, stop_timeout_s=5, command=command)


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is gone as far as the test is concerned
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


async def test_the_process_actuator_starts_its_workers_and_stops_only_them(tmp_path: Path) -> None:
    act = _actuator(tmp_path)
    try:
        await act.start(Role.AGGREGATED)
        assert act.starting(()) == (Role.AGGREGATED,)  # on its way until the fleet sees it
        await _until(lambda: list(act.pids().values()) == [100], "the READY line's worker id")
        (pid,) = act.pids()
        assert act.owns(100) and not act.owns(7)
        assert act.starting(()) == (Role.AGGREGATED,) and act.starting({100}) == ()
        await act.start(Role.PREFILL)
        with pytest.raises(KvmeshError, match="at most 2"):
            await act.start(Role.SPARE)
        await _until(lambda: 101 in act.pids().values(), "the second worker")
        cards = {p.name: p.read_text() for p in (tmp_path / "cards").iterdir()}
        assert cards[str(pid)] == "--speedup 5" and "--speedup 5 --mode prefill" in cards.values()
        await act.stop(7)  # not one it started: nothing happens
        assert len(act.pids()) == 2
        await act.stop(100)
        await _until(lambda: pid not in act.pids(), "the stopped worker's exit")
        assert act.starting(()) == (Role.PREFILL,), "a stopping worker is not on its way"
        others = list(act.pids())
    finally:
        await act.close()
    assert act.pids() == {} and not any(_alive(p) for p in others), "close ends every process it started"


async def test_a_worker_that_fails_to_start_is_no_longer_on_its_way(tmp_path: Path) -> None:
    act = _actuator(tmp_path, FAKE_FAIL="1")
    try:
        await act.start(Role.AGGREGATED)
        await _until(lambda: act.pids() == {}, "the failed process forgotten")
        assert act.starting(()) == ()
    finally:
        await act.close()


def test_runtime_env_carries_the_planners_runtime_to_its_workers() -> None:
    env = runtime_env(RuntimeConfig(namespace="ns1", discovery="etcd", etcd_endpoints=("http://a:1", "http://b:2"),
                                    lease_ttl_s=3.0))  # fmt: skip
    assert env["KVMESH_NAMESPACE"] == "ns1" and env["KVMESH_DISCOVERY"] == "etcd"
    assert env["KVMESH_ETCD_ENDPOINTS"] == "http://a:1,http://b:2" and env["KVMESH_LEASE_TTL"] == "3.0"
    assert "KVMESH_ETCD_USER" not in env  # empty settings are left to the environment


class FakeProcesses:
    """An actuator that records what it was asked (the fleet's routing of actions)."""

    def __init__(self) -> None:
        self.started: list[Role] = []
        self.stopped: list[int] = []
        self.mine: set[int] = {5}

    def can_start(self, role: Role) -> bool:
        return True

    def owns(self, worker_id: int) -> bool:
        return worker_id in self.mine

    def starting(self, present: Collection[int]) -> tuple[Role, ...]:
        return tuple(self.started)

    async def start(self, role: Role) -> None:
        self.started.append(role)

    async def promote(self, worker_id: int, role: Role) -> None:
        raise KvmeshError("no")

    async def stop(self, worker_id: int) -> None:
        self.stopped.append(worker_id)

    async def close(self) -> None:
        pass


async def test_the_fleet_prefers_a_standby_and_stops_through_the_owner() -> None:
    discovery = MemoryDiscovery()
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory", namespace="ns"), discovery, secret=SECRET)
    await runtime.start()

    async def record(key: str, info: InstanceInfo) -> None:
        await discovery.put(key, msgspec.json.encode(sign_record(SECRET, key, info)))

    async def order_of(wid: int) -> str | None:
        found = await discovery.get_prefix(order_key("ns", wid))
        return msgspec.json.decode(found[order_key("ns", wid)], type=Order).action if found else None

    fake = FakeProcesses()
    fleet = DiscoveryFleet(runtime, min_serving=2, actuators=(fake,))
    try:
        await record(instance_key("ns", COMPONENT, GENERATE, 5), InstanceInfo(5, "127.0.0.1:1", ENGINE))
        settle = asyncio.ensure_future(fleet.settled())
        await _until(lambda: fake.started == [Role.AGGREGATED], "the missing minimum started")
        await record(instance_key("ns", COMPONENT, GENERATE, 6), InstanceInfo(6, "127.0.0.1:1", ENGINE))
        await asyncio.wait_for(settle, 10)
        fake.started.clear()
        await record(standby_key("ns", 9), InstanceInfo(9, "127.0.0.1:1", ENGINE))
        await fleet._scan()
        await fleet.start(Role.AGGREGATED)  # no vetted standby: a process
        assert fake.started == [Role.AGGREGATED] and fleet.promoting == {}
        fleet.vetted[9] = True
        await fleet.start(Role.AGGREGATED)  # a vetted standby first
        assert fleet.promoting == {9: Role.AGGREGATED} and await order_of(9) == "serve"
        assert len(fake.started) == 1
        await fleet.stop(5)  # its own process
        assert fake.stopped == [5] and await order_of(5) is None
        await fleet.stop(6)  # not its: a signed order (a standby-born worker obeys)
        assert await order_of(6) == "stop"
        # a move: start in the new role, stop the old worker once a new one serves
        fake.started.clear()
        await discovery.delete(standby_key("ns", 9))
        await fleet._scan()
        await fleet.move(5, Role.AGGREGATED)
        assert fake.started == [Role.AGGREGATED] and fake.stopped == [5]
        await record(instance_key("ns", COMPONENT, GENERATE, 12), InstanceInfo(12, "127.0.0.1:1", ENGINE))
        await fleet._scan()
        assert fake.stopped == [5, 5] and fleet.moves == []
    finally:
        await fleet.close()
        await runtime.shutdown()


def test_worker_flags_that_do_not_split_like_a_shell_line_or_have_no_bound_are_refused_at_start() -> None:
    from kvmesh.config import PlannerConfig as PlannerSettings

    with pytest.raises(ValueError, match="split like a shell line"):
        PlannerSettings(worker_flags='--model-path "/models/x', max_workers=2)
    with pytest.raises(ValueError, match="--worker-flags needs --max-workers"):
        PlannerSettings(worker_flags="--speedup 10")  # no bound on the processes it may start
    assert PlannerSettings(worker_flags="--speedup 10 --model-path '/a b'", max_workers=2).worker_flags
