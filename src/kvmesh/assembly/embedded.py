"""``kvmesh run``'s process: one process serves HTTP and supervises N worker
processes; no etcd, no NATS.

Start-up order is chosen for time-to-first-completion: :func:`prepare` checks the
model folder and binds the HTTP port (both fail fast with one line), and forks the
workers before the event loop exists (:func:`kvmesh.worker.supervisor.prefork`);
:func:`serve` then starts their supervisors, and only then imports and builds the HTTP
stack, while the workers start in parallel. So this module imports little at its top
(what the forked workers share); the planner, the prefill queue and the HTTP stack are
imported where a run first needs them, after the fork.

What :func:`serve` builds, in order (nothing is patched after it is built):

1. the run's runtime over in-process discovery, and the :class:`~kvmesh.assembly.records.Roster`
   (the parent's half of its workers' registration: their records in that discovery);
2. disaggregated runs: the global prefill queue, served on the request plane;
3. the supervisors (not started), and with ``--planner`` the planner's
   :class:`~kvmesh.assembly.embedded_fleet.EmbeddedFleet` over them;
4. the supervisors started, reporting to the roster (and through it to the fleet);
5. the frontend over the run's discovery (:mod:`kvmesh.assembly.frontend`), the planner
   attached to it; served until a signal, or until a supervisor gives up;
6. on the way out: planner, frontend, workers (drained), runtime.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvmesh.assembly.records import MODEL_ID_STRIDE, PREFILL_FIRST_ID, Roster
from kvmesh.config import ModelFleet, RunConfig, RuntimeConfig
from kvmesh.errors import KvmeshError
from kvmesh.frontend.server import bind_http
from kvmesh.preprocess.model import bundled_model_path, load_model_folder
from kvmesh.preprocess.template_check import TemplateCheck
from kvmesh.protocol import DisaggThresholds, KvEndpoint
from kvmesh.runtime import auth
from kvmesh.runtime.distributed import DistributedRuntime
from kvmesh.runtime.event_plane import make_event_plane
from kvmesh.runtime.tcp_server import TcpServer
from kvmesh.worker.supervisor import ForkedWorker, Supervisor, prefork

if TYPE_CHECKING:
    from kvmesh.assembly.embedded_fleet import EmbeddedFleet
    from kvmesh.assembly.frontend import FrontendProcess
    from kvmesh.disagg.queue import PrefillQueue
    from kvmesh.frontend.server import HttpServer
    from kvmesh.planner.service import PlannerService

__all__ = ["Prepared", "prepare", "serve", "StartError"]

log = logging.getLogger("kvmesh.run")


class StartError(Exception):
    """``kvmesh run`` cannot start: one line to print."""


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` did before the event loop: the config with its model
    folders resolved, the bound HTTP socket, the forked workers (one list per model), the
    forked check of the models' chat templates."""

    cfg: RunConfig
    sock: socket.socket
    preforked: list[list[ForkedWorker]]
    templates: TemplateCheck


def prepare(cfg: RunConfig) -> Prepared:
    """Check the model folders, bind the HTTP port, set the cluster secret, fork the
    aggregated workers; :class:`StartError` with one line if it cannot."""
    cfg = _resolve_folders(cfg)
    host, port = cfg.frontend.http_host, cfg.frontend.http_port
    try:
        sock = bind_http(host, port)
    except OSError as exc:
        raise StartError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from exc
    own_cluster_secret()
    preforked = _fork_workers(cfg, sock)
    # jinja2 and the templates' compile in a process of their own, off the frontend's path
    templates = TemplateCheck.fork([(f.worker.model_path or "", f.worker.served_model_name) for f in cfg.fleets])
    return Prepared(cfg, sock, preforked, templates)


def _resolve_folders(cfg: RunConfig) -> RunConfig:
    """Every model's folder checked and made explicit (default: the bundled model), and
    its served name fixed; two models under one name are refused. The workers publish
    KV events only where the frontend subscribes (``--router-mode kv``)."""
    names: set[str] = set()
    publish = cfg.frontend.router_mode == "kv"  # the only mode whose frontend subscribes to the workers' KV events

    def resolved(fleet: ModelFleet) -> ModelFleet:
        path = fleet.worker.model_path or str(bundled_model_path())
        try:
            folder = load_model_folder(path)  # checked whatever the name: a bad folder is one line now
        except KvmeshError as exc:
            raise StartError(exc.message) from exc
        name = fleet.worker.served_model_name or folder.name
        if name in names:
            raise StartError(f"two models are served as {name!r}: give each [[models]] table its own name")
        names.add(name)
        worker = dataclasses.replace(fleet.worker, model_path=path, served_model_name=name, publish_events=publish)
        return dataclasses.replace(fleet, worker=worker)

    if not cfg.models:
        return dataclasses.replace(cfg, worker=resolved(cfg.fleets[0]).worker)
    return dataclasses.replace(cfg, models=tuple(resolved(f) for f in cfg.models))


def own_cluster_secret() -> None:
    """Without a cluster secret given, make a random one for this run's own processes
    (the workers inherit it through the environment): every internal connection of
    the embedded fleet is then authenticated, with nothing to configure."""
    if not os.environ.get(auth.SECRET_FILE_ENV) and not os.environ.get(auth.SECRET_ENV):
        os.environ[auth.SECRET_ENV] = auth.new_secret_hex()
    auth.process_secret()  # a bad secret file fails here, before anything starts


def _fork_workers(cfg: RunConfig, sock: socket.socket) -> list[list[ForkedWorker]]:
    """Fork the aggregated workers now (each model's ids from its own
    ``MODEL_ID_STRIDE`` range), before this process has an event loop.
    Disaggregated workers are started later: they need the address of the prefill
    queue this process serves."""
    if cfg.disaggregated:
        return []
    if cfg.frontend.router_mode == "kv":
        import kvmesh.runtime.event_plane.zmq  # noqa: F401 - the KV event subscriber, as the workers publish

    per = cfg.workers_per_process
    return [
        prefork(f.worker, f.workers + _spares(cfg), first_id=i * MODEL_ID_STRIDE, close=[sock], per_process=per)
        for i, f in enumerate(cfg.fleets)
    ]


def _spares(cfg: RunConfig) -> int:
    return cfg.planner.hot_spares if cfg.planner.planner else 0


async def serve(prepared: Prepared, log_level: str) -> str | None:
    """Run until a signal (None), or until a supervisor gives up (its error)."""
    cfg = prepared.cfg
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory"))
    await runtime.start()
    roster = Roster(runtime)
    supervisors: list[Supervisor] = []
    try:
        supervisors, fleet = await _workers(cfg, runtime, roster, prepared.preforked)
        for one in supervisors:
            one.start(roster.events(fleet))
        broken = await _serve_frontend(cfg, prepared, log_level, runtime, supervisors, fleet)
    finally:
        for one in supervisors:
            await one.stop()
        await runtime.shutdown()
    failed = [one.error for one in supervisors if one.failed.is_set()]
    return broken or (failed[0] if failed else None)


async def _workers(
    cfg: RunConfig, runtime: DistributedRuntime, roster: Roster, preforked: list[list[ForkedWorker]]
) -> tuple[list[Supervisor], EmbeddedFleet | None]:
    """The supervisors (not started) of each model's aggregated workers (``preforked``
    already), or (``--prefill-workers``/``--decode-workers``) decode and prefill ones
    sharing this process's prefill queue; under the planner, its fleet over them (a
    lost worker is replaced by the planner, not restarted by its supervisor)."""
    limit, restart = cfg.max_failed_starts, not cfg.planner.planner
    queue: PrefillQueue | None = None
    if not cfg.disaggregated:
        supervisors = [
            Supervisor(f.worker, f.workers + _spares(cfg), first_id=i * MODEL_ID_STRIDE, preforked=forked,
                       max_failed_starts=limit, restart=restart, per_process=cfg.workers_per_process)
            for i, (f, forked) in enumerate(zip(cfg.fleets, preforked))
        ]  # fmt: skip
    else:
        address, queue = await _serve_prefill_queue(cfg, runtime, roster)
        decode = dataclasses.replace(cfg.worker, mode="decode", prefill_queue=f"tcp://{address}")
        prefill = dataclasses.replace(cfg.worker, mode="prefill", prefill_queue=f"tcp://{address}")
        supervisors = [
            Supervisor(decode, cfg.decode_workers + _spares(cfg), max_failed_starts=limit, restart=restart),
            Supervisor(prefill, cfg.prefill_workers, first_id=PREFILL_FIRST_ID, max_failed_starts=limit,
                       restart=restart),
        ]  # fmt: skip
    if not cfg.planner.planner:
        return supervisors, None
    from kvmesh.assembly.planner import embedded_fleet  # the planner's modules: only for a planned run

    tokens = _queue_tokens(queue) if queue is not None else None
    return supervisors, embedded_fleet(cfg, roster, supervisors[0], supervisors[1] if len(supervisors) > 1 else None, tokens)


def _queue_tokens(queue: PrefillQueue) -> Callable[[], Awaitable[int]]:
    async def tokens() -> int:
        return (await queue.status()).tokens

    return tokens


async def _serve_prefill_queue(cfg: RunConfig, runtime: DistributedRuntime, roster: Roster) -> tuple[str, PrefillQueue]:
    """The run's global prefill queue (in this process), and the decode workers' KV
    endpoints from the roster (a planner's hot spare too: its canaries may prefill
    remotely), for the workers to reach over TCP."""
    from kvmesh.disagg.queue import LocalPrefillQueue, serve_queue  # disaggregated runs only

    async def kv_metadata(worker_id: int) -> KvEndpoint | None:
        return roster.kv_endpoint(worker_id)

    w = cfg.worker
    queue = LocalPrefillQueue(DisaggThresholds(w.max_local_prefill_length, w.max_prefill_queue_size, w.max_prefill_queue_tokens))
    server = TcpServer(w.host, 0)
    serve_queue(server, queue, kv_metadata)
    await server.start()
    runtime.add_closer(server.close)
    return server.address, queue


async def _serve_frontend(
    cfg: RunConfig,
    prepared: Prepared,
    log_level: str,
    runtime: DistributedRuntime,
    supervisors: list[Supervisor],
    fleet: EmbeddedFleet | None,
) -> str | None:
    """The frontend over the run's discovery (and the planner over it), until a signal
    or a supervisor gives up, or a model's chat template does not compile (its error).
    The templates are checked in a forked process (:mod:`kvmesh.preprocess.template_check`),
    so jinja2 is off the frontend's way to its first completion; the frontend compiles
    its own copy on the first chat request."""
    from kvmesh.assembly import frontend as http  # the HTTP stack: imported while the workers start

    http.ignore_stop_signals()  # from here on: the workers' orderly stop must not be cut short
    # only the kv router subscribes to the workers' KV events
    events = make_event_plane("zmq", host=cfg.worker.host) if cfg.frontend.router_mode == "kv" else None
    models = [(f.worker.model_path or "", f.worker.served_model_name) for f in cfg.fleets]
    process = await http.FrontendProcess.over_discovery(cfg.frontend, runtime, events, models, defer_templates=True)
    if not gc.isenabled():  # off since kvmesh run started (cli/main.py): the frontend is built
        gc.freeze()  # its objects live as long as it does: none of them is collected on the way to the first completion
        gc.enable()
    broken: list[str] = []
    planner: PlannerService | None = None
    if fleet is not None:
        from kvmesh.assembly.planner import plan_embedded

        planner = plan_embedded(cfg, fleet, process.frontend, runtime)
    try:
        await process.serve(
            prepared.sock, log_level,
            lambda server: _announce(cfg, process, server, prepared.templates, broken),
            lambda server: _give_up(supervisors, server),
        )  # fmt: skip
    finally:
        if planner is not None and fleet is not None:
            await planner.close()
            await fleet.close()
        await process.close()
    return broken[0] if broken else None


async def _give_up(supervisors: list[Supervisor], server: HttpServer) -> None:
    """Stop serving once a supervisor gives up on a crash loop (kvmesh run then exits
    1 with the worker's error)."""
    waits = [asyncio.ensure_future(one.failed.wait()) for one in supervisors]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    server.should_exit = True


async def _announce(
    cfg: RunConfig, process: FrontendProcess, server: HttpServer, templates: TemplateCheck, broken: list[str]
) -> None:
    """Once serving with a ready worker and the templates' check passed: the serving
    line. A template that does not compile stops the run instead, as soon as the check
    tells (a slow engine's load is not waited for): its error in ``broken``."""
    registry = process.frontend.registry
    check = asyncio.ensure_future(templates.result())
    while not (server.started and registry.ready()) and not (check.done() and check.result() is not None):
        await asyncio.sleep(0.02)
    error = await check
    if error is not None:
        broken.append(error)
        server.should_exit = True
        return
    host, port = cfg.frontend.http_host, cfg.frontend.http_port
    if port == 0:
        port = server.servers[0].sockets[0].getsockname()[1]
    for fleet in cfg.fleets:
        print(f"kvmesh: serving {fleet.worker.served_model_name!r} at http://{host}:{port}/v1 ({_fleet(cfg, fleet)})",
              flush=True)  # fmt: skip
    _release_start_memory()


def _release_start_memory() -> None:
    """Once serving: hand the heap the start freed (imports, the parser, the model folder)
    back to the OS, ~0.7 MiB of the idle frontend's RSS (issue 36). glibc only."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _fleet(cfg: RunConfig, fleet: ModelFleet) -> str:
    engine = fleet.worker.engine
    if cfg.disaggregated:
        return f"{cfg.decode_workers} decode + {cfg.prefill_workers} prefill {engine} workers"
    per, workers = cfg.workers_per_process, fleet.workers
    where = f" in {-(-workers // per)} processes" if per > 1 else ""
    return f"{workers} {engine} worker{'s' if workers > 1 else ''}{where}"
