"""What ``kvmesh replay`` (policies) and ``kvmesh replay --arms`` do alike: read the
trace window the flags name, report a one-line failure, write the per-result JSON file."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvmesh.replay.settings import ReplaySettings
    from kvmesh.replay.trace import TraceRequest

__all__ = ["PROG", "fail", "read_trace", "write_json"]

PROG = "kvmesh replay"


class _Result(Protocol):
    def to_json(self) -> dict[str, object]: ...


def fail(message: str, status: int) -> int:
    """Print ``message`` as one line on stderr; returns ``status`` (the exit status)."""
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


def read_trace(path: str, window: ReplaySettings) -> list[TraceRequest] | int:
    """The window of the trace at ``path`` that ``--start-ms``, ``--duration-ms`` and
    ``--limit`` name; or the exit status (1) of a trace that cannot be read, its line printed."""
    from kvmesh.replay.trace import TraceError, load_trace

    try:
        return load_trace(path, start_ms=window.start_ms, duration_ms=window.duration_ms, limit=window.limit)
    except TraceError as exc:
        return fail(str(exc), 1)


def write_json(path: str | None, results: Sequence[_Result]) -> int | None:
    """``results`` as a JSON list in ``path`` (nothing when None); an exit status when
    the file cannot be written, else None."""
    if path is None:
        return None
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump([r.to_json() for r in results], f, indent=2)
            f.write("\n")
    except OSError as exc:
        return fail(f"cannot write {path}: {exc.strerror or exc}", 1)
    return None
