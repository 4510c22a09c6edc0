"""Ending a background task a component owns."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (None: nothing to do) and wait until it has ended, whatever it
    raised on the way out. A cancellation of the caller itself still propagates."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
