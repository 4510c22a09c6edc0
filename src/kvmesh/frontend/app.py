"""The OpenAI-compatible HTTP API: the routes of the frontend's own HTTP server
(:mod:`kvmesh.frontend.server`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(OpenAI Responses), ``POST /v1/messages`` (Anthropic Messages), ``GET /v1/models``,
``GET /health`` (200 once a worker serves a model), ``GET /live``, ``GET /metrics``,
``GET /openapi.json``; ``/admin/workers``, ``/admin/fault`` and ``/admin/usage`` (per-tenant
usage) only with ``--admin``, as are vLLM's LoRA routes ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (admin key; a load reads a folder on the workers' hosts).
Who may call which route: :mod:`kvmesh.frontend.auth`.

The generation routes are served by :mod:`kvmesh.frontend.generate` (one owner per
request, one encoder per dialect). Every error leaves through
:func:`~kvmesh.frontend.failures.error_response` before the stream starts, or as the
dialect's error event after it started; what a client reads of it is
:func:`~kvmesh.frontend.failures.public_message` (:mod:`kvmesh.frontend.failures`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvmesh.config import FrontendConfig
from kvmesh.errors import InvalidArgument, KvmeshError, MethodNotAllowed, ModelNotFound, PermissionDenied, RouteNotFound
from kvmesh.frontend.auth import Authenticator, presented
from kvmesh.frontend.failures import error_response, protocol_error, public_message
from kvmesh.frontend.generate import CHAT, COMPLETIONS, Generation, require_json
from kvmesh.frontend.models import ModelRegistry
from kvmesh.frontend.server import Handler, HttpApp, Request, Response, StreamingResponse
from kvmesh.frontend.sse import DeltaSSE, KeepAlive
from kvmesh.observability import worker_metrics
from kvmesh.observability.metrics import CONTENT_TYPE_LATEST, FrontendMetrics, export_tenant_usage
from kvmesh.protocol import MAX_ADAPTER_NAME, MAX_LORA_PATH, LoraCommand, LoraState, WorkerMetrics
from kvmesh.runtime.distributed import call
from kvmesh.runtime.event_plane.base import EventPlane
from kvmesh.runtime.names import FAULT, METRICS

if TYPE_CHECKING:  # the Anthropic and Responses dialects: imported by their first request (issue 36)
    from kvmesh.frontend.generate import Dialect
    from kvmesh.frontend.tenant_state import TenantGate  # where a key has a tenant (_tenant_gate)

__all__ = ["Frontend", "error_response", "protocol_error", "public_message"]


class _FaultRequest(msgspec.Struct):
    worker: str
    fault: str = ""


_decode_str = msgspec.msgpack.Decoder(str).decode
_decode_worker_metrics = msgspec.msgpack.Decoder(WorkerMetrics).decode


_json = msgspec.json.encode


class Frontend:
    """Owns the registry, metrics and keep-alive task; serves the routes through ``HttpApp``."""

    def __init__(self, config: FrontendConfig, event_plane: EventPlane | None = None) -> None:
        self.config = config
        self.metrics = FrontendMetrics()
        self.registry = ModelRegistry(config, self.metrics, event_plane)
        self.keepalive = KeepAlive(config.keepalive_s)
        self.auth = Authenticator(config.security)
        self.prefill_workers: dict[int, Any] = {}  # observability: id → client of workers not routed to
        self.tenants = _tenant_gate(self.auth, self.metrics)
        self.generation = Generation(config, self.registry, self.auth, self.keepalive, self.metrics, self.tenants)
        self._responses: Dialect | None = None  # built by the first /v1/responses request
        routes: dict[str, dict[str, Any]] = {
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/completions": {"POST": self.completions},
            "/v1/responses": {"POST": self.responses},
            "/v1/messages": {"POST": self.messages},
            "/v1/models": {"GET": self._keyed(self.list_models)},
            "/health": {"GET": self.health},
            "/live": {"GET": self.live},
            "/metrics": {"GET": self.render_metrics if config.security.metrics_open else self._keyed(self.render_metrics)},
            "/openapi.json": {"GET": self.openapi},
        }
        if config.security.admin:  # off by default: fault injection can crash workers
            routes["/admin/workers"] = {"GET": self._admin(self.list_workers)}
            routes["/admin/fault"] = {"POST": self._admin(self.set_fault)}
            routes["/admin/usage"] = {"GET": self._admin(self.usage)}
            routes[LOAD_LORA] = {"POST": self._admin(self.load_lora)}
            routes[UNLOAD_LORA] = {"POST": self._admin(self.unload_lora)}
        self._documented = dict(routes)  # /openapi.json: built by its first GET (issue 36: ~0.1 s at start)
        self._openapi: bytes | None = None
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
            index = self.auth.key_of(presented(request.headers))
            request.principal, request.tenant = self.auth.tier_at(index), self.auth.tenant_at(index)
        except KvmeshError as exc:
            if request.path in _ADMIN_V1:  # the admin key, checked by the route (_admin)
                return None
            if request.path == "/v1/messages":
                from kvmesh.frontend.dialects.messages import anthropic_error_response

                return anthropic_error_response(exc)
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
                    require_json(request)
            except KvmeshError as exc:
                return error_response(exc)
            return await handler(request)

        return admin

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            from kvmesh.frontend.openapi import openapi_document

            self._openapi = _json(openapi_document(self._documented))
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
        """Every model, then every LoRA adapter with its base model as ``parent``."""
        models = self.registry.models
        data: list[dict[str, object]] = [
            {"id": name, "object": "model", "created": e.created, "owned_by": "kvmesh"} for name, e in sorted(models.items())
        ]
        data += [
            {"id": name, "object": "model", "created": models[base].created, "owned_by": "kvmesh", "parent": base}
            for name, base in self.registry.adapters.listed()
        ]
        return Response(_json({"object": "list", "data": data}))

    async def load_lora(self, request: Request) -> Response:
        """vLLM's ``{"lora_name", "lora_path"}`` (+ ``model``: the base model, needed when
        several are served; ``worker``: one worker's hex id, default all of the model's
        workers that take adapters): loaded on each; the answer lists each worker's adapters."""
        try:
            body = _decode_load_lora(self._read_body(request))
            adapters = self.registry.adapters
            entry = adapters.base_of(body.model)
            adapters.check_name(body.lora_name, entry)
            workers = adapters.workers(entry, _worker_id(body.worker))
            states, errors = await adapters.command(entry, workers, LoraCommand("load", body.lora_name, body.lora_path))
            if not states:  # no worker loaded it: the first one's reason
                raise next(iter(errors.values()))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return error_response(InvalidArgument(f'send {{"lora_name": "<name>", "lora_path": "<folder>"}}: {exc}'))
        except Exception as exc:  # noqa: BLE001 - a KvmeshError, or a worker's unexpected one: one answer
            return error_response(exc)
        adapters.parents[body.lora_name] = entry.name
        return Response(_lora_answer(body.lora_name, entry.name, states, errors))

    async def unload_lora(self, request: Request) -> Response:
        """vLLM's ``{"lora_name"}`` (+ ``worker``): unloaded from the base model's workers
        (then no longer served), or from the one worker named."""
        try:
            body = _decode_unload_lora(self._read_body(request))
            adapters = self.registry.adapters
            base = adapters.parents.get(body.lora_name)
            if base is None:
                raise ModelNotFound(f"no adapter {body.lora_name!r} is loaded; see GET /v1/models")
            entry, worker = self.registry.models[base], _worker_id(body.worker)
            states, errors = await adapters.command(entry, adapters.workers(entry, worker), LoraCommand("unload", body.lora_name))
            # a worker that does not know the adapter (any more) is done with it too
            kept = {w: e for w, e in errors.items() if not isinstance(e, ModelNotFound)}
            if kept and not states:
                raise next(iter(kept.values()))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return error_response(InvalidArgument(f'send {{"lora_name": "<name>"}}: {exc}'))
        except Exception as exc:  # noqa: BLE001 - a KvmeshError, or a worker's unexpected one: one answer
            return error_response(exc)
        # no refusal: gone from every worker (no longer served), or from the one named; else
        # from those that unloaded it (still served by the others)
        done: list[int | None] = [worker] if not kept else [*states, *(errors.keys() - kept.keys())]
        for w in done:
            adapters.forget(entry, body.lora_name, w)
        return Response(_lora_answer(body.lora_name, base, states, kept))

    async def health(self, request: Request) -> Response:
        models = {name: len(e.instances) for name, e in self.registry.models.items()}
        ready = self.registry.ready()
        body = _json({"status": "ready" if ready else "not_ready", "models": models})
        return Response(body, 200 if ready else 503)

    async def live(self, request: Request) -> Response:
        return Response(b'{"status":"live"}')

    async def render_metrics(self, request: Request) -> Response:
        # one view of the fleet: the frontend's metrics, then every worker's, labelled by worker
        # the workers' series labelled with their model too (several models side by side)
        models = {f"{i.worker_id:x}": name for name, e in self.registry.models.items() for i in e.instances.all()}
        workers = worker_metrics.render(await self.worker_samples(), models)
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
                held = entry.kv.adapters.held(inst.worker_id) if entry.kv is not None else []
                if held:  # LoRA adapters it holds, as the router sees it
                    out[-1]["adapters"] = held
        return Response(_json({"workers": out}))

    async def usage(self, request: Request) -> Response:
        """Every tenant's usage, limits and what is left (keys file tenants; none: empty)."""
        return Response(self.tenants.usage_json() if self.tenants is not None else b'{"object":"usage","tenants":{}}')

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

    # ------------------------------------------------------------------ generation
    async def chat_completions(self, request: Request) -> Response | DeltaSSE:
        return await self.generation.serve(request, CHAT)

    async def completions(self, request: Request) -> Response | DeltaSSE:
        return await self.generation.serve(request, COMPLETIONS)

    async def responses(self, request: Request) -> Response | DeltaSSE:
        return await self.generation.serve(request, self._responses or self._responses_dialect())

    def _responses_dialect(self) -> Dialect:
        """The Responses dialect over this process's store (previous_response_id: its memory)."""
        from kvmesh.frontend.dialects.responses import responses_dialect
        from kvmesh.frontend.dialects.store import ResponseStore

        if self._responses is None:
            c = self.config
            store = ResponseStore(c.responses_store_entries, c.responses_store_bytes, c.responses_store_ttl_s)
            self._responses = responses_dialect(store)
        return self._responses

    async def messages(self, request: Request) -> Response | DeltaSSE:
        from kvmesh.frontend.dialects.messages import MESSAGES  # imported by the first /v1/messages request

        return await self.generation.serve(request, MESSAGES)

    def _read_body(self, request: Request) -> bytes:
        return self.generation._read_body(request)


LOAD_LORA, UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
_ADMIN_V1 = frozenset((LOAD_LORA, UNLOAD_LORA))  # /v1/ routes behind the admin key, not an API key
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADAPTER_NAME)]
_Worker = Annotated[str, msgspec.Meta(min_length=1, max_length=16, pattern="^[0-9a-fA-F]+$")]


class _LoadLora(msgspec.Struct, frozen=True):
    lora_name: _Name
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LORA_PATH)]
    model: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    worker: _Worker | None = None


class _UnloadLora(msgspec.Struct, frozen=True):
    lora_name: _Name
    worker: _Worker | None = None


_decode_load_lora = msgspec.json.Decoder(_LoadLora).decode
_decode_unload_lora = msgspec.json.Decoder(_UnloadLora).decode


def _worker_id(text: str | None) -> int | None:
    return None if text is None else int(text, 16)


def _lora_answer(name: str, model: str, states: dict[int, LoraState], errors: dict[int, Exception]) -> bytes:
    """Each worker's adapters after the command, and each failed worker's reason."""
    workers = {f"{w:x}": {"adapters": s.adapters, "load_ms": s.load_ms} for w, s in sorted(states.items())}
    out: dict[str, object] = {"lora_name": name, "model": model, "workers": workers}
    if errors:
        out["errors"] = {f"{w:x}": public_message(e, "lora")[0] for w, e in sorted(errors.items())}
    return _json(out)


def _tenant_gate(auth: Authenticator, metrics: FrontendMetrics) -> TenantGate | None:
    """The tenants' limiter when a key has a tenant, exported in /metrics."""
    policies = auth.tenants()
    if not policies:
        return None
    from kvmesh.frontend.tenant_state import TenantGate

    gate = TenantGate(policies)
    export_tenant_usage(metrics.registry, gate.metric_usage)
    return gate


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
