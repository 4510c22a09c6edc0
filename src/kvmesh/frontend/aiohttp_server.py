"""The same :class:`~kvmesh.frontend.server.HttpApp` served by aiohttp's low-level
``web.Server`` in our event loop: the other side of the HTTP-server seam, kept for
the measurement in docs/performance.md (``KVMESH_HTTP_SERVER=aiohttp``; aiohttp is
not a dependency of kvmesh: install it to use this).

The seam is what the routes already use: ``app.handle(Request)`` returns a
:class:`Response` or a streaming response whose ``send_to(out)`` writes through a
response-stream object (``start``/``write``/``end``/``paused``/``drain``/
``disconnected``). Here ``write`` collects events and ``drain`` sends them with
aiohttp's own ``StreamResponse.write`` (``paused`` is always true, so the SSE writer
awaits once per event: aiohttp's writes are coroutines).

Not for production: client disconnects are not reported to streams (aiohttp no
longer cancels handlers on disconnect by default), and none of the own server's
limits beyond aiohttp's own apply.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from kvmesh.frontend.server import ExitFlag, HttpApp, Request, Response, ServerConfig, _install_signals, _restore_signals

__all__ = ["AiohttpServer"]


class _Out:
    """The response-stream side of the seam over an aiohttp StreamResponse."""

    __slots__ = ("_request", "_response", "_pending", "ended", "disconnected", "on_disconnect", "paused", "_started")

    def __init__(self, request: Any, response: Any) -> None:
        self._request = request
        self._response = response
        self._pending: list[bytes] = []
        self._started = False
        self.ended = False
        self.disconnected = False
        self.on_disconnect = None
        self.paused = True  # every write is followed by drain(): aiohttp writes are awaited

    @property
    def head_pending(self) -> bool:
        return not self._started

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._response.set_status(status)
        for name, value in headers:
            self._response.headers[name.decode("latin-1")] = value.decode("latin-1")

    def write(self, data: bytes) -> None:
        if data and not self.ended:
            self._pending.append(data)

    def end(self, data: bytes = b"") -> None:
        if not self.ended:
            self.write(data)
            self.ended = True

    async def drain(self) -> None:
        if not self._started:
            self._started = True
            await self._response.prepare(self._request)
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            try:
                await self._response.write(data)
            except (ConnectionResetError, RuntimeError):
                self.disconnected = True

    async def finish(self) -> None:
        await self.drain()
        if not self.disconnected:
            await self._response.write_eof()


class AiohttpServer(ExitFlag):
    """Same surface as :class:`~kvmesh.frontend.server.HttpServer` (``serve``,
    ``should_exit``, ``started``, ``servers``, ``config``)."""

    def __init__(self, app: HttpApp, config: ServerConfig | None = None) -> None:
        self.app = app
        self.config = config or ServerConfig()
        self.servers: list[asyncio.AbstractServer] = []
        self.started = False
        self._exit = asyncio.Event()

    async def serve(self, sockets: list[socket.socket]) -> None:
        from aiohttp import web

        loop = asyncio.get_running_loop()
        previous = _install_signals(loop, self._exit.set)
        try:
            async with self.app.lifespan():
                low = web.Server(self._handle, keepalive_timeout=self.config.limits.keepalive_timeout_s)
                for sock in sockets:
                    self.servers.append(await loop.create_server(low, sock=sock, backlog=2048))
                self.started = True
                await self._exit.wait()
                for server in self.servers:
                    server.close()
                await low.shutdown(self.config.timeout_graceful_shutdown or 5.0)
        finally:
            _restore_signals(loop, previous)

    async def _handle(self, req: Any) -> Any:
        from aiohttp import web

        body = await req.read()
        if len(body) > self.app.max_body_bytes:
            return web.Response(status=413, text="request body over the limit")
        headers = {k.lower(): v for k, v in req.headers.items()}
        version = f"{req.version.major}.{req.version.minor}"
        request = Request(req.method, req.path, req.query_string, headers, body, len(body), req.keep_alive, version)
        result = await self.app.handle(request)
        if isinstance(result, Response):
            return web.Response(body=result.body, status=result.status, headers={"content-type": result.content_type, **result.headers})
        response = web.StreamResponse()
        out = _Out(req, response)
        await result.send_to(out)  # type: ignore[arg-type]  # duck-typed stand-in, measurement only
        await out.finish()
        return response
