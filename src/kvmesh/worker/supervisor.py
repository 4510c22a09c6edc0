"""Embedded mode: the frontend process starts and supervises its worker processes.

Each worker is its own OS process (``kvmesh worker ... --die-with-parent``), so a crash
takes down only itself: the supervisor reports the exit (the frontend drops the
instance), waits a backoff and starts a replacement with a fresh worker id. Workers
die with the supervisor's process (Linux parent-death signal), and :meth:`stop`
ends them in order: SIGTERM (graceful drain), then SIGKILL after a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace

import msgspec

from kvmesh.config import WorkerConfig
from kvmesh.protocol import InstanceInfo
from kvmesh.worker.main import READY_PREFIX

__all__ = ["Supervisor", "worker_command"]

log = logging.getLogger("kvmesh.supervisor")

_decode_info = msgspec.json.Decoder(InstanceInfo).decode


def worker_command(cfg: WorkerConfig) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli.main", "worker", *cfg.to_args(), "--static", "--die-with-parent"]


class Supervisor:
    def __init__(
        self,
        template: WorkerConfig,
        count: int,
        on_ready: Callable[[InstanceInfo], Awaitable[None]],
        on_exit: Callable[[int], Awaitable[None]],
        restart: bool = True,
        backoff_s: float = 0.5,
        startup_timeout_s: float = 60.0,
        first_id: int = 0,
    ) -> None:
        self.template = template
        self.count = count
        self.first_id = first_id  # worker ids first_id, first_id + 1, ...; replacements after them
        self.on_ready = on_ready
        self.on_exit = on_exit
        self.restart = restart
        self.backoff_s = backoff_s
        self.startup_timeout_s = startup_timeout_s
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._next_id = first_id + count
        self.exits = 0

    def start(self) -> None:
        for slot in range(self.count):
            self._tasks.append(asyncio.get_running_loop().create_task(self._keep(slot)))

    async def _keep(self, slot: int) -> None:
        worker_id = self.first_id + slot
        while not self._stopping:
            cfg = replace(self.template, worker_id=worker_id)
            try:
                await self._run_once(cfg)
            except Exception:  # noqa: BLE001 - keep supervising the other slots
                log.exception("worker %d failed to run", worker_id)
            if self._stopping or not self.restart:
                return
            await asyncio.sleep(self.backoff_s)
            worker_id = self._next_id
            self._next_id += 1

    async def _run_once(self, cfg: WorkerConfig) -> None:
        proc = await asyncio.create_subprocess_exec(
            *worker_command(cfg), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
        )
        self.procs[cfg.worker_id] = proc
        ready = False
        try:
            assert proc.stdout is not None
            ready = await self._await_ready(cfg.worker_id, proc.stdout)
            # keep draining stdout so the worker never blocks on a full pipe
            while await proc.stdout.readline():
                pass
            code = await proc.wait()
        finally:
            self.procs.pop(cfg.worker_id, None)
            if ready:
                await self.on_exit(cfg.worker_id)
        if not self._stopping:
            self.exits += 1
            log.warning("worker %d (pid %d) exited with code %s", cfg.worker_id, proc.pid, code)

    async def _await_ready(self, worker_id: int, stdout: asyncio.StreamReader) -> bool:
        while True:
            line = await stdout.readline()
            if not line:
                return False
            text = line.decode(errors="replace")
            if text.startswith(READY_PREFIX):
                await self.on_ready(_decode_info(text[len(READY_PREFIX) :]))
                return True
            sys.stdout.write(text)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every worker, wait, SIGKILL what is left; end the slot tasks."""
        self._stopping = True
        procs = list(self.procs.values())
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        if procs:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)
            for proc in procs:
                if proc.returncode is None:
                    _signal(proc, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def pids(self) -> dict[int, int]:
        return {wid: p.pid for wid, p in self.procs.items()}


def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    if proc.returncode is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
