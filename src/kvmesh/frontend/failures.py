"""How a failure is answered: OpenAI's error JSON (:func:`error_response`, status from
:func:`kvmesh.errors.http_status`) before a stream starts; what a client may read of an
error (:func:`public_message`): errors that come from workers or from a bug (5xx) carry
only their kind and a request id (the details go to the log under that id); file paths
are cut out of the others."""

from __future__ import annotations

import logging
import re

import msgspec

from kvmesh.errors import InvalidArgument, KvmeshError, PayloadTooLarge, ResourceExhausted, http_status
from kvmesh.frontend.pipeline import new_request_id
from kvmesh.frontend.server import Response

__all__ = ["error_response", "public_message", "protocol_error"]

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
