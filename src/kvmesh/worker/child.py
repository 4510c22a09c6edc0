"""A worker process's entry: from a :class:`~kvmesh.config.WorkerConfig` object, never
from argv.

``kvmesh worker`` calls :func:`run_worker` after parsing its flags; a worker that
``kvmesh run`` forks calls it with the parent's config object; a replacement the
supervisor starts with exec (``python -m kvmesh.worker.child``) reads its config
object from stdin (pickled by its own parent, over a pipe nobody else holds).

A worker that cannot start writes one line to stdout, ``KVMESH_FAILED <message>``
(the engine's own error, whatever the engine), and exits 1: the supervisor reads it
as it reads the READY line, and ``kvmesh run`` prints it when it gives up.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvmesh.config import RuntimeConfig, WorkerConfig, debug_enabled
from kvmesh.errors import KvmeshError

__all__ = ["run_worker", "event_loop_runner", "FAILED_PREFIX", "one_line"]

T = TypeVar("T")
FAILED_PREFIX = "KVMESH_FAILED "
_MAX_LINE = 2000


def event_loop_runner() -> Callable[[Coroutine[Any, Any, T]], T]:
    """``uvloop.run`` when uvloop is installed, else ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run
    run: Callable[[Coroutine[Any, Any, T]], T] = uvloop.run
    return run


def one_line(exc: BaseException) -> str:
    """An exception as one bounded line: a KvmeshError's message, else ``Type: text``."""
    text = exc.message if isinstance(exc, KvmeshError) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 3] + "..."


def _report_failure(message: str) -> None:
    print(f"kvmesh worker: {message}", file=sys.stderr)
    try:
        sys.stdout.write(f"{FAILED_PREFIX}{message}\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # pragma: no cover - stdout gone
        pass


def run_worker(cfg: WorkerConfig, runtime_cfg: RuntimeConfig | None = None, die_with_parent: bool = False) -> int:
    from kvmesh.worker.main import die_with_parent as _die_with_parent, serve

    if cfg.replicas > 1:
        from kvmesh.worker.replicas import serve as serve_many

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvmesh.observability import tracing  # trace ids in log lines; OTLP export when OTEL_EXPORT_ENABLED=1

    tracing.setup("kvmesh-worker")
    if die_with_parent:
        _die_with_parent()
    try:
        event_loop_runner()(serve_many(cfg, runtime_cfg) if cfg.replicas > 1 else serve(cfg, runtime_cfg))
    except OSError as exc:
        _report_failure(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}")
        return 1
    except Exception as exc:  # noqa: BLE001 - any engine's start-up error, reported the same way
        if debug_enabled():
            traceback.print_exc()
        _report_failure(one_line(exc))
        return 1
    finally:
        tracing.shutdown()  # a forked worker leaves with os._exit: no atexit
    return 0


def main() -> int:
    """``python -m kvmesh.worker.child``: a static worker of ``kvmesh run``, its
    config pickled on stdin."""
    import pickle  # here, not at the top: the frontend imports this module too

    cfg = pickle.load(sys.stdin.buffer)
    if not isinstance(cfg, WorkerConfig):
        print("kvmesh worker: stdin holds no WorkerConfig", file=sys.stderr)
        return 2
    return run_worker(cfg, None, die_with_parent=True)


if __name__ == "__main__":
    sys.exit(main())
