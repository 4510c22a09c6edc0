"""Connecting to NATS (reconnecting forever once connected), TLS, and the plane's state."""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import weakref
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from kvmesh.errors import CannotConnect

__all__ = ["connect_nats", "nats_tls_context", "plane_settling", "sync_with_server"]

log = logging.getLogger("kvmesh.runtime.nats")


def nats_tls_context(ca_file: str = "", cert_file: str = "", key_file: str = "") -> ssl.SSLContext | None:
    """A client TLS context for NATS from PEM files; None when none is given (a
    ``tls://`` server URL then uses nats-py's default context)."""
    if not (ca_file or cert_file or key_file):
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("a NATS client certificate needs both --nats-cert and --nats-key")
    ctx = ssl.create_default_context(cafile=ca_file or None)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def _redact(servers: str | list[str]) -> str:
    """Server URLs without their user:password (never echoed in a message)."""
    urls = [servers] if isinstance(servers, str) else servers
    return ",".join(re.sub(r"//[^/@]*@", "//***@", u) for u in urls)


async def connect_nats(
    servers: str | list[str],
    *,
    name: str | None = None,
    connect_timeout: float = 2.0,
    first_connect_attempts: int = 3,
    user_credentials: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> NatsClient:
    """Connect to NATS; once connected, reconnect forever (every 0.5 s) after a loss.

    Raises :class:`CannotConnect` when no server answers within about
    ``first_connect_attempts`` × (``connect_timeout`` + 0.5 s). ``user_credentials``
    (a NATS ``.creds`` file) and ``tls`` go to nats-py as they are; a password in a URL
    is never echoed in a message.
    """

    client: list[NatsClient] = []  # set once connected; the callbacks only log
    errors: list[str] = []  # what went wrong while connecting, for the message

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc) or type(exc).__name__)
        log.warning("NATS: %s", exc or type(exc).__name__)

    async def on_disconnected() -> None:
        if client and not client[0].is_closed:
            log.warning("NATS: disconnected; reconnecting")

    async def on_reconnected() -> None:
        log.info("NATS: reconnected")
        if client:
            _reconnected_at[client[0]] = asyncio.get_running_loop().time()

    nc = NatsClient()
    # NOTE: nats-py retries some failures (a TLS certificate it cannot verify) without
    # end on the first connect; bound it so a misconfiguration is an error, not a hang.
    bound = first_connect_attempts * (connect_timeout + 0.5) + 2.0
    # nats-py annotates these seconds as int but uses them as float
    seconds: dict[str, Any] = {"connect_timeout": connect_timeout, "reconnect_time_wait": 0.5}
    try:
        await asyncio.wait_for(nc.connect(
            servers,
            name=name,
            **seconds,
            # nats-py applies this limit to the first connect too, where a negative value
            # would retry a dead URL forever; it is lifted below once connected.
            max_reconnect_attempts=max(1, first_connect_attempts - 1),
            ping_interval=10,
            max_outstanding_pings=3,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            user_credentials=user_credentials or None,
            tls=tls,
        ), bound)  # fmt: skip
    except TimeoutError:
        await nc.close()
        last = errors[-1] if errors else f"no answer within {bound:.0f} s"
        raise CannotConnect(f"cannot connect to NATS at {_redact(servers)}: {last}") from None
    except (OSError, nats.errors.Error) as exc:
        raise CannotConnect(f"cannot connect to NATS at {_redact(servers)}: {exc or type(exc).__name__}") from None
    nc.options["max_reconnect_attempts"] = -1
    client.append(nc)
    return nc


# when each client last reconnected (loop time), for plane_settling()
_reconnected_at: weakref.WeakKeyDictionary[NatsClient, float] = weakref.WeakKeyDictionary()


def plane_settling(nc: NatsClient, within_s: float) -> bool:
    """True while the NATS plane is down for ``nc`` (disconnected, reconnecting) or came
    back less than ``within_s`` ago (other clients may not have re-subscribed yet)."""
    if not nc.is_connected:
        return True
    since = _reconnected_at.get(nc)
    return since is not None and asyncio.get_running_loop().time() - since < within_s


async def sync_with_server(nc: NatsClient, timeout: float = 2.0) -> None:
    """Return once the server has processed everything this client sent before the call
    (e.g. subscriptions: requests from other clients then reach them).

    NOTE: nats-py writes a flush's PING straight to the socket while earlier commands may
    still wait in its pending buffer, so one PING/PONG can overtake a SUB. The first
    round trip lets its flusher task write the buffer; the second PING then follows it.
    """
    seconds: dict[str, Any] = {"timeout": timeout}  # nats-py annotates it as int, uses it as float
    await nc.flush(**seconds)
    await nc.flush(**seconds)
