"""``/openapi.json``: the routes this frontend really serves (OpenAPI 3.0).

Built once from the app's route table, with the request bodies' schemas generated
from the msgspec structs that validate them (:mod:`kvmesh.frontend.schemas`), so the
document cannot drift from what is accepted. Read by the OpenAI clients' tooling and
by schemathesis in ``tests/security``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.frontend.dialects.messages_api import MessagesRequest
from kvmesh.frontend.dialects.responses_api import ResponsesRequest
from kvmesh.frontend.schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["openapi_document"]

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}

_DESCRIPTIONS = {
    "/v1/chat/completions": ("Create a chat completion (SSE when stream is true)", "ChatCompletionRequest"),
    "/v1/completions": ("Create a text completion (SSE when stream is true)", "CompletionRequest"),
    "/v1/responses": ("Create a response, OpenAI Responses (SSE events when stream is true)", "ResponsesRequest"),
    "/v1/messages": ("Create a message, Anthropic Messages (SSE events when stream is true; Anthropic's error shape)",
                     "MessagesRequest"),
    "/v1/models": ("List the served models", None),
    "/health": ("200 once a worker serves a model, else 503", None),
    "/live": ("200 while the process runs", None),
    "/metrics": ("Prometheus metrics", None),
    "/openapi.json": ("This document", None),
    "/admin/workers": ("Workers and their health (--admin)", None),
    "/admin/fault": ("Switch a worker's fault injection (--admin)", "FaultRequest"),
    "/v1/load_lora_adapter": ('Load a LoRA adapter on a model\'s workers (--admin, admin key): {"lora_name", "lora_path"}', None),
    "/v1/unload_lora_adapter": ('Unload a LoRA adapter (--admin, admin key): {"lora_name"}', None),
}

_FAULT = {
    "type": "object",
    "properties": {"worker": {"type": "string"}, "fault": {"type": "string"}},
    "required": ["worker"],
}


def _components() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest], ref_template="#/components/schemas/{name}"
    )
    for schema in components.values():
        _to_openapi_30(schema)
    components["Error"] = _ERROR
    components["FaultRequest"] = _FAULT
    return components


def _to_openapi_30(node: Any) -> None:
    """msgspec writes JSON Schema 2020-12; OpenAPI 3.0 wants ``nullable`` instead of a
    ``null`` branch in ``anyOf``, and boolean exclusive bounds."""
    if isinstance(node, dict):
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and {"type": "null"} in branches:
                rest = [b for b in branches if b != {"type": "null"}]
                node.pop(key)
                if len(rest) == 1:
                    node.update(rest[0])
                else:
                    node[key] = rest
                node["nullable"] = True
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                node[bound], node[key] = value, True
        for value in node.values():
            _to_openapi_30(value)
    elif isinstance(node, list):
        for value in node:
            _to_openapi_30(value)


def openapi_document(routes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, methods in routes.items():
        summary, body = _DESCRIPTIONS.get(path, (path, None))
        entry: dict[str, Any] = {}
        for method in methods:
            op: dict[str, Any] = {
                "summary": summary,
                "operationId": (method.lower() + path.replace("/", "_").replace(".", "_")),
                "responses": {
                    "200": {"description": "OK"},
                    "400": {"description": "Bad request", "content": error},
                    "401": {"description": "No or a wrong API key", "content": error},
                    "404": {"description": "Unknown model", "content": error},
                    "413": {"description": "Body too large", "content": error},
                    "415": {"description": "A body not sent as content-type: application/json", "content": error},
                    "503": {"description": "No capacity now", "content": error},
                },
            }
            if body is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}},
                }
            if path.startswith(("/v1/", "/admin/")):
                op["security"] = [{"bearer": []}, {"apiKey": []}] if path.startswith("/v1/") else [{"bearer": []}]
            entry[method.lower()] = op
        paths[path] = entry
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvmesh", "version": "0.1.0", "description": "OpenAI-compatible API of a kvmesh frontend"},
        "paths": paths,
        "components": {
            "schemas": _components(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},  # as Anthropic's clients send it
            },
        },
    }
