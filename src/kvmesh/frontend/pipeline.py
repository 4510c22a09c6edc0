"""One request's path through the frontend, protocol-neutral:

    OpenAI request → PreprocessedRequest → worker stream of token chunks
                   → detokenized text deltas with stop strings applied

The HTTP layer (:mod:`kvmesh.frontend.app`) turns the deltas into SSE events or one
JSON body.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

import msgspec

from kvmesh.errors import MIGRATABLE, InvalidArgument, KvmeshError, StreamIncomplete, Unknown
from kvmesh.frontend.models import ModelEntry
from kvmesh.frontend.schemas import ChatCompletionRequest, CompletionRequest, largest_text_field
from kvmesh.frontend.tools import chat_messages, guided_of
from kvmesh.health.migration import (
    LINK_BYTES_PER_S,
    MigrationBudget,
    estimate_migration,
    prefill_ms_at,
    resume_request,
)
from kvmesh.observability import tracing
from kvmesh.protocol import (
    DisaggregatedParams,
    OutputChunk,
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)
from kvmesh.runtime.context import Context
from kvmesh.runtime.instances import Instance
from kvmesh.runtime.names import GENERATE

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kvmesh.router.core import Decision

__all__ = ["new_request_id", "preprocess", "preprocess_async", "Generation", "merge_chunks", "explain_route"]

log = logging.getLogger("kvmesh.frontend")

RETRIES_BEFORE_OUTPUT = 3


def migration_method(request: PreprocessedRequest, generated: int, handoff: DisaggregatedParams | None) -> str:
    """KV transfer or re-prefill, by the migration cost model: a worker that handed the
    request off with its KV (``handoff``) offers the link; without one, re-prefill."""
    layout = handoff.layout if handoff is not None and handoff.kind == "kv_source" else None
    if layout is None:
        return "re_prefill"
    link = layout.simulated_bytes_per_s or LINK_BYTES_PER_S["tcp"]
    per_token = layout.bytes_per_block // layout.block_size
    return estimate_migration(len(request.token_ids), generated, per_token, link, prefill_ms_at()).method

_ids = itertools.count(1)
_id_prefix = os.urandom(4).hex()
_encode_request = msgspec.msgpack.Encoder().encode
_decode_chunk = msgspec.msgpack.Decoder(OutputChunk).decode


def new_request_id() -> str:
    return f"{_id_prefix}{next(_ids):x}"


def merge_chunks(pending: OutputChunk, new: OutputChunk) -> OutputChunk:
    """Fold ``new`` into ``pending`` (both decoded by us, so mutation is safe)."""
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


def _prompt_tokens(entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest, parse_special: bool) -> list[int]:
    pre = entry.preprocessor
    if isinstance(req, ChatCompletionRequest):
        messages = chat_messages(req)
        kwargs = req.chat_template_kwargs or {}
        return pre.chat_prompt(messages, add_generation_prompt=req.add_generation_prompt, parse_special=parse_special, **kwargs)
    return pre.text_prompt(req.single_prompt(), parse_special=parse_special)


def check_prompt_size(entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse, without tokenizing it, a prompt too long for the context whatever it
    tokenizes to (more characters than context × the longest token), counting every
    field that reaches it (messages, tools, template arguments)."""
    chars = req.prompt_chars()
    bound = entry.context_length * entry.preprocessor.tokenizer.max_token_chars
    if chars > bound:
        where, largest = largest_text_field(req)
        raise InvalidArgument(
            f"the prompt has {chars} characters, more than the {entry.context_length} tokens of the model's "
            f"context can hold; shorten the prompt (the largest field has {largest} characters) - at `$.{where}`"
        )


async def _prompt_tokens_async(
    entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest, parse_special: bool
) -> list[int]:
    """:func:`_prompt_tokens` with a large prompt built in the preprocessing pool."""
    pre = entry.preprocessor
    if isinstance(req, ChatCompletionRequest):
        messages = chat_messages(req)
        kwargs = req.chat_template_kwargs or {}
        return await pre.chat_prompt_async(
            messages, add_generation_prompt=req.add_generation_prompt, parse_special=parse_special, **kwargs
        )
    return await pre.text_prompt_async(req.single_prompt(), parse_special=parse_special)


async def preprocess_async(
    entry: ModelEntry, req: ChatCompletionRequest | CompletionRequest, request_id: str, explain: bool = False,
    parse_special: bool = False,
) -> PreprocessedRequest:  # fmt: skip
    """:func:`preprocess` with the prompt templated and tokenized off the event loop
    when it is large, so other streams never wait behind it."""
    check_prompt_size(entry, req)
    tokens = await _prompt_tokens_async(entry, req, parse_special)
    return preprocess(entry, req, request_id, explain, parse_special, tokens)


def preprocess(
    entry: ModelEntry,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    explain: bool = False,
    parse_special: bool = False,
    tokens: list[int] | None = None,
) -> PreprocessedRequest:
    """Validate against the model and build the engine request (``tokens``: the
    prompt's ids when already built). Special-token text in the user's text is plain
    text unless ``parse_special`` (trusted callers)."""
    if tokens is None:
        check_prompt_size(entry, req)
        tokens = _prompt_tokens(entry, req, parse_special)
    context = entry.context_length
    n = len(tokens)
    if n >= context:
        raise InvalidArgument(
            f"the prompt has {n} tokens but the model's context length is {context}; shorten the prompt"
        )
    max_tokens = req.token_limit()
    if max_tokens is None:
        max_tokens = context - n
    elif n + max_tokens > context:
        raise InvalidArgument(
            f"the model's context length is {context} tokens, but {n + max_tokens} were requested "
            f"({n} in the prompt, {max_tokens} to generate); lower max_tokens or shorten the prompt"
        )
    if req.min_tokens > max_tokens:
        raise InvalidArgument(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})")
    return PreprocessedRequest(
        request_id=request_id,
        model=entry.name,
        token_ids=tokens,
        sampling=SamplingOptions(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
        ),
        stop=StopConditions(
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop_strings(),
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
        ),
        output=OutputOptions(logprobs=req.logprob_count()),
        eos_token_ids=list(entry.info.eos_token_ids),
        routing=_routing_hints(req, explain),
        guided=guided_of(req),
    )


def _routing_hints(req: ChatCompletionRequest | CompletionRequest, explain: bool) -> RoutingHints | None:
    explain = explain or req.router_explain
    if not (explain or req.priority or req.kv_overlap_weight is not None or req.router_temperature is not None):
        return None
    return RoutingHints(
        priority=req.priority,
        overlap_weight=req.kv_overlap_weight,
        router_temperature=req.router_temperature,
        explain=explain,
    )


class Generation:
    """Streams text deltas for one request and keeps its counts.

    Iterating yields ``(text, chunk)`` pairs: the text released by this chunk (after
    detokenization and stop strings) and the chunk itself (for logprobs). When
    iteration ends, ``finish_reason`` is set. Leaving early (client gone) kills the
    worker stream.
    """

    __slots__ = (
        "entry",
        "request",
        "ctx",
        "finish_reason",
        "completion_tokens",
        "cached_tokens",
        "started",
        "first_token_at",
        "worker_id",
        "_include_stop",
        "_skip_special",
        "_booked",
        "trace",
    )

    def __init__(self, entry: ModelEntry, request: PreprocessedRequest, ctx: Context, include_stop: bool, skip_special: bool) -> None:
        self.entry = entry
        self.request = request
        self.ctx = ctx
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.worker_id: int | None = None
        self._include_stop = include_stop
        self._skip_special = skip_special
        self._booked = False  # the router holds load booked for this request
        self.trace: tracing.RequestTrace | None = None  # set by the HTTP layer

    def release(self) -> None:
        """Give the router's booking back: once per pick, on every path (finished,
        failed, cancelled before the first event, moved to another worker)."""
        if self._booked:
            self._booked = False
            self.entry.router.finished(self.request.request_id)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.token_ids)

    async def open(self) -> AsyncGenerator[OutputChunk, None]:
        """Route and open the worker stream (errors here are HTTP errors, not SSE)."""
        instance = await self._pick(self.request, frozenset())
        self.worker_id = instance.worker_id
        return self._chunks(instance)

    async def _pick(self, request: PreprocessedRequest, exclude: frozenset[int]) -> Instance:
        """The router's choice (a ``route`` span when recording)."""
        root = self.trace.span if self.trace is not None else None
        if root is None:
            instance = await self.entry.router.pick(request, exclude=exclude)
            self._booked = True
            return instance
        span = tracing.start_span("route", root, attributes={"router.policy": type(self.entry.router.policy).__name__})
        assert span is not None
        try:
            instance = await self.entry.router.pick(request, exclude=exclude)
        except BaseException as exc:
            if isinstance(exc, KvmeshError):
                tracing.fail(span, exc.kind, exc.message)
            span.end()
            raise
        self._booked = True
        span.set_attribute("worker_id", f"{instance.worker_id:x}")
        decision = _recent_decision(self.entry.router.policy, request.request_id)
        if decision is not None:
            span.set_attribute("overlap_blocks", decision.overlap_blocks)
            span.set_attribute("candidates", len(decision.candidates))
        span.end()
        return instance

    def _hop(self, instance: Instance, request: PreprocessedRequest, attempt: int) -> Span | None:
        """The request-plane span of one hop; its context travels in the request."""
        root = self.trace.span if self.trace is not None else None
        if root is None:
            return None
        attributes: dict[str, str | int] = {
            "worker_id": f"{instance.worker_id:x}", "attempt": attempt, "transport": instance.info.transport,
        }  # fmt: skip
        span = tracing.start_span("request_plane.generate", root, "client", attributes)
        if span is not None:
            request.trace_context = tracing.span_traceparent(span)
        return span

    def _stream_on(self, instance: Instance, request: PreprocessedRequest) -> AsyncGenerator[OutputChunk, None]:
        self.worker_id = instance.worker_id
        self.entry.metrics.routed(instance.worker_id)
        return instance.client.stream(
            GENERATE, _encode_request(request), self.ctx, decode=_decode_chunk, merge=merge_chunks
        )

    async def _chunks(self, instance: Instance) -> AsyncGenerator[OutputChunk, None]:
        """The worker's chunks, kept flowing when workers fail.

        A migratable failure (a worker draining, gone, unreachable, timed out) before
        any token re-routes the request (up to ``RETRIES_BEFORE_OUTPUT`` times); after
        some tokens it *migrates* it: the prompt plus the tokens streamed so far, with
        the remaining budget, goes to another worker (up to the migration limit), so
        the client sees one stream with no token missing or repeated. Never for a
        stopped (cancelled) request.
        """
        tried = {instance.worker_id}
        request = self.request
        generated: list[int] = []
        budget = MigrationBudget(self.entry.migration_limit)
        moved: tuple[str, float] | None = None  # (method, when the worker failed)
        handoff: DisaggregatedParams | None = None  # where a draining worker left the KV
        link: str | None = None  # tracing: the current worker's engine.generate span
        moving: Span | None = None  # tracing: the migration span, until the next worker answers
        while True:
            hop = self._hop(instance, request, len(tried))
            stream = self._stream_on(instance, request)
            try:
                async for chunk in stream:
                    if moved is not None:  # the new worker answered: the move is done
                        self.entry.metrics.migration_took(moved[0], time.perf_counter() - moved[1])
                        moved = None
                        if moving is not None:
                            moving.set_attribute("target_worker", f"{instance.worker_id:x}")
                            moving.end()
                            moving = None
                    if chunk.disaggregated_params is not None:
                        handoff = chunk.disaggregated_params
                    if chunk.trace_link is not None:
                        link = chunk.trace_link
                    generated.extend(chunk.token_ids)
                    yield chunk
                return
            except MIGRATABLE as exc:
                if hop is not None:
                    tracing.fail(hop, exc.kind, exc.message)
                if self.ctx.is_stopped():
                    raise
                if self.entry.health is not None:
                    self.entry.health.stream_failed(instance.worker_id, exc)
                if generated:
                    if not budget.try_spend():
                        raise
                    method = migration_method(self.request, len(generated), handoff)
                    moved = (method, time.perf_counter())
                    if hop is not None and self.trace is not None:
                        moving = tracing.start_span("migration", self.trace.span, attributes={
                            "method": method, "source_worker": f"{instance.worker_id:x}",
                            "tokens_so_far": len(generated), "error_kind": exc.kind,
                        })  # fmt: skip
                elif len(tried) > RETRIES_BEFORE_OUTPUT:
                    raise
                log.info(
                    "request %s: worker %x failed after %d tokens (%s); moving it",
                    self.request.request_id, instance.worker_id, len(generated), exc.message,
                )  # fmt: skip
            finally:
                await stream.aclose()
                if hop is not None:
                    hop.end()
                if moving is not None and moved is None:
                    moving.end()
                    moving = None
            self.release()  # the failed worker's booking
            if generated and len(generated) >= (self.request.stop.max_tokens or 0):
                if moving is not None:  # tracing: nothing left to move
                    moving.end()
                yield OutputChunk(finish_reason="length")  # every token was streamed; only the end was lost
                return
            request = resume_request(self.request, generated)
            if generated and handoff is not None and moved is not None and moved[0] == "kv_transfer":
                request = msgspec.structs.replace(request, disaggregated_params=handoff)
            handoff = None
            if generated and link is not None:  # the next engine.generate links to this one
                request = msgspec.structs.replace(request, migration_link=link)
            source = instance.worker_id
            instance = await self._pick(request, frozenset(tried))
            tried.add(instance.worker_id)
            if moved is not None:  # counted once the target is known
                self.entry.metrics.migrated(moved[0], f"{source:x}", f"{instance.worker_id:x}")

    async def deltas(self, stream: AsyncGenerator[OutputChunk, None]) -> AsyncIterator[tuple[str, OutputChunk]]:
        pre = self.entry.preprocessor
        detok = pre.detokenizer(skip_special_tokens=self._skip_special)
        stops = self.request.stop.stop
        matcher = pre.stop_matcher(stops, self._include_stop) if stops else None
        metrics = self.entry.metrics
        last = self.started
        try:
            async for chunk in stream:
                ids = chunk.token_ids
                now = time.perf_counter()
                if ids:
                    if self.first_token_at is None:
                        self.first_token_at = now
                        metrics.ttft.observe(now - self.started)
                        self.entry.router.first_token(self.request.request_id)
                        per_token = None
                    else:
                        per_token = (now - last) / len(ids)
                    if per_token is not None:
                        for _ in ids:
                            metrics.itl.observe(per_token)
                    last = now
                    self.completion_tokens += len(ids)
                    text = detok.step(ids)
                else:
                    text = ""
                finish = chunk.finish_reason
                if finish is not None:
                    text += detok.flush()
                    if chunk.usage is not None:
                        self.cached_tokens = chunk.usage.cached_tokens
                if matcher is not None:
                    text, hit = matcher.feed(text)
                    if hit:
                        self.finish_reason = "stop"
                        yield text, chunk
                        return
                    if finish is not None:
                        text += matcher.flush()
                if finish is not None:
                    self.finish_reason = finish
                    if finish == "error":
                        raise Unknown(chunk.error or "the engine reported an error")
                yield text, chunk
                if finish is not None:
                    return
            raise StreamIncomplete("the worker's stream ended without a finish reason")
        finally:
            self.release()
            await stream.aclose()


def explain_route(gen: Generation) -> dict[str, object]:
    """Why the request went where it went (``router_explain`` / ``x-kvmesh-explain``)."""
    entry = gen.entry
    out: dict[str, object] = {"worker": f"{gen.worker_id:x}" if gen.worker_id is not None else None}
    policy = entry.router.policy
    decision = policy.explain(gen.request.request_id)
    if decision is None:
        out["mode"] = type(policy).__name__
        return out
    out["mode"] = entry.kv.settings.mode if entry.kv is not None else "kv"
    out["block_size"] = entry.kv.settings.block_size if entry.kv is not None else None
    out["overlap_blocks"] = decision.overlap_blocks
    out["candidates"] = [
        {
            "worker": f"{c.worker_id:x}",
            "overlap_blocks": c.overlap_blocks,
            "prefill_blocks": round(c.prefill_blocks, 3),
            "decode_blocks": round(c.decode_blocks, 3),
            "cost": round(c.cost, 3),
            "weight": c.weight,
        }
        for c in decision.candidates
    ]
    return out


def _recent_decision(policy: object, request_id: str) -> Decision | None:
    """The KV router's decision for ``request_id`` if it is among its recent ones."""
    recent = getattr(policy, "recent", None)
    if not recent:
        return None
    for rid, decision in reversed(recent):
        if rid == request_id:
            return decision  # type: ignore[no-any-return]  # KvPolicy.recent holds (str, Decision)
    return None
