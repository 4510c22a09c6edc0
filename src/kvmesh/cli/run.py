"""``kvmesh run``: the embedded mode. One process serves HTTP and supervises N worker
processes; no etcd, no NATS.

Start-up order is chosen for time-to-first-completion: check the model folder and
bind the HTTP port (both fail fast with one line), spawn the workers, and only then
import and build the HTTP stack, while the workers start in parallel.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import replace

import msgspec

from kvmesh.config import RunConfig
from kvmesh.errors import KvmeshError

__all__ = ["run_embedded"]

log = logging.getLogger("kvmesh.run")


def _fail(message: str) -> int:
    print(f"kvmesh run: {message}", file=sys.stderr)
    return 1


def run_embedded(cfg: RunConfig, log_level: str = "warning") -> int:
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
    try:
        return event_loop_runner()(_serve(cfg, sock, log_level))
    except KvmeshError as exc:
        return _fail(exc.message)


async def _serve(cfg: RunConfig, sock, log_level: str) -> int:  # type: ignore[no-untyped-def]
    from kvmesh.config import RuntimeConfig
    from kvmesh.runtime.distributed import DistributedRuntime, instance_key
    from kvmesh.runtime.names import COMPONENT, GENERATE
    from kvmesh.worker.supervisor import Supervisor

    # the supervisor publishes its workers in in-process discovery; the frontend
    # watches it exactly as it watches etcd in distributed mode
    runtime = DistributedRuntime(RuntimeConfig(discovery="memory"))
    await runtime.start()
    ns = runtime.config.namespace

    async def on_ready(info):  # type: ignore[no-untyped-def]
        await runtime.discovery.put(instance_key(ns, COMPONENT, GENERATE, info.worker_id), msgspec.json.encode(info))

    async def on_exit(worker_id: int) -> None:
        await runtime.discovery.delete(instance_key(ns, COMPONENT, GENERATE, worker_id))

    supervisor = Supervisor(cfg.worker, cfg.workers, on_ready, on_exit)
    supervisor.start()
    # uvicorn restores and re-raises the signals it caught; these make that a no-op
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        from kvmesh.frontend.app import Frontend
        from kvmesh.frontend.server import make_server
        from kvmesh.frontend.sources import watch_workers

        from kvmesh.runtime.event_plane import make_event_plane

        frontend = Frontend(cfg.frontend, make_event_plane("zmq", host=cfg.worker.host))
        entry = frontend.registry.add_model(cfg.worker.model_path or "")
        watcher = await watch_workers(runtime, frontend.registry)
        server = make_server(frontend.app, log_level)
        server.config.timeout_graceful_shutdown = 5
        announcer = asyncio.get_running_loop().create_task(_announce(cfg, entry.name, server, frontend.registry))
        try:
            await server.serve(sockets=[sock])
        finally:
            announcer.cancel()
            await watcher.close()
    finally:
        await supervisor.stop()
        await runtime.shutdown()
    return 0


async def _announce(cfg: RunConfig, model: str, server, registry) -> None:  # type: ignore[no-untyped-def]
    while not (server.started and registry.ready()):
        await asyncio.sleep(0.02)
    host, port = cfg.frontend.http_host, cfg.frontend.http_port
    if port == 0:
        port = server.servers[0].sockets[0].getsockname()[1]
    print(
        f"kvmesh: serving {model!r} at http://{host}:{port}/v1 "
        f"({cfg.workers} {cfg.worker.engine} worker{'s' if cfg.workers > 1 else ''})",
        flush=True,
    )
