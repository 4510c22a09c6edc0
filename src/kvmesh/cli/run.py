"""``kvmesh run``: the embedded mode. One process serves HTTP and supervises N worker
processes; no etcd, no NATS. The process is built by :mod:`kvmesh.assembly.embedded`;
this is its command: refuse an exposed API, set up logging and tracing, print a
failure on one line."""

from __future__ import annotations

import atexit
import logging
import sys

from kvmesh.assembly import embedded
from kvmesh.cli.frontend import exposure_refusal
from kvmesh.config import RunConfig
from kvmesh.errors import KvmeshError
from kvmesh.observability import tracing
from kvmesh.worker.child import event_loop_runner

__all__ = ["run_embedded"]


def _fail(message: str) -> int:
    print(f"kvmesh run: {message}", file=sys.stderr)
    return 1


def run_embedded(cfg: RunConfig, log_level: str = "warning") -> int:
    refusal = exposure_refusal(cfg.frontend)
    if refusal is not None:
        print(f"kvmesh run: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run = event_loop_runner()
    try:
        prepared = embedded.prepare(cfg)  # the workers are forked here, before any event loop
    except embedded.StartError as exc:
        return _fail(str(exc))
    # trace ids in log lines; OTLP export when OTEL_EXPORT_ENABLED=1; after the fork
    # (the workers set up their own exporter)
    tracing.setup("kvmesh-frontend")
    atexit.register(tracing.shutdown)
    try:
        error = run(embedded.serve(prepared, log_level))
    except KvmeshError as exc:
        return _fail(exc.message)
    return 0 if error is None else _fail(error)
