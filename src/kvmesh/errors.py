"""The one exception tree of kvmesh.

::

    KvmeshError                      base; carries ``message`` and maps to one HTTP status
    ├── InvalidArgument              400  the request (or engine setup) is wrong: fix the input
    │   ├── ModelNotFound            404  no worker serves the requested model
    │   ├── RouteNotFound            404  no such HTTP route
    │   ├── MethodNotAllowed         405  the route exists, the method does not
    │   ├── PayloadTooLarge          413  the request body is over the limit
    │   ├── UnsupportedMediaType     415  the route takes another content type
    │   ├── Unauthorized             401  no API key, or not a valid one
    │   └── PermissionDenied         403  the key may not do this (a tier above its own, admin)
    ├── ResourceExhausted            503  admission/shedding said no, or no capacity now
    │   ├── NoWorkers                503  the instance set stayed empty past its timeout
    │   └── TooManyRequests          429  this caller holds its share already (dashboard streams per key)
    ├── Cancelled                    499  the caller stopped the request
    ├── CannotConnect                503  a worker / dependency could not be reached   (migratable)
    ├── Disconnected                 502  the connection dropped mid-stream            (migratable)
    ├── ConnectionTimeout            504  connecting took too long                     (migratable)
    ├── ResponseTimeout              504  the first (or next) response took too long   (migratable)
    ├── EngineShutdown               503  the engine failed to start or died           (migratable)
    ├── StreamIncomplete             502  the stream ended without a terminal item
    └── Unknown                      500  anything else

Errors cross process boundaries as :class:`kvmesh.protocol.ErrorInfo` (``kind`` +
``message``) and come back out of :func:`from_wire` with their type intact.
``fatal`` marks errors that end the process that raised them (an engine that died),
as opposed to per-request errors that leave the process serving.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "KvmeshError",
    "InvalidArgument",
    "ModelNotFound",
    "RouteNotFound",
    "MethodNotAllowed",
    "PayloadTooLarge",
    "UnsupportedMediaType",
    "Unauthorized",
    "PermissionDenied",
    "ResourceExhausted",
    "NoWorkers",
    "TooManyRequests",
    "Cancelled",
    "CannotConnect",
    "Disconnected",
    "ConnectionTimeout",
    "ResponseTimeout",
    "EngineShutdown",
    "StreamIncomplete",
    "Unknown",
    "from_wire",
    "http_status",
    "MIGRATABLE",
]


class KvmeshError(Exception):
    """Base of every kvmesh error. ``kind`` is the stable wire name of the class."""

    kind: ClassVar[str] = "unknown"
    status: ClassVar[int] = 500
    fatal: ClassVar[bool] = False
    remote: bool = False  # rebuilt by from_wire: its message is another process's text

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message or self.kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidArgument(KvmeshError):
    kind = "invalid_argument"
    status = 400


class ModelNotFound(InvalidArgument):
    kind = "model_not_found"
    status = 404


class RouteNotFound(InvalidArgument):
    kind = "not_found"
    status = 404


class MethodNotAllowed(InvalidArgument):
    kind = "method_not_allowed"
    status = 405


class PayloadTooLarge(InvalidArgument):
    kind = "payload_too_large"
    status = 413


class UnsupportedMediaType(InvalidArgument):
    kind = "unsupported_media_type"
    status = 415


class Unauthorized(InvalidArgument):
    kind = "invalid_api_key"
    status = 401


class PermissionDenied(InvalidArgument):
    kind = "permission_denied"
    status = 403


class ResourceExhausted(KvmeshError):
    kind = "resource_exhausted"
    status = 503

    def __init__(self, message: str = "", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoWorkers(ResourceExhausted):
    kind = "no_workers"


class TooManyRequests(ResourceExhausted):
    kind = "too_many_requests"
    status = 429


class Cancelled(KvmeshError):
    kind = "cancelled"
    status = 499


class CannotConnect(KvmeshError):
    kind = "cannot_connect"
    status = 503


class Disconnected(KvmeshError):
    kind = "disconnected"
    status = 502


class ConnectionTimeout(KvmeshError):
    kind = "connection_timeout"
    status = 504


class ResponseTimeout(KvmeshError):
    kind = "response_timeout"
    status = 504


class EngineShutdown(KvmeshError):
    kind = "engine_shutdown"
    status = 503
    fatal = True


class StreamIncomplete(KvmeshError):
    kind = "stream_incomplete"
    status = 502


class Unknown(KvmeshError):
    kind = "unknown"
    status = 500


def _all_subclasses(cls: type[KvmeshError]) -> list[type[KvmeshError]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_BY_KIND: dict[str, type[KvmeshError]] = {c.kind: c for c in _all_subclasses(KvmeshError)}

# Errors after which the frontend may re-issue the request to another worker.
MIGRATABLE: tuple[type[KvmeshError], ...] = (
    CannotConnect,
    Disconnected,
    ConnectionTimeout,
    ResponseTimeout,
    EngineShutdown,
)


def from_wire(kind: str, message: str) -> KvmeshError:
    """Rebuild a typed error from its wire form; unknown kinds become :class:`Unknown`.
    It is marked ``remote``: the frontend shows no 5xx text that came from a worker."""
    err = _BY_KIND.get(kind, Unknown)(message)
    err.remote = True
    return err


def http_status(exc: BaseException) -> int:
    """The one place an exception becomes an HTTP status."""
    if isinstance(exc, KvmeshError):
        return exc.status
    return 500
