"""``kvmesh worker``: one worker process."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh.config import RuntimeConfig, WorkerConfig
from kvmesh.errors import KvmeshError

__all__ = ["run_worker", "event_loop_runner"]


def event_loop_runner():  # type: ignore[no-untyped-def]
    """``uvloop.run`` when uvloop is installed, else ``asyncio.run``."""
    try:
        import uvloop

        return uvloop.run
    except ImportError:  # pragma: no cover
        return asyncio.run


def run_worker(cfg: WorkerConfig, runtime_cfg: RuntimeConfig | None = None, die_with_parent: bool = False) -> int:
    from kvmesh.worker.main import die_with_parent as _die_with_parent, serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvmesh.observability import tracing  # trace ids in log lines; OTLP export when OTEL_EXPORT_ENABLED=1

    tracing.setup("kvmesh-worker")
    if die_with_parent:
        _die_with_parent()
    try:
        event_loop_runner()(serve(cfg, runtime_cfg))
    except KvmeshError as exc:
        print(f"kvmesh worker: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvmesh worker: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()  # a forked worker leaves with os._exit: no atexit
    return 0
