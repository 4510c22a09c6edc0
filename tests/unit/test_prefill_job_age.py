"""A sealed prefill job stays openable as long as its decode worker may wait for it:
the JetStream queue's job age follows --remote-prefill-timeout (kvmesh.worker.disagg)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvmesh.config import WorkerConfig
from kvmesh.disagg.queue import MAX_JOB_AGE_S
from kvmesh.runtime.auth import SECRET_ENV
from kvmesh.worker.disagg import _queue

pytestmark = pytest.mark.timeout(30)


class _Runtime:
    nats = object()  # a connected client; nothing is sent while the queue is built

    class config:
        namespace = "kvmesh"


@pytest.mark.parametrize("timeout_s", [30.0, 600.0])
async def test_the_job_age_covers_the_remote_prefill_timeout(monkeypatch: pytest.MonkeyPatch, timeout_s: float) -> None:
    monkeypatch.setenv(SECRET_ENV, os.urandom(32).hex())
    cfg = dataclasses.replace(WorkerConfig(), mode="decode", remote_prefill_timeout_s=timeout_s)
    queue = await _queue(cfg, _Runtime())
    window = queue._seal.window_s  # type: ignore[attr-defined]
    assert window >= MAX_JOB_AGE_S
    assert window > timeout_s  # a job waited on for the whole timeout is still openable
