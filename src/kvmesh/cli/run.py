"""``kvmesh run``: the embedded mode. One process serves HTTP and supervises N worker
processes; no etcd, no NATS.

Start-up order is chosen for time-to-first-completion: check the model folder and
bind the HTTP port (both fail fast with one line), fork the workers (before the event
loop exists, see :func:`kvmesh.worker.supervisor.prefork`), and only then import and
build the HTTP stack, while the workers start in parallel.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import signal
import sys
from typing import TYPE_CHECKING
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.config import RunConfig
from kvmesh.errors import KvmeshError

if TYPE_CHECKING:
    import socket
    from collections.abc import Awaitable, Callable

    from kvmesh.frontend.models import ModelRegistry
    from kvmesh.frontend.server import HttpServer
    from kvmesh.protocol import InstanceInfo, KvEndpoint
    from kvmesh.runtime.distributed import DistributedRuntime
    from kvmesh.cli.planner import EmbeddedFleet
    from kvmesh.disagg.queue import PrefillQueue
    from kvmesh.worker.supervisor import ForkedWorker, Supervisor

__all__ = ["run_embedded"]

log = logging.getLogger("kvmesh.run")


def _fail(message: str) -> int:
    print(f"kvmesh run: {message}", file=sys.stderr)
    return 1


def run_embedded(cfg: RunConfig, log_level: str = "warning") -> int:
    from kvmesh.cli.frontend import exposure_refusal

    refusal = exposure_refusal(cfg.frontend)
    if refusal is not None:
        print(f"kvmesh run: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvmesh.cli.worker import event_loop_runner
    from kvmesh.frontend.server import bind_http
    from kvmesh.preprocess.model import bundled_model_path, load_model_folder

    model_path = cfg.worker.model_path or str(bundled_model_path())
    try:
        load_model_folder(model_path)
    except KvmeshError as exc:
        return _fail(exc.message)
    host, port = cfg.frontend.http_host, cfg.frontend.http_port
    try:
        sock = bind_http(host, port)
    except OSError as exc:
        return _fail(f"cannot serve on {host}:{port}: {exc.strerror or exc}")
    cfg = replace(cfg, worker=replace(cfg.worker, model_path=model_path))
    _own_cluster_secret()
    run = event_loop_runner()
    preforked = _fork_workers(cfg, sock)
    # tracing, after the fork (the workers set up their own exporter)
    from kvmesh.observability import tracing  # trace ids in log lines; OTLP export when OTEL_EXPORT_ENABLED=1

    tracing.setup("kvmesh-frontend")
    atexit.register(tracing.shutdown)
    try:
        return run(_serve(cfg, sock, log_level, preforked))
    except KvmeshError as exc:
        return _fail(exc.message)


def _own_cluster_secret() -> None:
    """Without a cluster secret given, make a random one for this run's own processes
    (the workers inherit it through the environment): every internal connection of
    the embedded fleet is then authenticated, with nothing to configure."""
    import os

    from kvmesh.runtime import auth

    if not os.environ.get(auth.SECRET_FILE_ENV) and not os.environ.get(auth.SECRET_ENV):
        os.environ[auth.SECRET_ENV] = auth.new_secret_hex()
    auth.process_secret()  # a bad secret file fails here, before anything starts


def _fork_workers(cfg: RunConfig, sock: socket.socket) -> list[ForkedWorker]:
    """Fork the aggregated workers now, before this process has an event loop; the
    modules both sides use are imported first, once. Disaggregated workers are
    started later: they need the address of the prefill queue this process serves."""
    if cfg.disaggregated:
        return []
    import kvmesh.runtime.distributed  # noqa: F401 - shared with the workers
    from kvmesh.worker.supervisor import prefork

    if cfg.frontend.router_mode == "kv":
        import kvmesh.runtime.event_plane.zmq  # noqa: F401 - the KV event subscriber, as the workers publish

    spares = cfg.planner.hot_spares if cfg.planner.planner else 0
    return prefork(cfg.worker, cfg.workers + spares, close=[sock], per_process=cfg.workers_per_process)


async def _serve(cfg: RunConfig, sock: socket.socket, log_level: str, preforked: list[ForkedWorker]) -> int:
    from kvmesh.config import RuntimeConfig
    from kvmesh.runtime.distributed import DistributedRuntime, instance_key, sign_record
    from kvmesh.runtime.names import COMPONENT, GENERATE, PREFILL_COMPONENT

    # the supervisor publishes its workers in in-process discovery; the frontend
    # watches it exactly as it watches etcd in distributed mode
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory"))
    await runtime.start()
    ns = runtime.config.namespace

    async def on_ready(info: InstanceInfo) -> None:
        key = instance_key(ns, info.component or COMPONENT, GENERATE, info.worker_id)
        await runtime.discovery.put(key, msgspec.json.encode(sign_record(runtime.secret, key, info)))

    async def on_exit(worker_id: int) -> None:
        for component in (COMPONENT, PREFILL_COMPONENT):
            await runtime.discovery.delete(instance_key(ns, component, GENERATE, worker_id))

    fleet = _planned_fleet(cfg, on_ready, on_exit) if cfg.planner.planner else None
    if fleet is not None:  # the planner decides what replaces a worker: it publishes, it is told of exits
        on_ready, on_exit = fleet.on_ready, fleet.on_exit
    supervisors = await _supervisors(cfg, runtime, on_ready, on_exit, preforked, fleet)
    if fleet is not None:
        for one in supervisors:
            one.on_failed = fleet.on_failed
        fleet.main = supervisors[0]
        fleet.prefill = supervisors[1] if len(supervisors) > 1 else None
    for one in supervisors:
        one.start()
    planner = None
    # the HTTP server handles SIGINT/SIGTERM while it serves, then puts these back:
    # a signal during the workers' orderly stop below must not cut it short
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        from kvmesh.frontend.app import Frontend
        from kvmesh.frontend.serving import make_server
        from kvmesh.frontend.sources import watch_workers

        from kvmesh.runtime.event_plane import make_event_plane

        # only the kv router subscribes to the workers' KV events
        events = make_event_plane("zmq", host=cfg.worker.host) if cfg.frontend.router_mode == "kv" else None
        frontend = Frontend(cfg.frontend, events)
        entry = frontend.registry.add_model(cfg.worker.model_path or "")
        watcher = await watch_workers(runtime, frontend.registry)
        from kvmesh.frontend.sources import watch_prefill_workers  # observability: prefill workers' metrics

        prefill_watch = await watch_prefill_workers(runtime, frontend.prefill_workers)
        if fleet is not None:
            from kvmesh.cli.planner import start_embedded_planner

            planner = start_embedded_planner(cfg, fleet, frontend, runtime)
        server = make_server(frontend.app, log_level)
        server.config.timeout_graceful_shutdown = 5
        announcer = asyncio.get_running_loop().create_task(_announce(cfg, entry.name, server, frontend.registry))
        give_up = asyncio.get_running_loop().create_task(_give_up(supervisors, server))
        try:
            await server.serve(sockets=[sock])
        finally:
            announcer.cancel()
            give_up.cancel()
            if planner is not None and fleet is not None:
                await planner.close()
                await fleet.close()
            await watcher.close()
            await prefill_watch.close()
    finally:
        for one in supervisors:
            await one.stop()
        await runtime.shutdown()
    failed = [one.error for one in supervisors if one.failed.is_set()]
    if failed:
        return _fail(failed[0])
    return 0


async def _give_up(supervisors: list[Supervisor], server: Any) -> None:
    """Stop serving once a supervisor gives up on a crash loop (kvmesh run then exits
    1 with the worker's error)."""
    waits = [asyncio.ensure_future(one.failed.wait()) for one in supervisors]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    server.should_exit = True


async def _supervisors(
    cfg: RunConfig,
    runtime: DistributedRuntime,
    on_ready: Callable[[InstanceInfo], Awaitable[None]],
    on_exit: Callable[[int], Awaitable[None]],
    preforked: list[ForkedWorker],
    fleet: EmbeddedFleet | None = None,
) -> list[Supervisor]:
    """The worker processes to keep running: ``workers`` aggregated ones (``preforked``
    already), or (with ``--prefill-workers``/``--decode-workers``) decode and prefill
    ones sharing this process's prefill queue, served on the request plane (whose
    depth in tokens the planner's ``fleet`` reads)."""
    from kvmesh.worker.supervisor import Supervisor

    limit = cfg.max_failed_starts
    # under the planner, a lost worker is replaced by the planner (a spare, or a start)
    restart = not cfg.planner.planner
    spares = cfg.planner.hot_spares if cfg.planner.planner else 0
    if not cfg.disaggregated:
        return [
            Supervisor(
                cfg.worker, cfg.workers + spares, on_ready, on_exit, preforked=preforked, max_failed_starts=limit,
                restart=restart, per_process=cfg.workers_per_process,
            )  # fmt: skip
        ]
    # a hot spare is not in discovery: the queue finds its KV endpoint through the fleet
    address, queue = await _serve_prefill_queue(cfg, runtime, fleet.info_of if fleet is not None else None)
    if fleet is not None:
        fleet.queue_tokens = _queue_tokens(queue)
    decode = replace(cfg.worker, mode="decode", prefill_queue=f"tcp://{address}")
    prefill = replace(cfg.worker, mode="prefill", prefill_queue=f"tcp://{address}")
    return [
        Supervisor(decode, cfg.decode_workers + spares, on_ready, on_exit, max_failed_starts=limit, restart=restart),
        Supervisor(prefill, cfg.prefill_workers, on_ready, on_exit, first_id=1_000_000, max_failed_starts=limit,
                   restart=restart),
    ]  # fmt: skip


def _planned_fleet(
    cfg: RunConfig, publish: Callable[[InstanceInfo], Awaitable[None]], unpublish: Callable[[int], Awaitable[None]]
) -> EmbeddedFleet:
    """The planner's view of the workers about to start: serving ones, then spares."""
    from kvmesh.cli.planner import EmbeddedFleet
    from kvmesh.planner.core import Role

    spares = cfg.planner.hot_spares
    if cfg.disaggregated:
        roles = {i: Role.DECODE for i in range(cfg.decode_workers)}
        roles.update({cfg.decode_workers + i: Role.SPARE for i in range(spares)})
        roles.update({1_000_000 + i: Role.PREFILL for i in range(cfg.prefill_workers)})
    else:
        roles = {i: Role.AGGREGATED for i in range(cfg.workers)}
        roles.update({cfg.workers + i: Role.SPARE for i in range(spares)})
    return EmbeddedFleet(publish, unpublish, roles)


def _queue_tokens(queue: PrefillQueue) -> Callable[[], Awaitable[int]]:
    async def tokens() -> int:
        return (await queue.status()).tokens

    return tokens


async def _serve_prefill_queue(
    cfg: RunConfig, runtime: DistributedRuntime, known: Callable[[int], InstanceInfo | None] | None = None
) -> tuple[str, PrefillQueue]:
    """Embedded mode's global prefill queue (in this process), and the decode workers'
    KV endpoints from this process's discovery (or ``known``: workers not routed to,
    the planner's hot spares), for the workers to reach over TCP."""
    from kvmesh.disagg.queue import LocalPrefillQueue, serve_queue
    from kvmesh.protocol import DisaggThresholds, InstanceInfo
    from kvmesh.runtime.distributed import instance_key
    from kvmesh.runtime.names import COMPONENT, GENERATE
    from kvmesh.runtime.tcp_server import TcpServer

    decode_info = msgspec.json.Decoder(InstanceInfo).decode
    ns = runtime.config.namespace

    async def kv_metadata(worker_id: int) -> KvEndpoint | None:
        key = instance_key(ns, COMPONENT, GENERATE, worker_id)
        value = (await runtime.discovery.get_prefix(key)).get(key)
        if value is not None:
            try:
                return decode_info(value).kv
            except msgspec.DecodeError:
                return None  # not an instance record (the frontend's watch logs it)
        info = known(worker_id) if known is not None else None
        return None if info is None else info.kv

    w = cfg.worker
    queue = LocalPrefillQueue(
        DisaggThresholds(w.max_local_prefill_length, w.max_prefill_queue_size, w.max_prefill_queue_tokens)
    )
    server = TcpServer(w.host, 0)
    serve_queue(server, queue, kv_metadata)
    await server.start()
    runtime.add_closer(server.close)
    return server.address, queue


async def _announce(cfg: RunConfig, model: str, server: HttpServer, registry: ModelRegistry) -> None:
    while not (server.started and registry.ready()):
        await asyncio.sleep(0.02)
    host, port = cfg.frontend.http_host, cfg.frontend.http_port
    if port == 0:
        port = server.servers[0].sockets[0].getsockname()[1]
    print(
        f"kvmesh: serving {model!r} at http://{host}:{port}/v1 "
        f"({_fleet(cfg)})",
        flush=True,
    )


def _fleet(cfg: RunConfig) -> str:
    engine = cfg.worker.engine
    if cfg.disaggregated:
        return f"{cfg.decode_workers} decode + {cfg.prefill_workers} prefill {engine} workers"
    per = cfg.workers_per_process
    where = f" in {-(-cfg.workers // per)} processes" if per > 1 else ""
    return f"{cfg.workers} {engine} worker{'s' if cfg.workers > 1 else ''}{where}"
