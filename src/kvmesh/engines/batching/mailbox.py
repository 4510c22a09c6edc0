"""A request's slot between an engine's step loop (producer) and its stream (consumer).

The step loop appends tokens (and, for a request that asked for them, their
log-probabilities) and wakes the consumer; a consumer that lags takes the accumulated
tokens as one chunk. Engines subclass it for what else they keep per request
(:mod:`kvmesh.engines.mocker.engine`, :mod:`kvmesh.engines.hf.engine`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvmesh.errors import KvmeshError
from kvmesh.protocol import OutputChunk, TokenLogprob

__all__ = ["Mailbox"]


class Mailbox:
    __slots__ = ("tokens", "logprobs", "finished", "cancelled", "error", "_waiter")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token, for requests that asked
        self.finished: Any = None  # the engine's record of how the request ended
        self.cancelled = False
        self.error: KvmeshError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def take(self) -> list[int]:
        tokens, self.tokens = self.tokens, []
        return tokens

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        if not self.logprobs:
            return None
        logprobs, self.logprobs = self.logprobs, []
        return logprobs

    def chunk(self, cached_tokens: int | None = None) -> OutputChunk:
        """The tokens (and log-probabilities) accumulated so far, as one stream chunk."""
        logprobs = self._take_logprobs()
        return OutputChunk(token_ids=self.take(), logprobs=logprobs, cached_tokens=cached_tokens)

    def terminal(self) -> OutputChunk:
        """The last chunk: what is left, with how the request ended (``finished``)."""
        fin, logprobs = self.finished, self._take_logprobs()
        return OutputChunk(
            token_ids=self.take(), finish_reason=fin.reason, usage=fin.usage, logprobs=logprobs, error=fin.error
        )

    def finish(self, finished: Any) -> None:
        self.finished = finished
        self._wake()

    def cancel(self) -> None:
        self.cancelled = True
        self._wake()

    def fail(self, error: KvmeshError) -> None:
        self.error = error
        self._wake()

    async def wait(self) -> None:
        """Return once anything was put in the slot (at once if it is not empty)."""
        if self.tokens or self.finished or self.cancelled or self.error:
            return
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
