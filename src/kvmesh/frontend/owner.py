"""One request's owner: it routes the request, keeps it flowing when workers fail, and
yields the typed delta stream (:mod:`kvmesh.frontend.deltas`) a dialect encodes.

Lifecycle (one owner per request, not shared)::

    owner = RequestOwner(entry, request, ctx, observer, read_back)
    await owner.open()                 # 1. route: books a worker; errors here are HTTP errors
    async with owner:                  # 2. the booking is released when this block ends, however
        async for delta in owner.deltas():   #  it ends (finished, failed, client gone, never iterated)
            ...                        # 3. Start, Text*, ToolCall*, Finish (or a KvmeshError)

The booking: :class:`_Booking` holds the router's load for the one worker serving the
request; ``_Booking.release`` is the only place it is given back (on leaving step 2,
and before a failed request is booked on another worker).

Failures: a worker's stream that fails with a migratable error asks the pure policy
:func:`kvmesh.health.migration.next_step` — retry (no token yet), migrate (prompt +
tokens so far, with the rest of the budget, to another worker), finish (every token
was delivered), or fail — so the client sees one stream with no token missing or
repeated. What happens is reported to the :class:`~kvmesh.frontend.observer.RequestObserver`.

Per chunk there is one async generator, :meth:`RequestOwner.deltas`: the request
plane's stream is read through its mailbox (``client.open_stream``), and detokenizing,
stop strings and counting are plain calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from types import TracebackType

import msgspec

from kvmesh.errors import MIGRATABLE, KvmeshError, StreamIncomplete, Unknown, http_status
from kvmesh.frontend.deltas import Delta, Finish, FinishReason, Start, Text, TokenLogprob, ToolCall, Usage
from kvmesh.frontend.models import ModelEntry
from kvmesh.frontend.observer import RequestObserver
from kvmesh.frontend.tools import ToolReader, new_call_id
from kvmesh.health.migration import migration_method, next_step, resume_request
from kvmesh.protocol import DisaggregatedParams, OutputChunk, PreprocessedRequest, RoutingHints
from kvmesh.protocol import TokenLogprob as WireLogprob
from kvmesh.router.push import PushRouter
from kvmesh.runtime.context import Context
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import GENERATE
from kvmesh.runtime.stream import END, OpenStream

__all__ = ["RequestOwner", "ReadBack", "merge_chunks"]

log = logging.getLogger("kvmesh.frontend")

_encode_request = msgspec.msgpack.Encoder().encode
_decode_chunk = msgspec.msgpack.Decoder(OutputChunk).decode


def merge_chunks(pending: OutputChunk, new: OutputChunk) -> OutputChunk:
    """Fold ``new`` into ``pending`` (both decoded by us, so mutation is safe): what a
    slow reader of the request plane gets in one chunk."""
    pending.token_ids.extend(new.token_ids)
    if new.logprobs:
        pending.logprobs = (pending.logprobs or []) + new.logprobs
    if new.finish_reason is not None:
        pending.finish_reason = new.finish_reason
        pending.error = new.error
    if new.usage is not None:
        pending.usage = new.usage
    if new.cached_tokens is not None:
        pending.cached_tokens = new.cached_tokens
    if new.disaggregated_params is not None:
        pending.disaggregated_params = new.disaggregated_params
    if new.trace_link is not None:
        pending.trace_link = new.trace_link
    return pending


@dataclass(slots=True)
class ReadBack:
    """How the output becomes text: stop strings kept or cut, special tokens skipped,
    tool calls read back (None: plain content)."""

    include_stop: bool = False
    skip_special: bool = True
    tools: ToolReader | None = None


class _Booking:
    """The router's load booked for the request on the one worker serving it."""

    __slots__ = ("router", "request_id", "observer", "instance")

    def __init__(self, router: PushRouter, request_id: str, observer: RequestObserver) -> None:
        self.router = router
        self.request_id = request_id
        self.observer = observer
        self.instance: Instance | None = None

    async def take(self, request: PreprocessedRequest, exclude: frozenset[int]) -> Instance:
        """Book the router's choice (none may be held)."""
        if not self.observer.recording:  # the common case: no span to report
            self.instance = instance = await self.router.pick(request, exclude=exclude)
            return instance
        self.observer.picking()
        try:
            instance = await self.router.pick(request, exclude=exclude)
        except BaseException as exc:
            self.observer.pick_failed(exc)
            raise
        self.instance = instance
        self.observer.picked(instance, self.request_id)
        return instance

    def release(self) -> None:
        """Give the booking back (the only place it is): at the request's end, or before
        it is booked elsewhere."""
        if self.instance is not None:
            self.instance = None
            self.router.finished(self.request_id)


class RequestOwner:
    """Runs one request from routing to its last delta; see the module docstring."""

    __slots__ = ("entry", "request", "ctx", "observer", "read", "worker_id", "_booking", "_tried", "_migrations_left",
                 "_generated", "_handoff", "_link", "_detok", "_matcher", "_ended", "_held", "_held_logprobs",
                 "_cached", "_error", "_gen", "_decode", "_moving", "_want_logprobs", "on_end")  # fmt: skip

    def __init__(self, entry: ModelEntry, request: PreprocessedRequest, ctx: Context, observer: RequestObserver,
                 read: ReadBack) -> None:  # fmt: skip
        self.entry = entry
        self.request = request
        self.ctx = ctx
        self.observer = observer
        self.read = read
        self.worker_id: int | None = None  # the worker serving it now
        self._booking = _Booking(entry.router, request.request_id, observer)
        self._tried: set[int] = set()
        self._migrations_left = entry.migration_limit
        self._generated: list[int] = []  # every token delivered, for a resumed request
        self._handoff: DisaggregatedParams | None = None  # where a draining worker left the KV
        self._link: str | None = None  # tracing: the current worker's engine.generate span
        self._ended: FinishReason | None = None
        self._held: list[str] | None = [] if read.tools is not None else None  # a possible tool call is held back
        self._held_logprobs: list[TokenLogprob] = []
        self._cached = 0
        self._moving = False  # moved to another worker, which has not answered yet
        self._want_logprobs = request.output.logprobs is not None
        self._error: BaseException | None = None
        self._gen: AsyncGenerator[Delta, None] | None = None
        pre = entry.preprocessor
        self._detok = pre.detokenizer(skip_special_tokens=read.skip_special)
        stops = request.stop.stop
        self._matcher = pre.stop_matcher(stops, read.include_stop) if stops else None
        self._decode = pre.tokenizer.decode
        # called once with the usage when the request ends after open() (a tenant's budget settles)
        self.on_end: Callable[[Usage], None] | None = None

    @property
    def usage(self) -> Usage:
        return Usage(len(self.request.token_ids), len(self._generated), self._cached)

    async def open(self) -> None:
        """Route to the first worker; an error here is the request's answer (nothing booked)."""
        try:
            await self._book(self.request)
        except BaseException as exc:
            self.observer.refused(str(http_status(exc)))
            raise

    async def _book(self, request: PreprocessedRequest) -> Instance:
        instance = await self._booking.take(request, frozenset(self._tried))
        self._tried.add(instance.worker_id)
        self.worker_id = instance.worker_id
        return instance

    async def __aenter__(self) -> RequestOwner:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._gen is not None:
                await self._gen.aclose()  # a consumer that left early: the worker's stream is closed
        finally:
            self._booking.release()
            if self.ctx.is_stopped() and self._ended in (None, "cancelled"):
                status = "499"  # the client left (or the request was cancelled)
            else:
                status = "200" if self._error is None else str(http_status(self._error))
            self.observer.finished(status, self.usage)
            if self.on_end is not None:
                self.on_end(self.usage)

    def deltas(self) -> AsyncGenerator[Delta, None]:
        """The request's delta stream (once per owner)."""
        self._gen = self._run()
        return self._gen

    async def _run(self) -> AsyncGenerator[Delta, None]:
        request = self.request
        yield Start(request.request_id, request.adapter or self.entry.name, int(time.time()), len(request.token_ids))
        lost_end: OutputChunk | None = None  # a failure after every token: only the end is made up
        try:
            next_request: PreprocessedRequest | None = request
            while next_request is not None and self._ended is None:
                stream: OpenStream | None = None
                try:
                    stream = await self._stream_on(next_request)
                    next_chunk = stream.next  # no generator between the mailbox and this one
                    while True:
                        chunk = await next_chunk()
                        if chunk is END:
                            next_request = None
                            break
                        text = self._on_chunk(chunk)
                        if text is not None:
                            yield text
                        if self._ended is not None:
                            break
                except MIGRATABLE as exc:
                    next_request = await self._recover(exc)
                    if next_request is None:
                        lost_end = OutputChunk(finish_reason="length")
                finally:
                    if stream is not None:
                        await stream.close()
                    self.observer.attempt_closed()
            if lost_end is not None:
                text = self._on_chunk(lost_end)
                if text is not None:
                    yield text
            if self._ended is None:
                raise StreamIncomplete("the worker's stream ended without a finish reason")
            for delta in self._tail():
                yield delta
        except Exception as exc:
            self._error = exc
            raise

    async def _stream_on(self, request: PreprocessedRequest) -> OpenStream:
        instance = self._booking.instance
        assert instance is not None  # booked by open() or _recover()
        self.observer.attempt(instance, request, len(self._tried))
        return await instance.client.open_stream(GENERATE, _encode_request(request), self.ctx, _decode_chunk, merge_chunks)

    def _on_chunk(self, chunk: OutputChunk) -> Text | None:
        """One worker chunk → the text it releases (None: nothing to send yet); sets
        ``_ended`` at the stream's end or a stop string."""
        if self._moving:
            self._moving = False
            self.observer.answered(self.worker_id or 0)
        if chunk.disaggregated_params is not None:
            self._handoff = chunk.disaggregated_params
        if chunk.trace_link is not None:
            self._link = chunk.trace_link
        ids = chunk.token_ids
        text = ""
        if ids:
            self._generated.extend(ids)
            if self.observer.tokens(len(ids)):
                self.entry.router.first_token(self.request.request_id)
            text = self._detok.step(ids)
        finish = chunk.finish_reason
        if finish is not None:
            text += self._detok.flush()
            if chunk.usage is not None:
                self._cached = chunk.usage.cached_tokens
        matcher = self._matcher
        if matcher is not None:
            text, hit = matcher.feed(text)
            if hit:
                self._ended = "stop"
            elif finish is not None:
                text += matcher.flush()
        if finish is not None and self._ended is None:
            if finish == "error":
                raise Unknown(chunk.error or "the engine reported an error")
            self._ended = finish
        wire = chunk.logprobs
        if self._held is None and not (wire and self._want_logprobs):
            return Text(text) if text else None
        return self._text(text, wire)

    def _text(self, text: str, wire: list[WireLogprob] | None) -> Text | None:
        """Text with logprobs, or text held back (a possible tool call)."""
        logprobs = self._logprobs(wire) if wire and self._want_logprobs else None
        if self._held is not None:
            self._held.append(text)
            if logprobs:
                self._held_logprobs.extend(logprobs)
            return None
        if logprobs is not None:
            return Text(text, logprobs)
        return Text(text) if text else None

    def _logprobs(self, wire: list[WireLogprob]) -> tuple[TokenLogprob, ...]:
        """The tokens' logprobs with their text (special tokens spelled out), built once."""
        decode = self._decode

        def text(token_id: int) -> str:
            return decode([token_id], skip_special_tokens=False)

        return tuple(TokenLogprob(text(lp.token_id), lp.logprob, tuple((text(t), v) for t, v in lp.top)) for lp in wire)

    def _tail(self) -> list[Delta]:
        """What follows the last chunk: held output (as text or tool calls), then Finish."""
        reason = self._ended or "stop"
        out: list[Delta] = []
        tools = self.read.tools
        if self._held is not None and tools is not None:
            text = "".join(self._held)
            logprobs = tuple(self._held_logprobs) if self._want_logprobs else None
            call = tools.read(text)
            if call is None:
                if text or logprobs:
                    out.append(Text(text, logprobs))
            else:
                if logprobs:
                    out.append(Text("", logprobs))
                out += [ToolCall(0, "", new_call_id(), call.name), ToolCall(0, call.arguments)]
                reason = "tool_calls"
        matched = self._matcher.matched if self._matcher is not None and self._ended == "stop" else None
        out.append(Finish(reason, self.usage, matched))
        return out

    async def _recover(self, exc: KvmeshError) -> PreprocessedRequest | None:
        """After a migratable failure: the request to send to the next worker (booked),
        None when every token was delivered (it ends with ``length``); raises ``exc``
        when the policy says fail."""
        self.observer.attempt_failed(exc)
        source = self.worker_id or 0
        stopped = self.ctx.is_stopped()
        if not stopped and self.entry.health is not None:
            self.entry.health.stream_failed(source, exc)
        delivered = len(self._generated)
        step = next_step(exc, stopped=stopped, delivered=delivered, max_tokens=self.request.stop.max_tokens,
                         attempts=len(self._tried), migrations_left=self._migrations_left)  # fmt: skip
        if step == "fail":
            raise exc
        log.info("request %s: worker %x failed after %d tokens (%s); moving it",
                 self.request.request_id, source, delivered, exc.message)  # fmt: skip
        if step == "retry":
            return await self._rebook(self.request)
        self._migrations_left -= 1
        if step == "finish":  # every token was streamed; only the end was lost
            return None
        return await self._rebook(self._resumed(exc, source))

    def _resumed(self, exc: KvmeshError, source: int) -> PreprocessedRequest:
        """The request that continues on another worker after the tokens delivered."""
        generated = self._generated
        method = migration_method(len(self.request.token_ids), len(generated), self._handoff)
        self.observer.moving(method, source, len(generated), exc)
        self._moving = True
        request = resume_request(self.request, generated)
        if self._handoff is not None:  # handed off: the target by capacity, the KV copied if cheaper
            if method == "kv_transfer":
                request = msgspec.structs.replace(request, disaggregated_params=self._handoff)
            request = self._pin_target(request, source)
        if self._link is not None:  # the next engine.generate links to this one
            request = msgspec.structs.replace(request, migration_link=self._link)
        return request

    def _pin_target(self, request: PreprocessedRequest, source: int) -> PreprocessedRequest:
        """A handed-off request goes where the health monitor's capacity ledger says."""
        health = self.entry.health
        target = None if health is None else health.handoff_target(source, len(request.token_ids), tuple(self._tried))
        if target is None:
            return request
        routing = request.routing or RoutingHints()
        return msgspec.structs.replace(request, routing=msgspec.structs.replace(routing, worker_id=target))

    async def _rebook(self, request: PreprocessedRequest) -> PreprocessedRequest:
        source = self.worker_id or 0
        pinned = self._handoff is not None and request.routing is not None and request.routing.worker_id is not None
        self._handoff = None
        self._booking.release()  # the failed worker's booking
        try:
            instance = await self._book(request)
        except KvmeshError:
            if not pinned:
                raise
            assert request.routing is not None  # the ledger's target is gone: the router picks
            request = msgspec.structs.replace(request, routing=msgspec.structs.replace(request.routing, worker_id=None))
            instance = await self._book(request)
        self.observer.moved(source, instance.worker_id)
        return request
