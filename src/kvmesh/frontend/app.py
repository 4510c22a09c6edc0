"""The OpenAI-compatible HTTP API: the routes of the frontend's own HTTP server
(:mod:`kvmesh.frontend.server`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` (200 once a worker serves a model), ``GET /live``, ``GET /metrics``.

Every error leaves through :func:`error_response` (OpenAI's error JSON, status from
:func:`kvmesh.errors.http_status`) before the stream starts, or as one SSE ``error``
event after it started.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from kvmesh.config import FrontendConfig
from kvmesh.errors import (
    InvalidArgument,
    KvmeshError,
    MethodNotAllowed,
    PayloadTooLarge,
    ResourceExhausted,
    RouteNotFound,
    http_status,
)
from kvmesh.frontend.models import ModelRegistry
from kvmesh.frontend.pipeline import Generation, explain_route, new_request_id, preprocess_async
from kvmesh.frontend.schemas import parse
from kvmesh.frontend.server import HttpApp, Request, Response
from kvmesh.frontend.sse import DONE, ChatChunks, CompletionChunks, KeepAlive, SSEResponse, error_event
from kvmesh.observability.metrics import CONTENT_TYPE_LATEST, FrontendMetrics
from kvmesh.runtime.context import Context
from kvmesh.runtime.distributed import call
from kvmesh.runtime.event_plane.base import EventPlane
from kvmesh.runtime.names import FAULT

__all__ = ["Frontend", "error_response"]


class _FaultRequest(msgspec.Struct):
    worker: str
    fault: str = ""


_decode_str = msgspec.msgpack.Decoder(str).decode

log = logging.getLogger("kvmesh.frontend")

_json = msgspec.json.encode
_JSON = "application/json"


def error_response(exc: BaseException) -> Response:
    status = http_status(exc)
    if isinstance(exc, KvmeshError):
        message, kind = exc.message, exc.kind
    else:
        log.exception("unexpected error", exc_info=exc)
        message, kind = f"internal error: {type(exc).__name__}", "internal_error"
    body = _json({"error": {"message": message, "type": kind, "param": None, "code": status}})
    headers = None
    if isinstance(exc, ResourceExhausted):
        headers = {"retry-after": str(int(exc.retry_after or 1))}
    return Response(body, status, _JSON, headers)


def protocol_error(status: int, message: str) -> Response:
    """A request the HTTP server refused before any route saw it."""
    return error_response(PayloadTooLarge(message) if status == 413 else InvalidArgument(message))


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
        self.app = HttpApp(
            {
                "/v1/chat/completions": {"POST": self.chat_completions},
                "/v1/completions": {"POST": self.completions},
                "/v1/models": {"GET": self.list_models},
                "/health": {"GET": self.health},
                "/live": {"GET": self.live},
                "/metrics": {"GET": self.render_metrics},
                "/admin/workers": {"GET": self.list_workers},
                "/admin/fault": {"POST": self.set_fault},
            },
            not_found=self._not_found,
            bad_method=self._bad_method,
            on_error=error_response,
            protocol_error=protocol_error,
            lifespan=self._lifespan,
            max_body_bytes=config.max_body_bytes,
        )

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
        return Response(self.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    async def list_workers(self, request: Request) -> Response:
        """Every worker with its health (for operators and fault drills)."""
        health = self.registry.health
        out = []
        for name, entry in sorted(self.registry.models.items()):
            for inst in entry.instances.all():
                status = health.status(inst.worker_id) if health is not None else None
                out.append(
                    {"model": name, "worker": f"{inst.worker_id:x}", "address": inst.info.address,
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

    async def _serve(self, request: Request, kind: str) -> Response | SSEResponse:
        endpoint = "chat_completions" if kind == "chat" else "completions"
        try:
            req = parse(self._read_body(request), kind)  # type: ignore[arg-type]
            entry = self.registry.get(req.model)
            self._admit(request, req.priority)
            explain = request.headers.get("x-kvmesh-explain", "") not in ("", "0", "false")
            preq = await preprocess_async(entry, req, new_request_id(), explain)
        except Exception as exc:  # noqa: BLE001 - every error becomes one response
            return error_response(exc)
        metrics = entry.metrics
        metrics.input_tokens.inc(len(preq.token_ids))
        ctx = Context(preq.request_id)
        gen = Generation(entry, preq, ctx, req.include_stop_str_in_output, req.skip_special_tokens)
        metrics.inflight.inc()
        try:
            stream = await gen.open()
        except Exception as exc:  # noqa: BLE001
            metrics.inflight.dec()
            metrics.finished(endpoint, str(http_status(exc)))
            return error_response(exc)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        response_id = prefix + preq.request_id
        route = explain_route(gen) if preq.routing is not None and preq.routing.explain else None
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = self._sse_events(gen, stream, kind, response_id, endpoint, include_usage)
            headers = [(b"x-kvmesh-route", _json(route))] if route is not None else None
            return SSEResponse(events, ctx, self.keepalive, self.metrics.disconnects.inc, headers)
        response = await self._unary(gen, stream, kind, response_id, endpoint, route)
        if route is not None:
            response.headers["x-kvmesh-route"] = _json(route).decode()
        return response

    def _admit(self, request: Request, priority: str | None) -> None:
        """Shed by priority tier (body ``priority`` or header ``x-kvmesh-priority``)."""
        shedder = self.registry.shedder
        if shedder is None:
            return
        tier = priority or request.headers.get("x-kvmesh-priority")
        if tier not in (None, "premium", "standard", "best_effort"):
            raise InvalidArgument(f"priority must be premium, standard or best_effort, got {tier!r}")
        decision = shedder.admit(tier)
        if not decision.allowed:
            self.metrics.shed.labels(tier or "standard").inc()
            raise ResourceExhausted(
                f"the service is degraded and sheds {tier or 'standard'} requests now; retry later",
                retry_after=decision.retry_after_s,
            )

    async def _sse_events(
        self, gen: Generation, stream: AsyncIterator[Any], kind: str, response_id: str, endpoint: str, include_usage: bool
    ) -> AsyncIterator[bytes]:
        entry = gen.entry
        chunks = (ChatChunks if kind == "chat" else CompletionChunks)(response_id, int(time.time()), entry.name)
        want_logprobs = gen.request.output.logprobs is not None
        status = "200"
        try:
            first = chunks.role()
            if first is not None:
                yield first
            async for text, chunk in gen.deltas(stream):
                if want_logprobs and chunk.logprobs:
                    yield chunks.content_with_logprobs(text, self._logprobs(gen, chunk, kind))
                elif text:
                    yield chunks.content(text)
            # the end of the stream as one write: finish, usage, [DONE]
            tail = chunks.finish(gen.finish_reason or "stop")
            if include_usage:
                tail += chunks.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
            yield tail + DONE
        except KvmeshError as exc:
            status = str(exc.status)
            if not gen.ctx.is_stopped():
                yield error_event(exc.message, exc.kind, exc.status) + DONE
        finally:
            if gen.ctx.is_stopped() and gen.finish_reason is None:
                status = "499"
            self._finish(gen, endpoint, status)

    async def _unary(
        self, gen: Generation, stream: AsyncIterator[Any], kind: str, response_id: str, endpoint: str, route: Any = None
    ) -> Response:
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
            return error_response(exc)
        finally:
            self._finish(gen, endpoint, status)
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
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


class _TokenText:
    __slots__ = ("_tok",)

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)


def _merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            merged[key].extend(part[key])
    return merged
