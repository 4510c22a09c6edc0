"""The worker process: load the model folder, start the engine, serve, drain on signal.

Kept light on imports (no HTTP stack, no tokenizer) so a worker is up fast.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from typing import TextIO

import msgspec

from kvmesh.config import WorkerConfig
from kvmesh.engines.base import Engine
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.events import EventPublisher, NullPublisher
from kvmesh.worker.service import WorkerService

__all__ = ["READY_PREFIX", "build_engine", "serve", "die_with_parent"]

log = logging.getLogger("kvmesh.worker")

READY_PREFIX = "KVMESH_READY "


def build_engine(cfg: WorkerConfig, publisher: EventPublisher | None = None) -> tuple[Engine, str]:
    """The engine ``cfg`` names, over the model folder it names (default: bundled)."""
    from kvmesh.preprocess.model import bundled_model_path, load_model_folder

    model_path = cfg.model_path or str(bundled_model_path())
    model = load_model_folder(model_path)
    if cfg.engine == "mocker":
        from kvmesh.engines.mocker import MockerEngine, MockerOptions

        m = cfg.mocker
        options = MockerOptions(
            block_size=m.block_size,
            num_blocks=m.num_blocks,
            max_num_seqs=m.max_num_seqs,
            max_num_batched_tokens=m.max_num_batched_tokens,
            speedup=m.speedup,
            vocab_size=model.vocab_size,
            eos_token_ids=tuple(model.eos_token_ids),
            special_token_ids=model.special_token_ids,
            context_length=model.context_length,
            worker_id=cfg.worker_id,
            model=model_path,
            served_model_name=model.name,
        )
        return MockerEngine(options, publisher or NullPublisher()), model_path
    raise ValueError(f"unknown engine {cfg.engine!r}")


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (embedded mode)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


async def serve(cfg: WorkerConfig, ready_out: TextIO = sys.stdout) -> None:
    engine, model_path = build_engine(cfg)
    service = WorkerService(engine, cfg.host, cfg.port, validate=cfg.validate_streams)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        config = await service.start()
        info = InstanceInfo(cfg.worker_id, service.address, config, model_path, os.getpid())
        ready_out.write(READY_PREFIX + msgspec.json.encode(info).decode() + "\n")
        ready_out.flush()
        await stop.wait()
        log.info("worker %d draining", cfg.worker_id)
    finally:
        await service.shutdown(cfg.grace_s)
