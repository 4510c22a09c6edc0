"""Serving the ASGI app with uvicorn on a socket bound beforehand (so a taken port is
reported before anything else starts)."""

from __future__ import annotations

import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["bind_http", "make_server"]


class _NoDelayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with TCP_NODELAY set on every connection, so SSE
    events leave as soon as they are written."""

    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass


def bind_http(host: str, port: int) -> socket.socket:
    """Bind and listen; OSError (e.g. address in use) propagates to the caller."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def make_server(app, log_level: str = "warning") -> uvicorn.Server:  # type: ignore[no-untyped-def]
    config = uvicorn.Config(
        app,
        http=_NoDelayProtocol,
        lifespan="on",
        access_log=False,
        log_level=log_level,
        timeout_keep_alive=30,
        backlog=2048,
    )
    return uvicorn.Server(config)
