"""Per-request context: identity and cancellation.

Two levels of cancellation, as in the backend contract:

* ``stop_generating()``: a graceful stop; the engine should end the stream soon with a
  ``cancelled`` terminal;
* ``kill()``: stop now; implies ``stop_generating()``.

Both are idempotent and may be called from any coroutine of the owning event loop
(never from another thread). Callbacks added with :meth:`Context.on_stop` run
synchronously, once, at the first stop; they must not block.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

__all__ = ["Context"]

log = logging.getLogger(__name__)


class Context:
    __slots__ = ("id", "_stopped", "_killed", "_waiters", "_callbacks")

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self._stopped = False
        self._killed = False
        self._waiters: list[asyncio.Future[None]] | None = None
        self._callbacks: list[Callable[[Context], None]] | None = None

    def is_stopped(self) -> bool:
        return self._stopped

    def is_killed(self) -> bool:
        return self._killed

    def stop_generating(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._waiters:
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(None)
            self._waiters = None
        if self._callbacks:
            callbacks, self._callbacks = self._callbacks, None
            for cb in callbacks:
                try:
                    cb(self)
                except Exception:  # noqa: BLE001 - one failing hook must not skip the others
                    log.exception("stop callback %r failed for %s", cb, self.id)

    def kill(self) -> None:
        self._killed = True
        self.stop_generating()

    async def stopped(self) -> None:
        """Wait until the request is stopped (or killed)."""
        if self._stopped:
            return
        fut = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if self._waiters is not None and fut in self._waiters:
                self._waiters.remove(fut)

    def on_stop(self, callback: Callable[[Context], None]) -> None:
        """Run ``callback(ctx)`` at the first stop (at once if already stopped)."""
        if self._stopped:
            callback(self)
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def __repr__(self) -> str:
        state = "killed" if self._killed else "stopped" if self._stopped else "live"
        return f"Context({self.id!r}, {state})"
