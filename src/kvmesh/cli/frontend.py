"""``kvmesh frontend``: the HTTP API for workers found through discovery (or a static
list); the process is built by :mod:`kvmesh.assembly.frontend`. ``exposure_refusal``
(no API open off loopback without keys) is ``kvmesh run``'s check too.

The HTTP stack is imported by :func:`run_frontend` (``kvmesh run`` imports this module
for the check only, before it forks its workers)."""

from __future__ import annotations

import atexit
import ipaddress
import logging
import socket
import sys

from kvmesh.config import FrontendConfig, RuntimeConfig
from kvmesh.errors import KvmeshError
from kvmesh.observability import tracing
from kvmesh.worker.child import event_loop_runner

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
    tracing.setup("kvmesh-frontend")  # trace ids in log lines; OTLP export when OTEL_EXPORT_ENABLED=1
    atexit.register(tracing.shutdown)
    from kvmesh.frontend.server import bind_http  # the HTTP stack, for this command only

    if cfg.router_shards > 1 and (cfg.router_mode != "kv" or (not static_workers and rcfg.event_plane != "zmq")):
        return _fail("--router-shards above 1 needs --router-mode kv and the zmq event plane (the shards subscribe to "
                     "each worker's own publisher)")
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
    """The frontend process (:mod:`kvmesh.assembly.frontend`) until SIGTERM/SIGINT."""
    from kvmesh.assembly.frontend import FrontendProcess
    from kvmesh.planner.reports import FrontendReporter
    from kvmesh.runtime.distributed import DistributedRuntime
    from kvmesh.runtime.event_plane import make_event_plane

    runtime = None
    if static_workers:
        process = await FrontendProcess.over_static(cfg, rcfg, static_workers, model_path)
    else:
        runtime = DistributedRuntime(rcfg)
        await runtime.start()
        plane = make_event_plane(rcfg.event_plane, nats_client=runtime.nats, namespace=rcfg.namespace, host=rcfg.host)
        process = await FrontendProcess.over_discovery(cfg, runtime, plane, model_path)
        await process.share_tenant_budget(runtime)
        # its counters for kvmesh planner (arrivals, TTFT/ITL), signed, in discovery
        process.sources.append(FrontendReporter(runtime, process.frontend.metrics).start())
    try:
        print(f"kvmesh: frontend serving http://{cfg.http_host}:{sock.getsockname()[1]}/v1", flush=True)
        await process.serve(sock, log_level)
    finally:
        await process.close()
        if runtime is not None:
            await runtime.shutdown()
    return 0
