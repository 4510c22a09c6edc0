"""How many CPUs this process may really use: the hf engine's default thread count.

``os.cpu_count()`` counts the host's cores; a container or a pinned process gets
fewer. :func:`auto_threads` takes the smallest of the CPU affinity mask
(``sched_getaffinity``) and the cgroup CPU quota (v2 ``cpu.max`` of this process's
cgroup and its ancestors, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``),
rounded down and at least 1. More torch threads than that only queue for the same
cores (and OpenMP's spinning barriers make an oversubscribed pass slower, not faster).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["auto_threads", "threads_for", "affinity_cpus", "cgroup_cpus", "parse_cpu_max", "parse_cfs"]


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` line (``"200000 100000"`` → 2.0); None: no limit."""
    parts = text.split()
    if len(parts) < 1 or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota: str, period: str) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None: no limit (-1)."""
    try:
        q, p = int(quota.strip()), int(period.strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text("ascii")
    except (OSError, UnicodeDecodeError):
        return None


def _v2_dirs(root: Path, proc_cgroup: str | None) -> list[Path]:
    """The v2 cgroup directories whose ``cpu.max`` bound this process: its own and its ancestors'."""
    dirs = [root]
    for line in (proc_cgroup or "").splitlines():
        if line.startswith("0::"):
            d = root
            for part in Path(line[3:].strip()).parts[1:]:
                d = d / part
                dirs.append(d)
    return dirs


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota of this process's cgroups (v2, then v1); None: no quota."""
    limits = []
    for d in _v2_dirs(root, _read(proc_cgroup)):
        text = _read(d / "cpu.max")
        if text is not None and (cpus := parse_cpu_max(text)) is not None:
            limits.append(cpus)
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        quota, period = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
        if quota is not None and period is not None and (cpus := parse_cfs(quota, period)) is not None:
            limits.append(cpus)
    return min(limits) if limits else None


def affinity_cpus() -> int:
    """CPUs this process may be scheduled on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_for(affinity: int, quota: float | None) -> int:
    """min(affinity, floor(quota)), at least 1 (pure)."""
    cpus = affinity if quota is None else min(affinity, math.floor(quota))
    return max(1, cpus)


def auto_threads() -> int:
    """Threads for the forward pass on the CPUs this process really has."""
    return threads_for(affinity_cpus(), cgroup_cpus())
