"""Embedded mode: the frontend process starts and supervises its worker processes.

Each worker is its own OS process, so a crash takes down only itself: the supervisor
reports the exit (the frontend drops the instance), waits a backoff and starts a
replacement with a fresh worker id. Workers die with the supervisor's process (Linux
parent-death signal), and :meth:`stop` ends them in order: SIGTERM (graceful drain),
then SIGKILL after a timeout.

A crash loop is not served forever: each worker that exits before it is ready (a
failed start) doubles the backoff (capped at ``max_backoff_s``); a worker that gets
ready resets it. After ``max_failed_starts`` failed starts in a row the supervisor
gives up: :attr:`Supervisor.failed` is set and :attr:`Supervisor.error` holds the
worker's own error on one line (its ``KVMESH_FAILED`` line, the same for every
engine), which ``kvmesh run`` prints before it exits 1. Under the planner (no restarts
here: the planner replaces workers) the failed starts of the workers it launches count
the same way.

Start-up: :func:`prefork` forks the first workers from the ``kvmesh run`` process
before its event loop and HTTP stack exist. There is no exec: a child keeps the
interpreter and the modules already imported, and runs the worker from the parent's
:class:`~kvmesh.config.WorkerConfig` object (no argv). So the workers start in
parallel with the frontend, and each skips an interpreter start. The supervisor
adopts them (:class:`ForkedWorker`); replacements start with exec
(:func:`worker_command`) and read their config object from stdin.

Several workers per process (``--workers-per-process K``, :mod:`kvmesh.worker.replicas`):
each process runs up to K workers with consecutive ids (its config's ``worker_id`` and
``replicas``); it writes one READY line per worker, each reported as it comes, and when
the process ends every one of its workers is reported gone. A replacement process gets
K fresh ids.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import msgspec

from kvmesh.config import WorkerConfig
from kvmesh.protocol import InstanceInfo
from kvmesh.worker.child import FAILED_PREFIX
from kvmesh.worker.registration import READY_PREFIX

__all__ = ["Supervisor", "WorkerEvents", "worker_command", "prefork", "ForkedWorker", "processes", "slot_config"]

log = logging.getLogger("kvmesh.supervisor")

_decode_info = msgspec.json.Decoder(InstanceInfo).decode


class WorkerEvents(Protocol):
    """What a supervisor reports of its workers (each call awaited in turn)."""

    async def on_ready(self, info: InstanceInfo) -> None:
        """A worker is up: its READY line, the card it would register."""
        ...

    async def on_exit(self, worker_id: int) -> None:
        """A worker that was ready has exited."""
        ...

    async def on_failed(self, worker_id: int, why: str) -> None:
        """A worker exited before it was ready (``why``: its KVMESH_FAILED line, or its code)."""
        ...


def worker_command() -> list[str]:
    """A replacement worker: it reads its pickled WorkerConfig from stdin."""
    return [sys.executable, "-m", "kvmesh.worker.child"]


class ForkedWorker:
    """A worker forked by :func:`prefork`. It offers the part of
    ``asyncio.subprocess.Process`` the supervisor uses: ``pid``, ``returncode``,
    ``stdout`` and ``wait()``. :meth:`adopt` runs first, in the event loop."""

    def __init__(self, pid: int, stdout_fd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: asyncio.StreamReader | None = None
        self._stdout_fd = stdout_fd
        self._exited: asyncio.Future[int] | None = None
        self._pidfd = -1

    async def adopt(self) -> None:
        loop = asyncio.get_running_loop()
        self.stdout = reader = asyncio.StreamReader()
        pipe = os.fdopen(self._stdout_fd, "rb", buffering=0)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        self._exited = loop.create_future()
        try:
            self._pidfd = os.pidfd_open(self.pid)  # readable once the child has exited
        except (AttributeError, OSError):  # pragma: no cover - Linux < 5.3
            self._poll()
        else:
            loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> bool:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its code is lost
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return False
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        self.returncode = os.waitstatus_to_exitcode(status)
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(self.returncode)
        return True

    def _poll(self) -> None:
        if not self._reap():
            asyncio.get_running_loop().call_later(0.05, self._poll)

    async def wait(self) -> int:
        if self._exited is None:
            raise RuntimeError("adopt() the forked worker first")
        return await asyncio.shield(self._exited)


def processes(workers: int, per_process: int) -> int:
    """How many processes hold ``workers`` workers, ``per_process`` at most in each."""
    return -(-workers // per_process)


def slot_config(template: WorkerConfig, slot: int, workers: int, per_process: int, first_id: int = 0) -> WorkerConfig:
    """The config of process ``slot``: its first worker id and how many workers it runs
    (the last process may run fewer)."""
    replicas = min(per_process, workers - slot * per_process)
    return replace(template, worker_id=first_id + slot * per_process, replicas=replicas)


def prefork(
    template: WorkerConfig, count: int, first_id: int = 0, close: Sequence[socket.socket] = (), per_process: int = 1
) -> list[ForkedWorker]:
    """Fork the processes of workers ``first_id .. first_id + count - 1`` now
    (``per_process`` workers in each), for a :class:`Supervisor` to adopt. Call it
    before this process has an event loop or a thread. ``close``: sockets of this
    process the workers must not hold (the HTTP listener)."""
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    workers = []
    for slot in range(processes(count, per_process)):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker; never returns
            os.close(read_fd)
            _forked_worker_main(slot_config(template, slot, count, per_process, first_id), parent, write_fd, close)
        os.close(write_fd)
        workers.append(ForkedWorker(pid, read_fd))
    return workers


def _forked_worker_main(cfg: WorkerConfig, parent: int, stdout_fd: int, close: Sequence[socket.socket]) -> None:
    code = 1
    try:
        _die_with(parent)
        for sock in close:
            sock.close()  # this process's copy only
        os.dup2(stdout_fd, 1)  # the READY line goes to the supervisor's pipe
        os.close(stdout_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        random.seed()  # not the frontend's random state
        logging.root.handlers.clear()  # the worker sets up its own logging
        from kvmesh.worker.child import run_worker

        code = run_worker(cfg)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - report it, then leave without the parent's atexit
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _die_with(parent: int) -> None:
    """SIGTERM this process when ``parent`` dies (Linux), also if it died already."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Keeps ``count`` workers of ``template`` running from :meth:`start` (which says
    whom to report to) until :meth:`stop`; see the module docstring."""

    def __init__(
        self,
        template: WorkerConfig,
        count: int,
        restart: bool = True,
        backoff_s: float = 0.5,
        startup_timeout_s: float = 60.0,
        first_id: int = 0,
        preforked: Sequence[ForkedWorker] = (),
        max_failed_starts: int = 5,
        max_backoff_s: float = 10.0,
        per_process: int = 1,
    ) -> None:
        self.template = template
        self.count = count  # workers
        self.per_process = per_process
        self.first_id = first_id  # worker ids first_id, first_id + 1, ...; replacements after them
        self.events: WorkerEvents | None = None  # set by start()
        self.restart = restart
        self.backoff_s = backoff_s
        self.startup_timeout_s = startup_timeout_s
        self.procs: dict[int, Any] = {}  # asyncio.subprocess.Process or ForkedWorker
        # first worker id of a process -> that process, forked ahead (see prefork)
        self._preforked = {first_id + i * per_process: proc for i, proc in enumerate(preforked)}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._next_id = first_id + count
        self.exits = 0
        self.max_failed_starts = max_failed_starts
        self.max_backoff_s = max_backoff_s
        self.failed_starts = 0  # in a row, over all slots; a worker that gets ready resets it
        self.failed = asyncio.Event()  # set when the supervisor gives up (see error)
        self.error = ""

    def start(self, events: WorkerEvents) -> None:
        """Start (or adopt) the workers; their ready, exit and failed starts go to ``events``."""
        self.events = events
        for slot in range(processes(self.count, self.per_process)):
            self._tasks.append(asyncio.get_running_loop().create_task(self._keep(slot)))

    def launch(self, template: WorkerConfig | None = None) -> int:
        """Start one more worker (a fresh id, from ``template`` or the supervisor's),
        not restarted when it exits: the planner decides what replaces it. Its ready
        and exit are reported through ``on_ready`` / ``on_exit`` like any other."""
        worker_id = self._next_id
        self._next_id += 1
        cfg = replace(template or self.template, worker_id=worker_id)
        self._tasks.append(asyncio.get_running_loop().create_task(self._run_one(cfg)))
        return worker_id

    async def _run_one(self, cfg: WorkerConfig) -> None:
        try:
            ready, why = await self._run_once(cfg)
        except Exception:  # noqa: BLE001 - keep supervising the others
            log.exception("worker %d failed to run", cfg.worker_id)
            return
        if not ready and not self._stopping:
            log.warning("worker %d did not start: %s", cfg.worker_id, why)
        if not self._stopping:
            self._count_start(ready, why)  # a crash loop under the planner ends the run too

    def terminate(self, worker_id: int) -> bool:
        """SIGTERM ``worker_id`` (it drains, then exits); False if it is not running."""
        proc = self.procs.get(worker_id)
        if proc is None:
            return False
        _signal(proc, signal.SIGTERM)
        return True

    async def _keep(self, slot: int) -> None:
        first = slot_config(self.template, slot, self.count, self.per_process, self.first_id)
        worker_id = first.worker_id
        while not self._stopping:
            cfg = replace(first, worker_id=worker_id)
            try:
                ready, why = await self._run_once(cfg)
            except Exception as exc:  # noqa: BLE001 - keep supervising the other slots
                log.exception("worker %d failed to run", worker_id)
                ready, why = False, f"{type(exc).__name__}: {exc}"
            if self._stopping:
                return
            if not self._count_start(ready, why) or not self.restart:
                return
            await asyncio.sleep(self._delay())
            worker_id = self._next_id
            self._next_id += self.per_process

    def _count_start(self, ready: bool, why: str) -> bool:
        """Count a failed start (or reset the count); False once the supervisor gives up."""
        if ready:
            self.failed_starts = 0
            return True
        self.failed_starts += 1
        if self.failed_starts < self.max_failed_starts:
            return not self.failed.is_set()
        if not self.failed.is_set():
            self.error = f"{self.failed_starts} worker starts in a row failed; the last: {why}"
            log.error("%s", self.error)
            self.failed.set()
        return False

    def _delay(self) -> float:
        """The backoff before the next start: doubled per failed start in a row, capped."""
        if self.failed_starts == 0:
            return self.backoff_s
        return float(min(self.backoff_s * 2 ** (self.failed_starts - 1), self.max_backoff_s))

    async def _run_once(self, cfg: WorkerConfig) -> tuple[bool, str]:
        """Run one worker process to its end: (whether it got ready, why it ended)."""
        proc = self._preforked.pop(cfg.worker_id, None)
        if proc is not None:
            await proc.adopt()
        else:
            proc = await self._exec(cfg)
        self.procs[cfg.worker_id] = proc
        ready: list[int] = []  # the process's workers that got ready
        failure: list[str] = []
        try:
            assert proc.stdout is not None
            # until the pipe closes: READY lines (one per worker), else passed through
            await self._read_output(proc.stdout, ready, failure)
            code = await proc.wait()
        finally:
            self.procs.pop(cfg.worker_id, None)
            for worker_id in ready:
                await self._events.on_exit(worker_id)
        if not self._stopping:
            self.exits += 1
            log.warning("worker %d (pid %d) exited with code %s", cfg.worker_id, proc.pid, code)
        why = failure[-1] if failure else f"the worker exited with code {code} before it was ready"
        if not ready and not self._stopping:
            await self._events.on_failed(cfg.worker_id, why)
        return bool(ready), why

    @property
    def _events(self) -> WorkerEvents:
        if self.events is None:
            raise RuntimeError("Supervisor.start() was not called")
        return self.events

    async def _exec(self, cfg: WorkerConfig) -> Any:
        """A replacement worker: a fresh interpreter, its config object on stdin."""
        proc = await asyncio.create_subprocess_exec(
            *worker_command(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdin is not None
        import pickle  # here: only a replacement worker is sent its config

        proc.stdin.write(pickle.dumps(cfg))
        try:
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):  # it died already: its exit says why
            pass
        proc.stdin.close()
        return proc

    async def _read_output(self, stdout: asyncio.StreamReader, ready: list[int], failure: list[str]) -> None:
        while True:
            line = await stdout.readline()
            if not line:
                return
            text = line.decode(errors="replace")
            if text.startswith(READY_PREFIX):
                info = _decode_info(text[len(READY_PREFIX) :])
                ready.append(info.worker_id)
                await self._events.on_ready(info)
                continue
            if text.startswith(FAILED_PREFIX):
                failure.append(text[len(FAILED_PREFIX) :].strip())
                continue
            sys.stdout.write(text)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every worker, wait, SIGKILL what is left; end the slot tasks."""
        self._stopping = True
        for proc in self._preforked.values():  # forked, never adopted (start-up failed)
            _signal(proc, signal.SIGTERM)
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


def _signal(proc: Any, sig: int) -> None:
    if proc.returncode is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
