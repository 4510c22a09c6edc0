"""``kvmesh worker``: one worker process (see :mod:`kvmesh.worker.child`)."""

from __future__ import annotations

from kvmesh.worker.child import event_loop_runner, run_worker

__all__ = ["run_worker", "event_loop_runner"]
