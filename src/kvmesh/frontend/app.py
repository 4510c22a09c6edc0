"""The OpenAI-compatible HTTP API: the routes of the frontend's own HTTP server
(:mod:`kvmesh.frontend.server`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` (200 once a worker serves a model), ``GET /live``, ``GET /metrics``,
``GET /openapi.json``; ``/admin/workers`` and ``/admin/fault`` only with ``--admin``.
Who may call which route: :mod:`kvmesh.frontend.auth`.

Every error leaves through :func:`error_response` (OpenAI's error JSON, status from
:func:`kvmesh.errors.http_status`) before the stream starts, or as one SSE ``error``
event after it started. What a client reads is :func:`public_message`: errors that
come from workers or from a bug (5xx) carry only their kind and a request id (the
details go to the log under that id); file paths are cut out of the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

import msgspec

from kvmesh.config import FrontendConfig
from kvmesh.errors import (
    InvalidArgument,
    KvmeshError,
    MethodNotAllowed,
    PayloadTooLarge,
    PermissionDenied,
    ResourceExhausted,
    RouteNotFound,
    UnsupportedMediaType,
    http_status,
)
from kvmesh.frontend.auth import Authenticator
from kvmesh.frontend.models import ModelRegistry
from kvmesh.frontend.openapi import openapi_document
from kvmesh.frontend.pipeline import Generation, explain_route, new_request_id, preprocess_async
from kvmesh.frontend.schemas import ChatCompletionRequest, check_limits, parse
from kvmesh.frontend.server import Handler, HttpApp, Request, Response, StreamingResponse
from kvmesh.frontend.tools import ToolMode, new_call_id, parse_tool_call, tool_mode
from kvmesh.preprocess import guided as guided_grammar
from kvmesh.protocol import GuidedDecoding
from kvmesh.frontend.sse import DONE, ChatChunks, CompletionChunks, KeepAlive, SSEResponse, error_event
from kvmesh.observability import tracing, worker_metrics
from kvmesh.protocol import WorkerMetrics
from kvmesh.observability.metrics import CONTENT_TYPE_LATEST, FrontendMetrics
from kvmesh.protocol import OutputChunk
from kvmesh.runtime.context import Context
from kvmesh.runtime.distributed import call
from kvmesh.runtime.event_plane.base import EventPlane
from kvmesh.runtime.names import FAULT, METRICS

__all__ = ["Frontend", "error_response"]


class _FaultRequest(msgspec.Struct):
    worker: str
    fault: str = ""


_decode_str = msgspec.msgpack.Decoder(str).decode
_decode_worker_metrics = msgspec.msgpack.Decoder(WorkerMetrics).decode

log = logging.getLogger("kvmesh.frontend")

_json = msgspec.json.encode
_JSON = "application/json"


# absolute file paths in a message meant for a client (a model folder, a template file)
_PATHS = re.compile(r"(?<![\w.:/])/(?!v1/)(?:[\w.+@-]+/)+[\w.+@-]*")


def public_message(exc: BaseException, request_id: str) -> tuple[str, str]:
    """(message, kind) a client may read. 5xx errors (a worker's exception text and
    address, a bug) are logged with ``request_id`` and replaced by their kind."""
    if isinstance(exc, KvmeshError) and exc.status < 500:
        return _PATHS.sub("<path>", exc.message), exc.kind
    if isinstance(exc, KvmeshError):
        log.warning("request %s: %s: %s", request_id, exc.kind, exc.message)
        kind = exc.kind
        message = _SERVER_SIDE.get(kind, "the request failed on the server side")
        if isinstance(exc, ResourceExhausted) and not exc.remote:
            message = _PATHS.sub("<path>", exc.message)  # this frontend's shedding and admission: written for clients
    else:
        log.error("request %s: unexpected error", request_id, exc_info=exc)
        kind, message = "internal_error", "internal error"
    return f"{message} (request id {request_id})", kind


_SERVER_SIDE = {
    "cannot_connect": "no worker could be reached; retry later",
    "disconnected": "the worker serving this request went away",
    "connection_timeout": "connecting to a worker timed out; retry later",
    "response_timeout": "the worker did not answer in time",
    "engine_shutdown": "the worker's engine is shutting down; retry",
    "stream_incomplete": "the worker's stream ended early",
    "unknown": "the engine reported an error",
    "resource_exhausted": "the worker has no capacity for this request now; retry later",
    "cancelled": "the request was cancelled",
}


def error_response(exc: BaseException, request_id: str | None = None) -> Response:
    status = http_status(exc)
    request_id = request_id or new_request_id()
    message, kind = public_message(exc, request_id)
    code: object = "invalid_api_key" if status == 401 else status
    body = _json({"error": {"message": message, "type": kind, "param": _param_of(message), "code": code}})
    headers = {"x-request-id": request_id}
    if isinstance(exc, ResourceExhausted):
        headers["retry-after"] = str(int(exc.retry_after or 1))
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(body, status, _JSON, headers)


_FIELD = re.compile(r"at `\$\.([\w.\[\]]+)`")


def _param_of(message: str) -> str | None:
    """The field a validation message names (msgspec's ``at `$.field```)."""
    m = _FIELD.search(message)
    return None if m is None else m.group(1)


def protocol_error(status: int, message: str) -> Response:
    """A request the HTTP server refused before any route saw it."""
    if status == 413:
        return error_response(PayloadTooLarge(message))
    response = error_response(InvalidArgument(message))
    response.status = status  # 408 / 414 / 431: the server's own limits
    return response


def _usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


class Frontend:
    """Owns the registry, metrics and keep-alive task; serves the routes through ``HttpApp``."""

    def __init__(self, config: FrontendConfig, event_plane: EventPlane | None = None) -> None:
        self.config = config
        self.metrics = FrontendMetrics()
        self.registry = ModelRegistry(config, self.metrics, event_plane)
        self.keepalive = KeepAlive(config.keepalive_s)
        self.auth = Authenticator(config.security)
        self.prefill_workers: dict[int, Any] = {}  # observability: id → client of workers not routed to
        routes: dict[str, dict[str, Any]] = {
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/completions": {"POST": self.completions},
            "/v1/models": {"GET": self._keyed(self.list_models)},
            "/health": {"GET": self.health},
            "/live": {"GET": self.live},
            "/metrics": {"GET": self.render_metrics if config.security.metrics_open else self._keyed(self.render_metrics)},
            "/openapi.json": {"GET": self.openapi},
        }
        if config.security.admin:  # off by default: fault injection can crash workers
            routes["/admin/workers"] = {"GET": self._admin(self.list_workers)}
            routes["/admin/fault"] = {"POST": self._admin(self.set_fault)}
        self._openapi = _json(openapi_document(routes))
        # observability: the live cluster page (behind any API key when keys are set, by
        # header or session cookie: the dashboard checks; not in the OpenAPI document)
        from kvmesh.frontend.dashboard import Dashboard

        self.dashboard = Dashboard(self, error_response)
        routes.update(self.dashboard.routes())
        self.app = HttpApp(
            routes,
            not_found=self._not_found,
            bad_method=self._bad_method,
            on_error=error_response,
            protocol_error=protocol_error,
            lifespan=self._lifespan,
            max_body_bytes=config.max_body_bytes,
            limits=config.http,
            authorize=self._authorize if self.auth.required else None,
        )

    def _authorize(self, request: Request) -> Response | None:
        """The key of a ``/v1/*`` request, checked when its head is complete (the server
        calls this before reading the body): a missing or wrong key is a 401 before a
        byte of the body is buffered. The tier found rides on the request; the handler
        does not check again."""
        if not request.path.startswith("/v1/"):
            return None
        try:
            request.principal = self.auth.tier_of(request.headers.get("authorization"))
        except KvmeshError as exc:
            return error_response(exc)
        request.checked = True
        return None

    def _keyed(self, handler: Handler) -> Handler:
        """``handler`` behind the API key (when keys are configured)."""

        async def keyed(request: Request) -> Response | StreamingResponse:
            try:
                if not request.checked:  # else: checked at the head (_authorize)
                    self.auth.tier_of(request.headers.get("authorization"))
            except KvmeshError as exc:
                return error_response(exc)
            return await handler(request)

        return keyed

    def _admin(self, handler: Handler) -> Handler:
        """``handler`` behind the admin key; a body must be application/json (a web
        page cannot send that cross-origin without a preflight kvmesh never answers)."""

        async def admin(request: Request) -> Response | StreamingResponse:
            try:
                self.auth.check_admin(request.headers.get("authorization"))
                if not self.auth.required and not _literal_host(request.headers.get("host", "")):
                    # DNS rebinding: a page served from a name that resolves to this host
                    raise PermissionDenied("without API keys the admin routes answer only to an IP address or localhost")
                if request.method == "POST":
                    _require_json(request)
            except KvmeshError as exc:
                return error_response(exc)
            return await handler(request)

        return admin

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi)

    @contextlib.asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[None]:
        self.keepalive.start()
        if self.registry.health is not None:
            self.registry.health.start()
        if self.registry.shedder is not None:
            self.registry.shedder.start()
        try:
            yield
        finally:
            await self.keepalive.stop()
            await self.registry.close()

    # ------------------------------------------------------------------ small routes
    async def list_models(self, request: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": e.created, "owned_by": "kvmesh"}
            for name, e in sorted(self.registry.models.items())
        ]
        return Response(_json({"object": "list", "data": data}))

    async def health(self, request: Request) -> Response:
        models = {name: len(e.instances) for name, e in self.registry.models.items()}
        ready = self.registry.ready()
        body = _json({"status": "ready" if ready else "not_ready", "models": models})
        return Response(body, 200 if ready else 503)

    async def live(self, request: Request) -> Response:
        return Response(b'{"status":"live"}')

    async def render_metrics(self, request: Request) -> Response:
        # one view of the fleet: the frontend's metrics, then every worker's, labelled by worker
        workers = worker_metrics.render(await self.worker_samples())
        return Response(self.metrics.render() + workers, content_type=CONTENT_TYPE_LATEST)

    async def worker_samples(self, timeout_s: float = 1.0) -> list[tuple[str, WorkerMetrics]]:
        """Every worker's metrics, asked at once; a worker that does not answer within
        ``timeout_s`` (or is too old to know the endpoint) is left out of this scrape."""
        clients = {i.worker_id: i.client for e in self.registry.models.values() for i in e.instances.all()}
        clients.update(self.prefill_workers)

        async def one(worker_id: int, client: Any) -> tuple[str, WorkerMetrics] | None:
            try:
                m = await asyncio.wait_for(call(client, METRICS, decode=_decode_worker_metrics), timeout_s)
            except (KvmeshError, asyncio.TimeoutError, OSError):
                return None
            return None if m is None else (f"{worker_id:x}", m)

        got = await asyncio.gather(*(one(w, c) for w, c in sorted(clients.items())))
        return [g for g in got if g is not None]

    async def list_workers(self, request: Request) -> Response:
        """Every worker with its health (for operators and fault drills)."""
        health = self.registry.health
        out = []
        for name, entry in sorted(self.registry.models.items()):
            for inst in entry.instances.all():
                status = health.status(inst.worker_id) if health is not None else None
                out.append(
                    {"model": name, "worker": f"{inst.worker_id:x}", "address": inst.info.address, "pid": inst.info.pid,
                     "status": status.name.lower() if status is not None else "unknown",
                     "weight": health.weight(inst.worker_id) if health is not None else 1.0}
                )  # fmt: skip
        return Response(_json({"workers": out}))

    async def set_fault(self, request: Request) -> Response:
        """``{"worker": "<hex id>", "fault": "hang"}``: switch a worker's fault injection."""
        try:
            body = msgspec.json.decode(self._read_body(request), type=_FaultRequest)
            instance = self.registry.find_instance(int(body.worker, 16))
            result = await call(instance.client, FAULT, msgspec.msgpack.encode(body.fault), _decode_str)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return error_response(InvalidArgument(f"send {{\"worker\": \"<hex id>\", \"fault\": \"<spec>\"}}: {exc}"))
        except KvmeshError as exc:
            return error_response(exc)
        return Response(_json({"worker": body.worker, "fault": result}))

    def _not_found(self, request: Request) -> Response:
        return error_response(RouteNotFound(f"there is no route {request.path}; see /v1/models"))

    def _bad_method(self, request: Request) -> Response:
        return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.path}"))

    # ------------------------------------------------------------------ completions
    async def chat_completions(self, request: Request) -> Response | SSEResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response | SSEResponse:
        return await self._serve(request, "completion")

    def _read_body(self, request: Request) -> bytes:
        """The body the server read (it keeps none past the limit, only counts it)."""
        limit = self.config.max_body_bytes
        if request.body_size > limit:
            raise PayloadTooLarge(f"the request body has {request.body_size} bytes; the limit is {limit} bytes")
        return request.body

    async def _serve(self, request: Request, kind: Literal["chat", "completion"]) -> Response | SSEResponse:
        # tracing: the request's trace (root span when recording); the traceparent goes
        # to the workers (in the request) and back to the client (a response header)
        request_id = new_request_id()
        trace = tracing.RequestTrace(request.headers.get("traceparent"), request.method, request.path, request_id)
        response = await self._serve_traced(request, kind, request_id, trace)
        if isinstance(response, Response):
            response.headers["traceparent"] = trace.traceparent
            if response.status != 200:
                trace.end(response.status)  # refused before a stream existed
        else:
            response.headers = [*response.headers, (b"traceparent", trace.traceparent.encode())]
        return response

    async def _serve_traced(
        self, request: Request, kind: Literal["chat", "completion"], request_id: str, trace: tracing.RequestTrace
    ) -> Response | SSEResponse:
        endpoint = "chat_completions" if kind == "chat" else "completions"
        try:
            allowed = request.principal if request.checked else self.auth.tier_of(request.headers.get("authorization"))
            _require_json(request)
            req = parse(self._read_body(request), kind)
            check_limits(req, self.config.security)
            entry = self.registry.get(req.model)
            tier = req.priority or request.headers.get("x-kvmesh-priority")
            self.auth.check_tier(tier, allowed)
            self._admit(tier)
            explain = request.headers.get("x-kvmesh-explain", "") not in ("", "0", "false")
            preq = await preprocess_async(entry, req, request_id, explain, self.config.security.allow_special_tokens)
            if preq.guided is not None:
                await _check_guided(preq.guided)
        except Exception as exc:  # noqa: BLE001 - every error becomes one response
            return error_response(exc, request_id)
        metrics = entry.metrics
        metrics.input_tokens.inc(len(preq.token_ids))
        ctx = Context(preq.request_id)
        preq.trace_context = trace.traceparent
        gen = Generation(entry, preq, ctx, req.include_stop_str_in_output, req.skip_special_tokens)
        gen.trace = trace
        metrics.inflight.inc()
        try:
            stream = await gen.open()
        except Exception as exc:  # noqa: BLE001
            metrics.inflight.dec()
            metrics.finished(endpoint, str(http_status(exc)))
            return error_response(exc, request_id)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        response_id = prefix + preq.request_id
        route = explain_route(gen) if preq.routing is not None and preq.routing.explain else None
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            done = _Once(lambda: self._abandoned(gen, endpoint))
            events = self._sse_events(gen, stream, kind, response_id, endpoint, include_usage, done, _Tools.of(req))
            headers = [(b"x-kvmesh-route", _json(route))] if route is not None else None
            return SSEResponse(events, ctx, self.keepalive, self.metrics.disconnects.inc, headers, on_close=done)
        request.on_disconnect = ctx.stop_generating  # a client that leaves stops its generation
        if request.disconnected:  # ... or that left while the request was being routed
            ctx.stop_generating()
        response = await self._unary(gen, stream, kind, response_id, endpoint, route, _Tools.of(req))
        if route is not None:
            response.headers["x-kvmesh-route"] = _json(route).decode()
        return response

    def _abandoned(self, gen: Generation, endpoint: str) -> None:
        """A stream whose events never started (the client left first): give the
        router's booking back and count the request as ended."""
        gen.release()
        self._finish(gen, endpoint, "499")

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

    async def _sse_events(
        self, gen: Generation, stream: AsyncGenerator[OutputChunk, None], kind: str, response_id: str, endpoint: str,
        include_usage: bool, started: _Once, tools: _Tools | None = None,
    ) -> AsyncGenerator[bytes, None]:  # fmt: skip
        started.cancel()  # the events run: their own finally does the accounting
        entry = gen.entry
        chunks = (ChatChunks if kind == "chat" else CompletionChunks)(response_id, int(time.time()), entry.name)
        want_logprobs = gen.request.output.logprobs is not None
        status = "200"
        try:
            first = chunks.role()
            if first is not None:
                yield first
            held: list[str] | None = [] if tools is not None else None  # a possible tool call is held back
            async for text, chunk in gen.deltas(stream):
                if held is not None:
                    held.append(text)
                elif want_logprobs and chunk.logprobs:
                    yield chunks.content_with_logprobs(text, self._logprobs(gen, chunk, kind))
                elif text:
                    yield chunks.content(text)
            finish = gen.finish_reason or "stop"
            if held is not None and tools is not None and isinstance(chunks, ChatChunks):
                text = "".join(held)
                call = parse_tool_call(text, tools.mode, tools.names)
                if call is not None:
                    yield chunks.tool_call(new_call_id(), call.name, call.arguments)
                    finish = "tool_calls"
                elif text:
                    yield chunks.content(text)
            # the end of the stream as one write: finish, usage, [DONE]
            tail = chunks.finish(finish)
            if include_usage:
                tail += chunks.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
            yield tail + DONE
        except KvmeshError as exc:
            status = str(exc.status)
            if not gen.ctx.is_stopped():
                message, kind_ = public_message(exc, gen.request.request_id)
                yield error_event(message, kind_, exc.status) + DONE
        finally:
            gen.release()  # the events may end before the deltas ever started (client gone after the role event)
            if gen.ctx.is_stopped() and gen.finish_reason is None:
                status = "499"
            self._finish(gen, endpoint, status)

    async def _unary(
        self, gen: Generation, stream: AsyncGenerator[OutputChunk, None], kind: str, response_id: str, endpoint: str,
        route: Any = None, tools: _Tools | None = None,
    ) -> Response:  # fmt: skip
        parts: list[str] = []
        logprobs: list[Any] = []
        want_logprobs = gen.request.output.logprobs is not None
        status = "200"
        try:
            async for text, chunk in gen.deltas(stream):
                parts.append(text)
                if want_logprobs and chunk.logprobs:
                    lp = self._logprobs(gen, chunk, kind)
                    logprobs.extend(lp if kind == "chat" else [lp])
        except Exception as exc:  # noqa: BLE001
            status = str(http_status(exc))
            return error_response(exc, gen.request.request_id)
        finally:
            if gen.ctx.is_stopped() and gen.finish_reason in (None, "cancelled"):
                status = "499"
            self._finish(gen, endpoint, status)
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            call = parse_tool_call(text, tools.mode, tools.names) if tools is not None else None
            if call is not None:
                function = {"name": call.name, "arguments": call.arguments}
                choice["message"] = {
                    "role": "assistant", "content": None,
                    "tool_calls": [{"id": new_call_id(), "type": "function", "function": function}],
                }  # fmt: skip
                choice["finish_reason"] = "tool_calls"
            if want_logprobs:
                choice["logprobs"] = {"content": logprobs}
            obj = "chat.completion"
        else:
            choice["text"] = text
            if want_logprobs:
                choice["logprobs"] = _merge_completion_logprobs(logprobs)
            obj = "text_completion"
        body = {
            "id": response_id,
            "object": obj,
            "created": int(time.time()),
            "model": gen.entry.name,
            "choices": [choice],
            "usage": _usage(gen),
        }
        if route is not None:
            body["kvmesh_route"] = route
        return Response(_json(body))

    def _finish(self, gen: Generation, endpoint: str, status: str) -> None:
        m = gen.entry.metrics
        m.inflight.dec()
        m.output_tokens.inc(gen.completion_tokens)
        m.cached_tokens.inc(gen.cached_tokens)
        m.duration.observe(time.perf_counter() - gen.started)
        m.finished(endpoint, status)
        if gen.trace is not None:
            gen.trace.end(status)

    def _logprobs(self, gen: Generation, chunk: Any, kind: str) -> Any:
        pre = _TokenText(gen.entry.preprocessor.tokenizer)
        if kind == "chat":
            return [
                {
                    "token": pre.token_text(lp.token_id),
                    "logprob": lp.logprob,
                    "bytes": list(pre.token_text(lp.token_id).encode()),
                    "top_logprobs": [
                        {"token": pre.token_text(t), "logprob": v, "bytes": list(pre.token_text(t).encode())}
                        for t, v in lp.top
                    ],
                }
                for lp in chunk.logprobs
            ]
        return {
            "tokens": [pre.token_text(lp.token_id) for lp in chunk.logprobs],
            "token_logprobs": [lp.logprob for lp in chunk.logprobs],
            "top_logprobs": [{pre.token_text(t): v for t, v in lp.top} for lp in chunk.logprobs],
            "text_offset": [],
        }


class _Tools:
    """A chat request's tools, as its output is read back (None: no tools in play)."""

    __slots__ = ("mode", "names")

    def __init__(self, mode: ToolMode, names: frozenset[str]) -> None:
        self.mode = mode
        self.names = names

    @classmethod
    def of(cls, req: Any) -> _Tools | None:
        mode = tool_mode(req)
        if mode == "none" or not isinstance(req, ChatCompletionRequest):
            return None
        return cls(mode, frozenset(t.function.name for t in req.tools or ()))


# Constraints the grammar engine accepted already (validation is CPU work, done in a thread once).
_GUIDED_OK: dict[GuidedDecoding, None] = {}
_GUIDED_OK_MAX = 256


async def _check_guided(g: GuidedDecoding) -> None:
    """A 400 naming what the grammar engine refuses (unsupported schema feature, bad
    regex or grammar), before the request is routed."""
    if g in _GUIDED_OK:
        return
    await asyncio.to_thread(guided_grammar.check, g)
    if len(_GUIDED_OK) >= _GUIDED_OK_MAX:
        _GUIDED_OK.pop(next(iter(_GUIDED_OK)))
    _GUIDED_OK[g] = None


def _require_json(request: Request) -> None:
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


def _literal_host(host: str) -> bool:
    """``Host`` is an IP literal or localhost (never a name an attacker's DNS controls)."""
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.strip("[]")
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Once:
    """A callback run at most once, unless cancelled first."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def cancel(self) -> None:
        self._fn = None

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _TokenText:
    __slots__ = ("_tok",)

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def token_text(self, token_id: int) -> str:
        text: str = self._tok.decode([token_id], skip_special_tokens=False)
        return text


def _merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            merged[key].extend(part[key])
    return merged
