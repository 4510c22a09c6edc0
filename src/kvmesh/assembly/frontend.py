"""The frontend process: a :class:`~kvmesh.frontend.app.Frontend` over the workers
discovery reports (``kvmesh frontend``; ``kvmesh run``'s in-process discovery) or a
fixed list of addresses (``--static-workers``), served on a bound socket.

Imports the HTTP stack: ``kvmesh run`` imports this module only once its workers are
starting (:mod:`kvmesh.assembly.embedded`).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.config import FrontendConfig, RuntimeConfig
from kvmesh.frontend.app import Frontend
from kvmesh.frontend.server import HttpServer
from kvmesh.frontend.serving import make_server
from kvmesh.frontend.sources import StaticWorkers, watch_prefill_workers, watch_workers
from kvmesh.runtime.distributed import DistributedRuntime
from kvmesh.runtime.event_plane import make_event_plane
from kvmesh.runtime.event_plane.base import EventPlane

__all__ = ["FrontendProcess", "ignore_stop_signals", "GRACEFUL_SHUTDOWN_S"]

GRACEFUL_SHUTDOWN_S = 5

Models = str | None | Sequence[tuple[str, str | None]]  # a model folder, or (folder, served name) of each model


class _Closable(Protocol):
    async def close(self) -> None: ...


def ignore_stop_signals() -> None:
    """The HTTP server handles SIGINT/SIGTERM while it serves, then puts these back: a
    signal during the orderly stop after it (workers, runtime) must not cut it short."""
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)


@dataclass
class FrontendProcess:
    """A frontend and where its workers come from (closed by :meth:`close`)."""

    frontend: Frontend
    model: str = ""  # the (first) served model's name, when given model folders
    sources: list[_Closable] = field(default_factory=list)

    @classmethod
    async def over_discovery(
        cls, cfg: FrontendConfig, runtime: DistributedRuntime, events: EventPlane | None, model_path: Models,
        defer_templates: bool = False,
    ) -> FrontendProcess:
        """Watch the runtime's discovery: the workers routed to, and the prefill workers
        (observability: their metrics on the dashboard). ``model_path``: a model folder,
        or several models' (folder, served name), loaded before their workers come;
        ``defer_templates``: their chat templates compiled by their first chat request."""
        process = cls._build(cfg, events, model_path, defer_templates)
        process.sources.append(await watch_workers(runtime, process.frontend.registry))
        process.sources.append(await watch_prefill_workers(runtime, process.frontend.prefill_workers))
        return process

    @classmethod
    async def over_static(cls, cfg: FrontendConfig, rcfg: RuntimeConfig, addresses: list[str], model_path: str | None) -> FrontendProcess:
        """Workers at fixed addresses, each asked for its card (zmq KV events)."""
        process = cls._build(cfg, make_event_plane("zmq", host=rcfg.host), model_path)
        static = StaticWorkers(addresses, process.frontend.registry)
        await static.start()
        process.sources.append(static)
        return process

    @classmethod
    def _build(cls, cfg: FrontendConfig, events: EventPlane | None, model_path: Models, defer: bool = False) -> FrontendProcess:
        frontend = Frontend(cfg, events)
        models = [(model_path, None)] if isinstance(model_path, str) else model_path or []
        names = [frontend.registry.add_model(path, name, defer).name for path, name in models if path]
        return cls(frontend, names[0] if names else "")

    async def share_tenant_budget(self, runtime: DistributedRuntime) -> None:
        """``kvmesh frontend``: tenants' rpm/tpm held across every frontend of the fleet
        (--tenant-budget; kvmesh.frontend.tenant_shared); embedded ``kvmesh run`` has one
        frontend and keeps the local limiter."""
        gate, mode = self.frontend.tenants, self.frontend.config.security.tenant_budget
        if gate is None or mode == "local" or (mode == "auto" and not runtime.config.needs_nats):
            return
        from kvmesh.frontend.tenant_shared import SharedBudget

        gate.shared = SharedBudget(await runtime.connect_nats(), runtime.config.namespace)
        self.sources.append(gate.shared)  # closing gives back its unspent leases

    async def serve(self, sock: socket.socket, log_level: str, *beside: Callable[[HttpServer], Coroutine[Any, Any, None]]) -> None:
        """Serve on ``sock`` until SIGTERM/SIGINT (or a ``beside`` task tells the server
        to exit); the ``beside`` tasks run alongside and are cancelled at the end."""
        ignore_stop_signals()
        server = make_server(self.frontend.app, log_level)
        server.config.timeout_graceful_shutdown = GRACEFUL_SHUTDOWN_S
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(start(server)) for start in beside]
        try:
            await server.serve(sockets=[sock])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for source in self.sources:
            await source.close()
