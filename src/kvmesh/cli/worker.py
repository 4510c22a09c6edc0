"""``kvmesh worker``: one worker process."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from kvmesh.config import RuntimeConfig, WorkerConfig
from kvmesh.errors import KvmeshError

__all__ = ["run_worker", "event_loop_runner"]


T = TypeVar("T")


class _Runner(Protocol):
    def __call__(self, main: Coroutine[Any, Any, T], /) -> T: ...


def event_loop_runner() -> _Runner:
    """``uvloop.run`` when uvloop is installed, else ``asyncio.run``."""
    try:
        import uvloop

        return uvloop.run
    except ImportError:  # pragma: no cover
        return asyncio.run


def run_worker(cfg: WorkerConfig, runtime_cfg: RuntimeConfig | None = None, die_with_parent: bool = False) -> int:
    from kvmesh.worker.main import die_with_parent as _die_with_parent, serve

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
    return 0
