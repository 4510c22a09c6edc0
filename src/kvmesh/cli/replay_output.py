"""What ``kvmesh replay`` (policies) and ``kvmesh replay --arms`` report alike: a
one-line failure and the per-result JSON file."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Protocol

__all__ = ["PROG", "fail", "write_json"]

PROG = "kvmesh replay"


class _Result(Protocol):
    def to_json(self) -> dict[str, object]: ...


def fail(message: str, status: int) -> int:
    """Print ``message`` as one line on stderr; returns ``status`` (the exit status)."""
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


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
