"""``kvmesh frontend``: the HTTP API for workers found through discovery (or a static list)."""

from __future__ import annotations

import atexit
import ipaddress
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

from kvmesh.config import FrontendConfig, RuntimeConfig
from kvmesh.errors import KvmeshError

if TYPE_CHECKING:
    from kvmesh.runtime.distributed import Client

__all__ = ["run_frontend", "exposure_refusal"]


def _fail(message: str) -> int:
    print(f"kvmesh frontend: {message}", file=sys.stderr)
    return 1


def exposure_refusal(cfg: FrontendConfig) -> str | None:
    """Why serving ``cfg`` would open the API to the network without API keys (None: it
    would not). Loopback needs no key; any other address needs keys or the operator's
    word (--allow-unauthenticated, for a proxy that authenticates); ``--admin`` without
    keys is refused off loopback whatever is said."""
    sec, host = cfg.security, cfg.http_host
    if sec.api_keys or _loopback(host):
        return None
    keys = "give API keys (--api-keys-file FILE, or one key in KVMESH_API_KEY)"
    if sec.admin:
        return (f"--admin without API keys on --http-host {host or '(every address)'}: anyone who can reach it could "
                f"crash workers; {keys} and KVMESH_ADMIN_KEY, or serve on 127.0.0.1")  # fmt: skip
    if sec.allow_unauthenticated:
        return None
    return (f"--http-host {host or '(every address)'} without API keys lets anyone who can reach it use the API; {keys}, "
            "serve on 127.0.0.1, or set KVMESH_ALLOW_UNAUTHENTICATED=1 (--allow-unauthenticated) if what stands in "
            "front of kvmesh authenticates its callers")  # fmt: skip


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # "" (every address) or a name that could resolve to anything


def run_frontend(
    cfg: FrontendConfig, rcfg: RuntimeConfig, static_workers: list[str], model_path: str | None, log_level: str = "warning"
) -> int:
    refusal = exposure_refusal(cfg)
    if refusal is not None:
        print(f"kvmesh frontend: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvmesh.observability import tracing  # trace ids in log lines; OTLP export when OTEL_EXPORT_ENABLED=1

    tracing.setup("kvmesh-frontend")
    atexit.register(tracing.shutdown)
    if cfg.router_shards > 1 and (cfg.router_mode != "kv" or (not static_workers and rcfg.event_plane != "zmq")):
        return _fail("--router-shards above 1 needs --router-mode kv and the zmq event plane (the shards subscribe to "
                     "each worker's own publisher)")
    from kvmesh.cli.worker import event_loop_runner
    from kvmesh.frontend.server import bind_http

    try:
        sock = bind_http(cfg.http_host, cfg.http_port)
    except OSError as exc:
        return _fail(f"cannot serve on {cfg.http_host}:{cfg.http_port}: {exc.strerror or exc}")
    try:
        return event_loop_runner()(_serve(cfg, rcfg, static_workers, model_path, sock, log_level))
    except KvmeshError as exc:
        return _fail(exc.message)
    except OSError as exc:
        return _fail(f"cannot reach a runtime service: {exc}")


async def _serve(
    cfg: FrontendConfig, rcfg: RuntimeConfig, static_workers: list[str], model_path: str | None, sock: socket.socket, log_level: str
) -> int:
    from kvmesh.frontend.app import Frontend
    from kvmesh.frontend.serving import make_server
    from kvmesh.frontend.sources import StaticWorkers, watch_workers
    from kvmesh.runtime.distributed import Client, DistributedRuntime

    from kvmesh.runtime.event_plane import make_event_plane

    runtime = None
    if static_workers:
        frontend = Frontend(cfg, make_event_plane("zmq", host=rcfg.host))
    else:
        runtime = DistributedRuntime(rcfg)
        await runtime.start()
        plane = make_event_plane(rcfg.event_plane, nats_client=runtime.nats, namespace=rcfg.namespace, host=rcfg.host)
        frontend = Frontend(cfg, plane)
    if model_path:
        frontend.registry.add_model(model_path)
    source: StaticWorkers | Client  # both: close() when done
    if static_workers:
        static = StaticWorkers(static_workers, frontend.registry)
        await static.start()
        source = static
    else:
        assert runtime is not None
        source = await watch_workers(runtime, frontend.registry)
        from kvmesh.frontend.sources import watch_prefill_workers  # observability: prefill workers' metrics

        runtime.add_closer((await watch_prefill_workers(runtime, frontend.prefill_workers)).close)
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    server = make_server(frontend.app, log_level)
    server.config.timeout_graceful_shutdown = 5
    try:
        print(f"kvmesh: frontend serving http://{cfg.http_host}:{sock.getsockname()[1]}/v1", flush=True)
        await server.serve(sockets=[sock])
    finally:
        await source.close()
        if runtime is not None:
            await runtime.shutdown()
    return 0
