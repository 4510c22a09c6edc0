"""The generation routes: an HTTP request → checks → the engine request → its owner
(:mod:`kvmesh.frontend.owner`) → a dialect's encoder → SSE or one JSON body.

A :class:`Dialect` is what differs between ``/v1/chat/completions``,
``/v1/completions`` (and the dialects of :mod:`kvmesh.frontend.dialects`): how a body
becomes the internal request, how the delta stream becomes bytes, and how an error is
shaped. Everything else — the API key's tier, shedding, the prompt's size, templating
and tokenizing, the output constraint's check, routing, tracing, cancellation — is the
same for every dialect, here.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvmesh.config import FrontendConfig, SecurityConfig
from kvmesh.errors import (
    InvalidArgument,
    PayloadTooLarge,
    PermissionDenied,
    ResourceExhausted,
    TooManyRequests,
    Unauthorized,
    UnsupportedMediaType,
)
from kvmesh.frontend.auth import Authenticator, presented
from kvmesh.frontend.deltas import BodyEncoder, StreamEncoder, Usage
from kvmesh.frontend.dialects.chat import ChatBody, ChatStream
from kvmesh.frontend.dialects.completions import CompletionBody, CompletionStream
from kvmesh.frontend.failures import error_response, public_message
from kvmesh.frontend.models import ModelEntry, ModelRegistry
from kvmesh.frontend.observer import RequestObserver
from kvmesh.frontend.owner import ReadBack, RequestOwner
from kvmesh.frontend.pipeline import explain_route, new_request_id, preprocess_async
from kvmesh.frontend.schemas import ChatCompletionRequest, CompletionRequest, check_limits, parse
from kvmesh.frontend.server import Request, Response
from kvmesh.frontend.sse import DeltaSSE, KeepAlive
from kvmesh.frontend.tools import ToolReader
from kvmesh.observability import tracing
from kvmesh.observability.metrics import FrontendMetrics
from kvmesh.protocol import GuidedDecoding, PreprocessedRequest, RoutingHints
from kvmesh.runtime.context import Context

if TYPE_CHECKING:  # the tenants' modules: imported where a key has a tenant (issue 36: not at every start)
    from kvmesh.frontend.tenant_state import TenantGate
    from kvmesh.frontend.tenants import Grant, Refusal, TenantPolicy

__all__ = ["Dialect", "CHAT", "COMPLETIONS", "Generation", "require_json"]

_json = msgspec.json.encode
_JSON = "application/json"
PIN_HEADER = "x-kvmesh-worker"  # direct routing (see Generation._pin)
GenerationRequest = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API dialect of the generation routes."""

    endpoint: str  # the ``endpoint`` label of the request metrics
    # (body, limits, caller: the key the caller presented when keys are on, else "") → internal request, checked
    parse: Callable[[bytes, SecurityConfig, str], GenerationRequest]
    stream: Callable[[GenerationRequest], StreamEncoder]
    body: Callable[[GenerationRequest, object], BodyEncoder]  # (request, router explanation or None)
    error: Callable[[BaseException, str | None], Response] = error_response


def _parsed(kind: str) -> Callable[[bytes, SecurityConfig, str], GenerationRequest]:
    def parse_checked(body: bytes, security: SecurityConfig, caller: str) -> GenerationRequest:
        req = parse(body, kind)  # type: ignore[arg-type]  # "chat" | "completion"
        check_limits(req, security)
        return req

    return parse_checked


def _include_usage(req: GenerationRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _wants_logprobs(req: GenerationRequest) -> bool:
    return req.logprob_count() is not None


CHAT = Dialect(
    "chat_completions",
    _parsed("chat"),
    lambda req: ChatStream(_include_usage(req)),
    lambda req, route: ChatBody(_wants_logprobs(req), route),
)
COMPLETIONS = Dialect(
    "completions",
    _parsed("completion"),
    lambda req: CompletionStream(_include_usage(req)),
    lambda req, route: CompletionBody(_wants_logprobs(req), route),
)


@dataclass(frozen=True, slots=True)
class Generation:
    """Serves the generation routes of one frontend (``serve(request, dialect)``)."""

    config: FrontendConfig
    registry: ModelRegistry
    auth: Authenticator
    keepalive: KeepAlive
    metrics: FrontendMetrics
    tenants: TenantGate | None = None  # keys with a tenant (kvmesh.frontend.tenants); None: no key has one

    async def serve(self, request: Request, dialect: Dialect) -> Response | DeltaSSE:
        # tracing: the request's trace (root span when recording); the traceparent goes
        # to the workers (in the request) and back to the client (a response header)
        request_id = new_request_id()
        trace = tracing.RequestTrace(request.headers.get("traceparent"), request.method, request.path, request_id)
        response = await self._serve_traced(request, dialect, request_id, trace)
        if isinstance(response, Response):
            response.headers["traceparent"] = trace.traceparent
            if response.status != 200:
                trace.end(response.status)  # refused before a stream existed
        else:
            response.headers = [*response.headers, (b"traceparent", trace.traceparent.encode())]
        return response

    async def _serve_traced(
        self, request: Request, dialect: Dialect, request_id: str, trace: tracing.RequestTrace
    ) -> Response | DeltaSSE:
        try:
            req, entry = self._accept(request, dialect)
            explain = request.headers.get("x-kvmesh-explain", "") not in ("", "0", "false")
            preq = await preprocess_async(entry, req, request_id, explain, self.config.security.allow_special_tokens)
            if req.model != entry.name:  # a LoRA adapter of the entry's model (ModelRegistry.get)
                preq.adapter = req.model
            if preq.guided is not None:
                await _check_guided(preq.guided)
            if self.config.security.admin and PIN_HEADER in request.headers:  # off without --admin: no lookup
                self._pin(request, preq)
        except Exception as exc:  # noqa: BLE001 - every error becomes one response
            return dialect.error(exc, request_id)
        grant: Grant | None = None
        if request.tenant is not None:  # a key with a tenant: its limits, fair share and cache namespace
            from kvmesh.frontend.tenants import Grant, Refusal

            got = self._reserve(request.tenant, preq)
            if isinstance(got, Grant) and self.tenants is not None and self.tenants.shares(request.tenant):
                got = await self.tenants.share(got, request.tenant)  # several frontends: the fleet's budget too
            if isinstance(got, Refusal):
                return _rate_limited(dialect, got, request_id)
            grant = got
        entry.metrics.input_tokens.inc(len(preq.token_ids))
        preq.trace_context = trace.traceparent
        read = ReadBack(req.include_stop_str_in_output, req.skip_special_tokens, ToolReader.of(req))
        observer = RequestObserver(entry, dialect.endpoint, trace)
        owner = RequestOwner(entry, preq, Context(preq.request_id), observer, read)
        if grant is not None:
            owner.on_end = self._settle(grant)
        try:
            await owner.open()
        except Exception as exc:  # noqa: BLE001
            if owner.on_end is not None:
                owner.on_end(owner.usage)
            return _with_grant(dialect.error(exc, request_id), grant)
        hints = preq.routing
        route = explain_route(entry, preq.request_id, owner.worker_id, hints.peer) if hints and hints.explain else None
        if route is not None and not self._may_see_overlaps(request):
            route = {k: v for k, v in route.items() if k in ("worker", "mode")}
        if req.stream:
            headers = [(b"x-kvmesh-route", _json(route))] if route is not None else []
            if grant is not None:
                headers += [(k.encode(), v.encode()) for k, v in grant.headers]
            return DeltaSSE(owner, dialect.stream(req), self.keepalive, public_message, self.metrics.disconnects.inc, headers)
        return _with_grant(await self._unary(request, owner, dialect.body(req, route), dialect, route), grant)

    def _pin(self, request: Request, preq: PreprocessedRequest) -> None:
        """``x-kvmesh-worker: <worker id, hex>`` (direct routing, canaries and debugging):
        honoured with ``--admin`` only, and with API keys only beside the admin key in
        ``x-kvmesh-admin-key``; the request goes to that worker or fails (no other)."""
        if self.auth.required:
            try:
                self.auth.check_admin("Bearer " + request.headers.get("x-kvmesh-admin-key", ""))
            except Unauthorized:
                raise PermissionDenied(f"{PIN_HEADER} (direct routing) needs the admin key in x-kvmesh-admin-key") from None
        text = request.headers[PIN_HEADER].strip()
        try:
            worker_id = int(text, 16)
        except ValueError:
            worker_id = -1
        if not 0 <= worker_id < 1 << 64:
            raise InvalidArgument(f"{PIN_HEADER} must be a worker id in hex (GET /admin/workers lists them), got {text[:40]!r}")
        hints = preq.routing if preq.routing is not None else RoutingHints()
        hints.worker_id = worker_id
        preq.routing = hints

    def _reserve(self, tenant: TenantPolicy, preq: PreprocessedRequest) -> Grant | Refusal:
        """Take the tenant's budget for ``preq`` (or refuse it), and mark it with its tenant:
        fair queuing's share and, with --cache-isolation tenant, its cache namespace."""
        from kvmesh.frontend.tenants import Grant

        assert self.tenants is not None  # set whenever a key has a tenant
        got = self.tenants.reserve(tenant, len(preq.token_ids), preq.stop.max_tokens or 0)
        if not isinstance(got, Grant):
            return got
        if self.config.security.cache_isolation == "tenant":
            preq.cache_salt = tenant.name
        hints = preq.routing if preq.routing is not None else RoutingHints()
        hints.tenant, hints.tenant_weight = tenant.name, tenant.weight
        preq.routing = hints
        return got

    def _settle(self, grant: Grant) -> Callable[[Usage], None]:
        gate = self.tenants
        assert gate is not None

        def settle(usage: Usage) -> None:
            gate.settle(grant, usage.prompt_tokens, usage.completion_tokens)

        return settle

    def _may_see_overlaps(self, request: Request) -> bool:
        """Per-worker overlaps in ``router_explain`` tell which prefixes are cached: shown
        without keys (one tenant), with --cache-isolation tenant (the caller's own blocks
        only), else not (another tenant's prompts would show)."""
        return not self.auth.required or self.config.security.cache_isolation == "tenant"

    def _accept(self, request: Request, dialect: Dialect) -> tuple[GenerationRequest, ModelEntry]:
        """The request's body, model, key tier and admission, checked (raises a 4xx/503)."""
        allowed = request.principal if request.checked else self.auth.tier_of(request.headers.get("authorization"))
        require_json(request)
        caller = (presented(request.headers) or "") if self.auth.required else ""
        req = dialect.parse(self._read_body(request), self.config.security, caller)
        entry = self.registry.get(req.model)
        tier = req.priority or request.headers.get("x-kvmesh-priority")
        self.auth.check_tier(tier, allowed)
        self._admit(tier)
        if tier is not None and req.priority is None:
            req.priority = tier  # type: ignore[assignment]  # checked above: the header's tier reaches the workers too
        return req, entry

    async def _unary(self, request: Request, owner: RequestOwner, body: BodyEncoder, dialect: Dialect,
                     route: object) -> Response:  # fmt: skip
        ctx = owner.ctx
        request.on_disconnect = ctx.stop_generating  # a client that leaves stops its generation
        if request.disconnected:  # ... or that left while the request was being routed
            ctx.stop_generating()
        try:
            async with owner:
                async for delta in owner.deltas():
                    body.add(delta)
        except Exception as exc:  # noqa: BLE001
            return dialect.error(exc, owner.request.request_id)
        response = Response(body.body())
        if route is not None:
            response.headers["x-kvmesh-route"] = _json(route).decode()
        return response

    def _read_body(self, request: Request) -> bytes:
        """The body the server read (it keeps none past the limit, only counts it)."""
        limit = self.config.max_body_bytes
        if request.body_size > limit:
            raise PayloadTooLarge(f"the request body has {request.body_size} bytes; the limit is {limit} bytes")
        return request.body

    def _admit(self, tier: str | None) -> None:
        """Shed by priority tier (body ``priority`` or header ``x-kvmesh-priority``)."""
        shedder = self.registry.shedder
        if shedder is None:
            return
        decision = shedder.admit(tier)
        if not decision.allowed:
            self.metrics.shed.labels(tier or "standard").inc()
            raise ResourceExhausted(
                f"the service is degraded and sheds {tier or 'standard'} requests now; retry later",
                retry_after=decision.retry_after_s,
            )


def _rate_limited(dialect: Dialect, refusal: Refusal, request_id: str) -> Response:
    """The 429 of a request over its tenant's limit, with Retry-After and x-ratelimit-*."""
    exc = TooManyRequests(refusal.message, retry_after=max(1, math.ceil(refusal.retry_after_s)))
    response = dialect.error(exc, request_id)
    response.headers.update(refusal.headers)
    return response


def _with_grant(response: Response, grant: Grant | None) -> Response:
    if grant is not None:
        response.headers.update(grant.headers)
    return response


# Constraints the grammar engine accepted already (validation is CPU work, done in a thread once).
_GUIDED_OK: dict[GuidedDecoding, None] = {}
_GUIDED_OK_MAX = 256


async def _check_guided(g: GuidedDecoding) -> None:
    """A 400 naming what the grammar engine refuses (unsupported schema feature, bad
    regex or grammar), before the request is routed."""
    if g in _GUIDED_OK:
        return
    await asyncio.to_thread(_grammar_check, g)
    if len(_GUIDED_OK) >= _GUIDED_OK_MAX:
        _GUIDED_OK.pop(next(iter(_GUIDED_OK)))
    _GUIDED_OK[g] = None


def _grammar_check(g: GuidedDecoding) -> None:
    """The grammar engine's check, in a worker thread. The engine (llguidance, numpy:
    ~100 ms and ~15 MiB) is imported here, by the first request with an output
    constraint, not by every frontend at start (issue 36)."""
    from kvmesh.preprocess import guided as guided_grammar

    guided_grammar.check(g)


def require_json(request: Request) -> None:
    """A POST body must be declared JSON: a web page can make a browser send text/plain or
    a form to any address without a CORS preflight, never application/json."""
    ctype = request.headers.get("content-type", "")
    if ctype == _JSON or ctype.split(";", 1)[0].strip().lower() == _JSON:
        return
    got = repr(ctype[:80]) if ctype else "no content-type"
    raise UnsupportedMediaType(
        f"{request.path} takes a JSON body with content-type: application/json (got {got}; curl: -H "
        "'content-type: application/json')"
    )
