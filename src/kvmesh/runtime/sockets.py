"""Socket options every request-plane connection gets (TCP and NATS call-home, both ends).

A peer cut off without a word (its link down, its host gone) sends no FIN or RST, so
TCP alone would wait for minutes. Keep-alive probes after ``KEEPALIVE_IDLE_S`` without
traffic, ``KEEPALIVE_COUNT`` of them ``KEEPALIVE_INTERVAL_S`` apart, and
``USER_TIMEOUT_S`` for data sent but never acknowledged, close such a connection in
about 5 s, whether it was idle, streaming to us, or waiting on us: its streams then end
as ``Disconnected`` and the frontend migrates them. A live peer acknowledges the
probes (one every 2 s on an idle connection), however slowly it generates.
"""

from __future__ import annotations

import socket

__all__ = ["tune_stream_socket"]

KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 3
USER_TIMEOUT_S = 6


def tune_stream_socket(sock: socket.socket | None) -> None:
    """No Nagle delay, and dead-peer detection as the module docstring says."""
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
