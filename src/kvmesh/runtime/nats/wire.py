"""The NATS request plane's wire: subjects, the request message (sealed with a cluster
secret), the reply and its MAC."""

from __future__ import annotations

import msgspec

from kvmesh.errors import InvalidArgument
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.frames import MAX_REQUEST_FRAME
from kvmesh.runtime.seal import MessageSeal

__all__ = [
    "NatsRequest", "NatsReply", "ACCEPTED", "REQUEST_WINDOW_S", "request_seal", "reply_mac", "request_subject",
    "split_address",
]  # fmt: skip

# How far a sealed request's timestamp may be from the worker's clock. NATS delivers a
# request at once (or not at all: a request sent again is sealed again), so this only
# has to cover clock skew between hosts; it is also how long a worker remembers nonces.
REQUEST_WINDOW_S = 30.0

_BAD_TOKEN_CHARS = frozenset(" \t\r\n.*>")


class NatsRequest(msgspec.Struct, array_like=True):
    """The NATS message that opens a stream: ``payload`` is the endpoint's own msgpack.

    With a cluster secret the message on the subject is this struct sealed
    (:func:`request_seal`): encrypted, authenticated, bound to the subject, fresh."""

    sid: int
    callhome: str
    payload: msgspec.Raw


def request_seal(secret: ClusterSecret) -> MessageSeal:
    """The seal of requests (bound to their subject by the caller and the worker)."""
    return MessageSeal(secret, "nats-request", window_s=REQUEST_WINDOW_S, max_bytes=MAX_REQUEST_FRAME)


class NatsReply(msgspec.Struct, array_like=True, omit_defaults=True):
    """The worker's immediate answer: empty ``kind`` = accepted, else a typed error."""

    kind: str = ""
    message: str = ""
    mac: bytes = b""  # with a cluster secret: reply_mac, bound to the request's reply inbox


def reply_mac(secret: ClusterSecret, inbox: str, kind: str, message: str) -> bytes:
    """A reply's MAC: a caller with a secret ignores a reply without a valid one (a
    forged error cannot end a stream; the stream's own timeouts still bound it)."""
    return secret.sign("nats-reply", inbox.encode(), kind.encode(), message.encode())


ACCEPTED = msgspec.msgpack.encode(NatsReply())


def _check_token(what: str, value: str) -> None:
    if not value or any(c in _BAD_TOKEN_CHARS for c in value):
        raise ValueError(f"{what} {value!r} must be a non-empty NATS subject token (no spaces, '.', '*' or '>')")


def request_subject(namespace: str, component: str, endpoint: str, lease_id: int) -> str:
    """``{namespace}.{component}.{endpoint}-{lease_id:x}``; ValueError for a bad name."""
    for what, value in (("namespace", namespace), ("component", component), ("endpoint", endpoint)):
        _check_token(what, value)
    return f"{namespace}.{component}.{endpoint}-{lease_id:x}"


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"call-home address {address!r} is not host:port")
    return host.strip("[]"), int(port)

