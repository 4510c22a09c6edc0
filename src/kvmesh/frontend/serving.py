"""Which HTTP server serves the app: the own one (:mod:`.server`), or aiohttp's
(:mod:`.aiohttp_server`, ``KVMESH_HTTP_SERVER=aiohttp``, measurement only). Above both,
so that neither imports the other."""

from __future__ import annotations

import os

from kvmesh.config import HttpLimits
from kvmesh.frontend import server
from kvmesh.frontend.server import HttpApp, HttpServer, ServerConfig

__all__ = ["make_server"]


def make_server(app: HttpApp, log_level: str = "warning", limits: HttpLimits | None = None) -> HttpServer:
    """The server for ``app`` (``log_level`` sets the server's logger). The seam:
    ``KVMESH_HTTP_SERVER=aiohttp`` serves the same app with aiohttp's low-level server
    instead (for the comparison in docs/performance.md only)."""
    server.log.setLevel(log_level.upper())
    config = ServerConfig(limits=limits or app.limits)
    if os.environ.get("KVMESH_HTTP_SERVER", "own") == "aiohttp":
        from kvmesh.frontend.aiohttp_server import AiohttpServer

        return AiohttpServer(app, config)  # type: ignore[return-value]  # duck-typed stand-in, measurement only
    return HttpServer(app, config)
