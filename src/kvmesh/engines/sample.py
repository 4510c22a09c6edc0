"""A minimal engine that follows the contract: it echoes the prompt back, one token per
step. Read it next to :mod:`kvmesh.engines.base`; run it with the conformance kit::

    python -c "import asyncio; from kvmesh.engines.sample import EchoEngine; \
from kvmesh.testing import run_conformance; asyncio.run(run_conformance(EchoEngine))"
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvmesh.engines.base import Engine
from kvmesh.protocol import EngineConfig, OutputChunk, PreprocessedRequest, Usage
from kvmesh.runtime.context import Context

__all__ = ["EchoEngine"]


class EchoEngine(Engine):
    def __init__(self, step_delay_s: float = 0.001) -> None:
        self._step_delay_s = step_delay_s
        self._started = False

    async def start(self) -> EngineConfig:
        self._started = True
        return EngineConfig(
            model="echo",
            served_model_name="echo",
            context_length=4096,
            kv_block_size=16,
            total_kv_blocks=1024,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
        )

    async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
        limit = request.stop.max_tokens or len(request.token_ids)
        prompt = request.token_ids or [0]
        for i in range(limit):
            if ctx.is_stopped():
                yield OutputChunk.cancelled()
                return
            await asyncio.sleep(self._step_delay_s)
            yield OutputChunk(token_ids=[prompt[i % len(prompt)]])
        yield OutputChunk(
            finish_reason="length",
            usage=Usage(prompt_tokens=len(request.token_ids), completion_tokens=limit),
        )

    async def cleanup(self) -> None:
        self._started = False
