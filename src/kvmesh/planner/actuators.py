"""How ``kvmesh planner`` (distributed) changes the fleet: actuators behind one interface.

The planner's :class:`~kvmesh.assembly.discovery_fleet.DiscoveryFleet` observes the fleet
through discovery and carries out the core's actions through its :class:`Actuator`\\ s,
in order:

* **start** ``role``: the first actuator that :meth:`~Actuator.can_start` it;
* **promote** a ready standby: the first that accepts;
* **stop** (drain, then end) a worker: the process actuator that started it, else a
  signed stop order (which workers that were standbys obey);
* **move** (a role change): start in the new role, stop the old worker once the new one
  is registered (drain + start: no request lost).

Two implementations:

* :class:`StandbyActuator` (always there): promotes vetted ``kvmesh worker --standby``
  processes through signed orders in discovery (:mod:`kvmesh.planner.orders`) and
  orders standby-born workers to drain and stop. It cannot start a process.
* :class:`ProcessActuator` (``kvmesh planner --worker-flags "..."``): starts local
  ``kvmesh worker`` processes with those flags (``--mode prefill`` / ``decode`` for those
  roles, ``--standby`` for a hot spare, which the standby actuator then vets and
  promotes) and the planner's own runtime settings in their environment; it stops
  only the processes it started (SIGTERM: the worker leaves discovery, drains, exits),
  known by PID and by the worker id of their READY line. They end with the planner
  (:meth:`ProcessActuator.close`: SIGTERM, then SIGKILL after a timeout).

Each actuator reports the roles of the workers it has set on their way but the fleet
does not see yet (:meth:`Actuator.starting`), so the core does not start them twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import msgspec

from kvmesh.errors import KvmeshError
from kvmesh.planner.core import Role
from kvmesh.planner.orders import Order, order_key, sign_order
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.distributed import DistributedRuntime

__all__ = ["Actuator", "StandbyActuator", "ProcessActuator", "worker_command"]

log = logging.getLogger("kvmesh.planner")

_decode_info = msgspec.json.Decoder(InstanceInfo).decode
_MAX_LINE = 64 * 1024  # a worker's output line (its READY card is a few hundred bytes)
_ROLE_FLAGS: dict[Role, tuple[str, ...]] = {
    Role.AGGREGATED: (), Role.PREFILL: ("--mode", "prefill"), Role.DECODE: ("--mode", "decode"),
    Role.SPARE: ("--standby",),
}  # fmt: skip


class Actuator(Protocol):
    """One way of changing the fleet's processes (see the module docstring)."""

    def can_start(self, role: Role) -> bool:
        """Whether :meth:`start` can bring one more worker into ``role`` now."""
        ...

    def owns(self, worker_id: int) -> bool:
        """Whether :meth:`stop` can drain and stop ``worker_id``."""
        ...

    def starting(self, present: Collection[int]) -> tuple[Role, ...]:
        """Roles of the workers this actuator set on their way that are not among
        ``present`` (the workers the fleet sees, serving or standing by) yet."""
        ...

    async def start(self, role: Role) -> None:
        """Bring one more worker into ``role``; :class:`KvmeshError` if it cannot."""
        ...

    async def promote(self, worker_id: int, role: Role) -> None:
        """Make the ready standby ``worker_id`` serve in ``role``; KvmeshError if it cannot."""
        ...

    async def stop(self, worker_id: int) -> None:
        """Drain and stop ``worker_id`` (one it :meth:`owns`)."""
        ...

    async def close(self) -> None: ...


class StandbyActuator:
    """Today's distributed planner: signed orders to standby workers. ``ready(role)``:
    the vetted standbys that fit ``role`` (the fleet's canaries decide), in the order
    to promote them."""

    def __init__(self, runtime: DistributedRuntime, ready: Callable[[Role], list[int]]) -> None:
        self.runtime = runtime
        self.ready = ready
        self.promoting: dict[int, Role] = {}  # ordered to serve, not registered yet

    def seen(self, serving: Collection[int], standby: Collection[int]) -> None:
        """The fleet's scan: promotions that registered (or whose standby went) end."""
        for w in [w for w in self.promoting if w in serving or w not in standby]:
            del self.promoting[w]

    def can_start(self, role: Role) -> bool:
        return role is not Role.SPARE and bool(self._fits(role))

    def owns(self, worker_id: int) -> bool:
        """Any worker: an order can be written for each (workers that were standbys obey)."""
        return True

    def starting(self, present: Collection[int]) -> tuple[Role, ...]:
        return tuple(self.promoting.values())

    async def start(self, role: Role) -> None:
        fits = self._fits(role) if role is not Role.SPARE else []
        if not fits:
            raise KvmeshError(f"no standby to start a {role.value} worker from: start `kvmesh worker --standby` processes")
        await self.promote(fits[0], role)

    async def promote(self, worker_id: int, role: Role) -> None:
        """Order a vetted standby of ``role``'s kind to serve: ``worker_id`` if it fits
        (a prefill standby for the prefill role, another for the rest), else another."""
        fits = self._fits(role)
        if not fits:
            raise KvmeshError(f"no vetted {role.value} standby to promote")
        chosen = worker_id if worker_id in fits else fits[0]
        await self.order(chosen, "serve", f"promoted to {role.value}")
        self.promoting[chosen] = role

    async def stop(self, worker_id: int) -> None:
        await self.order(worker_id, "stop", "planner: scale down")

    async def order(self, worker_id: int, action: Literal["serve", "stop"], reason: str) -> None:
        rt = self.runtime
        key = order_key(rt.config.namespace, worker_id)
        order = sign_order(rt.secret, key, Order(worker_id, action, time.time_ns(), reason))
        await rt.put_leased(key, msgspec.json.encode(order))

    def _fits(self, role: Role) -> list[int]:
        return [w for w in self.ready(role) if w not in self.promoting]

    async def close(self) -> None:
        pass


def worker_command(flags: Sequence[str], role: Role) -> list[str]:
    """``kvmesh worker`` with ``flags``, then the role's own (they win over ``flags``)."""
    return [sys.executable, "-m", "kvmesh.cli.main", "worker", *flags, *_ROLE_FLAGS[role]]


@dataclass
class _Proc:
    role: Role
    process: asyncio.subprocess.Process
    worker_id: int | None = None  # from its READY line
    stopping: bool = False


class ProcessActuator:
    """Starts and stops local ``kvmesh worker`` processes (see the module docstring).
    ``flags``: the workers' own flags; ``env``: added to this process's environment for
    them (the planner's runtime settings); ``ready_prefix``: the start of a worker's
    READY line; ``max_processes``: a bound on the processes it runs at once; ``command``:
    the command line of a worker of a role (tests run a stand-in)."""

    def __init__(
        self,
        flags: Sequence[str],
        env: Mapping[str, str],
        ready_prefix: str,
        max_processes: int = 64,
        stop_timeout_s: float = 30.0,
        command: Callable[[Sequence[str], Role], list[str]] = worker_command,
    ) -> None:
        self.flags = tuple(flags)
        self.command = command
        self.env = {**os.environ, **env}
        self.ready_prefix = ready_prefix
        self.max_processes = max_processes
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[int, _Proc] = {}  # by PID: only the processes this actuator started
        self._tasks: set[asyncio.Task[None]] = set()

    def can_start(self, role: Role) -> bool:
        return len(self.procs) < self.max_processes

    def owns(self, worker_id: int) -> bool:
        return self._by_worker(worker_id) is not None

    def starting(self, present: Collection[int]) -> tuple[Role, ...]:
        return tuple(p.role for p in self.procs.values() if not p.stopping and p.worker_id not in present)

    def pids(self) -> dict[int, int | None]:
        """PID -> worker id (None until its READY line) of the processes it runs."""
        return {pid: p.worker_id for pid, p in self.procs.items()}

    async def start(self, role: Role) -> None:
        if not self.can_start(role):
            raise KvmeshError(f"already {len(self.procs)} worker processes started (at most {self.max_processes})")
        cmd = self.command(self.flags, role)
        try:
            process = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=self.env, limit=_MAX_LINE
            )
        except OSError as exc:
            raise KvmeshError(f"cannot start a worker process ({exc})") from exc
        proc = self.procs[process.pid] = _Proc(role, process)
        log.warning("planner: started worker process %d as %s", process.pid, role.value)
        task = asyncio.get_running_loop().create_task(self._watch(proc))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def promote(self, worker_id: int, role: Role) -> None:
        raise KvmeshError("the process actuator promotes no standby (it starts workers)")

    async def stop(self, worker_id: int) -> None:
        proc = self._by_worker(worker_id)
        if proc is not None:
            proc.stopping = True
            _signal(proc.process, signal.SIGTERM)  # it leaves discovery, drains, exits

    def _by_worker(self, worker_id: int) -> _Proc | None:
        return next((p for p in self.procs.values() if p.worker_id == worker_id), None)

    async def _watch(self, proc: _Proc) -> None:
        """Its READY line (the worker id), its other output passed on, its end."""
        stdout = proc.process.stdout
        assert stdout is not None
        try:
            while line := await stdout.readline():
                self._line(proc, line.decode(errors="replace"))
        except ValueError:  # a line over the limit: the rest of its output is not read
            log.warning("worker process %d wrote a line over %d bytes", proc.process.pid, _MAX_LINE)
        code = await proc.process.wait()
        self.procs.pop(proc.process.pid, None)
        level = logging.INFO if proc.stopping else logging.WARNING
        log.log(level, "planner: worker process %d (%s) exited with code %s", proc.process.pid, proc.role.value, code)

    def _line(self, proc: _Proc, text: str) -> None:
        if proc.worker_id is None and text.startswith(self.ready_prefix):
            try:
                proc.worker_id = _decode_info(text[len(self.ready_prefix) :].strip()).worker_id
            except msgspec.DecodeError:
                log.warning("worker process %d: a READY line that does not decode", proc.process.pid)
            return
        sys.stdout.write(text)

    async def close(self) -> None:
        """SIGTERM every process it started (they drain), SIGKILL what is left after
        ``stop_timeout_s``."""
        procs = [p.process for p in self.procs.values()]
        for process in procs:
            _signal(process, signal.SIGTERM)
        if procs:
            waits = [asyncio.ensure_future(p.wait()) for p in procs]
            _, pending = await asyncio.wait(waits, timeout=self.stop_timeout_s)
            for process in procs:
                _signal(process, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=5)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
    if process.returncode is None:
        try:
            process.send_signal(sig)
        except ProcessLookupError:
            pass
