"""Event plane: typed publish/subscribe for KV events, load reports and health state.

Backends: ``memory`` (one process), ``zmq`` (default; each publisher binds a PUB socket
and subscribers connect to the publishers they are told about), ``nats`` (subjects
``{namespace}.events.{topic}`` on a NATS server).

Every message travels in an :class:`Envelope` carrying the publisher's id and a
sequence number that increases by one per message per (publisher, topic), starting
at 1. Subscribers use it to detect gaps (:class:`GapTracker`); repairing a gap (e.g.
asking a worker for its KV dump) is the consumer's business.

Contract:

* ``publisher(topic)`` → :class:`Publisher`; ``publish(payload_bytes)`` never blocks and
  never raises into the caller (a slow or absent subscriber loses messages; that is
  what sequence numbers are for). ``publisher.address`` is what a subscriber needs to
  reach it (zmq: ``tcp://host:port``; others: ``""``).
* ``subscribe(topic)`` → :class:`Subscription`, an async iterator of envelopes from
  every publisher of that topic it is connected to. For zmq, ``connect(address)`` /
  ``disconnect(address)`` add and remove publishers (driven by discovery or by the
  embedded supervisor); the other backends reach all publishers of the topic by
  themselves and treat those calls as no-ops.
* ``close()`` ends every publisher and subscription of the plane.

Trust: an envelope is data from the network. Subscribers drop (and count in
``malformed``) every message that does not decode, including an invalid UTF-8 topic,
and never stop reading; zmq subscribers refuse messages over ``MAX_EVENT_BYTES``.
With a cluster secret (:mod:`kvmesh.runtime.auth`), where a broker relays envelopes
(nats), publishers seal each envelope with an HMAC over (publisher, seq, topic,
payload) and subscribers drop envelopes without a valid one (counted in ``unsigned``);
zmq connections are CURVE-authenticated with keys derived from the secret instead (a MAC
per envelope would prove nothing more: see :mod:`~kvmesh.runtime.event_plane.zmq`).
"""

from __future__ import annotations

import abc
import hmac
from collections.abc import AsyncIterator, Callable

import msgspec

from kvmesh.runtime.auth import ClusterSecret

__all__ = ["Envelope", "Publisher", "Subscription", "EventPlane", "GapTracker", "MAX_EVENT_BYTES", "seal", "Opener"]

MAX_EVENT_BYTES = 16 * 1024 * 1024  # one envelope at most (a KV event of 64 Ki blocks is ~1.2 MiB)


class Envelope(msgspec.Struct, array_like=True, gc=False):
    publisher_id: int
    seq: int
    topic: str
    payload: bytes
    mac: bytes = b""  # with a cluster secret: see seal()


def _mac(secret: ClusterSecret, env: Envelope) -> bytes:
    head = env.publisher_id.to_bytes(9, "little", signed=True) + env.seq.to_bytes(9, "little", signed=True)
    return secret.sign("event", head, env.topic.encode(), env.payload)


def seal(secret: ClusterSecret | None, env: Envelope) -> Envelope:
    """``env`` with its MAC set (unchanged without a secret)."""
    if secret is not None:
        env.mac = _mac(secret, env)
    return env


class Opener:
    """Decodes and checks envelopes for one subscription: ``open(data)`` → the envelope,
    or None (counted in ``malformed`` or ``unsigned``) for anything else."""

    __slots__ = ("_decode", "_secret", "malformed", "unsigned")

    def __init__(self, secret: ClusterSecret | None) -> None:
        self._decode: Callable[[bytes], Envelope] = msgspec.msgpack.Decoder(Envelope).decode
        self._secret = secret
        self.malformed = 0
        self.unsigned = 0

    def open(self, data: bytes) -> Envelope | None:
        try:
            env = self._decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, ValueError):
            self.malformed += 1
            return None
        secret = self._secret
        if secret is not None and not hmac.compare_digest(env.mac, _mac(secret, env)):
            self.unsigned += 1
            return None
        return env


class Publisher(abc.ABC):
    address: str = ""

    @abc.abstractmethod
    def publish(self, payload: bytes) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class Subscription(abc.ABC):
    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[Envelope]: ...

    def connect(self, address: str) -> None:
        """Also receive from the publisher at ``address`` (zmq); a no-op elsewhere."""

    def disconnect(self, address: str) -> None:
        """Stop receiving from ``address`` (zmq); a no-op elsewhere."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class CheckedSubscription(Subscription):
    """A subscription that opens envelopes from the network with an :class:`Opener`
    and counts what it dropped."""

    _opener: Opener

    @property
    def malformed(self) -> int:
        return self._opener.malformed

    @property
    def unsigned(self) -> int:
        return self._opener.unsigned


class EventPlane(abc.ABC):
    """A plane owns the publishers and subscriptions it made (:meth:`_own`) and closes
    them, publishers first, when it closes (:meth:`_close_owned`)."""

    name: str = "abstract"

    def __init__(self) -> None:
        self._publishers: list[Publisher] = []
        self._subscriptions: list[Subscription] = []
        self._closed = False

    @abc.abstractmethod
    async def publisher(self, topic: str, publisher_id: int) -> Publisher: ...

    @abc.abstractmethod
    async def subscribe(self, topic: str) -> Subscription: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.name} event plane is closed")

    async def _close_owned(self) -> None:
        self._closed = True
        pubs, self._publishers = self._publishers, []
        subs, self._subscriptions = self._subscriptions, []
        for pub in pubs:
            await pub.close()
        for sub in subs:
            await sub.close()


class GapTracker:
    """Per-publisher sequence tracking. ``observe`` returns the number of messages
    missed before this one (0 when in order); a sequence that goes back to 1 means
    the publisher restarted and is not a gap."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}

    def observe(self, envelope: Envelope) -> int:
        last = self._last.get(envelope.publisher_id)
        self._last[envelope.publisher_id] = envelope.seq
        if last is None or envelope.seq == 1 or envelope.seq <= last:
            return 0
        return envelope.seq - last - 1

    def forget(self, publisher_id: int) -> None:
        self._last.pop(publisher_id, None)
