"""Runs one engine behind the request plane.

Lifecycle, in order:

1. ``start()``: ``engine.start()``, then serve the ``generate`` endpoint on TCP;
2. serve until ``shutdown()`` (SIGTERM/SIGINT in the worker process);
3. ``shutdown()``: stop accepting → wait for in-flight requests (grace period) →
   ``engine.drain()`` → ``engine.cleanup()`` → close the server.

Each ``generate`` request runs through :func:`kvmesh.engines.adapter.run_generate`:
the cancellation monitor calls ``engine.abort(ctx)`` when the caller stops, and with
``validate`` (tests, ``KVMESH_DEBUG=1``) a stream-contract breach fails loudly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec

from kvmesh.engines.adapter import AbortMonitor, run_generate
from kvmesh.engines.base import Engine
from kvmesh.errors import InvalidArgument
from kvmesh.protocol import EngineConfig, OutputChunk, PreprocessedRequest
from kvmesh.runtime.context import Context
from kvmesh.runtime.tcp_server import TcpServer

__all__ = ["WorkerService", "GENERATE"]

log = logging.getLogger(__name__)

GENERATE = "generate"


class WorkerService:
    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, validate: bool = False) -> None:
        self.engine = engine
        self.server = TcpServer(host, port)
        self.config: EngineConfig | None = None
        self._validate = validate
        self._monitor = AbortMonitor(engine)
        self._decode_request = msgspec.msgpack.Decoder(PreprocessedRequest).decode
        self._closed = False

    async def start(self) -> EngineConfig:
        self.config = await self.engine.start()
        self.server.register(GENERATE, self._generate)
        await self.server.start()
        return self.config

    @property
    def address(self) -> str:
        return self.server.address

    async def _generate(self, payload: bytes, ctx: Context) -> AsyncIterator[OutputChunk]:
        try:
            request = self._decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidArgument(f"malformed generate request: {exc}") from None
        ctx.id = request.request_id
        async for chunk in run_generate(self.engine, request, ctx, self._monitor, self._validate):
            yield chunk

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Graceful: stop accepting, let in-flight requests finish, drain, clean up."""
        if self._closed:
            return
        self._closed = True
        await self.server.stop_accepting()
        if not await self.server.wait_idle(grace_s):
            log.warning("grace period of %.1f s over with %d requests in flight", grace_s, self.server.in_flight)
        try:
            await self.engine.drain()
        finally:
            await self.engine.cleanup()
            await self._monitor.close()
            await self.server.close()
