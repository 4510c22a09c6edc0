"""The NATS request plane: a request travels as a NATS message, its response streams
back over a direct TCP connection from the worker to the caller ("call home").

::

    caller process                                            worker process
    CallHomeServer listens on host:port (one per process)
    NatsRequestClient.stream(endpoint, payload, ctx)
      1. register a mailbox for a fresh sid
      2. NATS request  {namespace}.{component}.{endpoint}-{lease_id:x}
         NatsRequest(sid, callhome "host:port", payload)  ────▶  NatsRequestServer
      3.                    ◀──── NATS reply NatsReply()       accepted at once, or a
                                                            typed error (malformed);
                                                            nobody subscribed → "no
                                                            responders" → CannotConnect
         (the stream does not wait for the reply: it races the call-home frames and
         matters only as an error, or to start the wait for the worker's Ack)
      4.          ◀════ TCP connection to callhome (one per caller address, reused)
                  ◀──── Ack(sid)                         identifies the stream
                  ◀──── Out(sid, item) … End(sid) | Err(sid, kind, message)
                  ────▶ Ctl(sid, STOP | KILL)            ctx.stop_generating() / ctx.kill()

The worker end of a call-home connection is the TCP plane's own connection protocol
(:class:`~kvmesh.runtime.tcp_server.ServerConnection`) dialled in the other direction: it serves the stream with the
same handler loop (Ack, Out per item, End, typed Err, backpressure), maps Ctl frames
to the stream's context and kills every stream it carries when the connection drops.

Trust: stream ids are random 63-bit numbers drawn by the call-home server, and a
stream is bound to the call-home connection whose ``Ack`` claimed it first; ``Out``,
``End`` and ``Err`` frames for it from any other connection are dropped and counted
(``CallHomeServer.foreign_frames``). With a cluster secret (:mod:`kvmesh.runtime.auth`)
every request message is sealed (:mod:`kvmesh.runtime.seal`: AES-GCM under a key
derived from the secret, bound to its subject, timestamped, its nonce remembered):
nobody on NATS reads its payload, and the worker opens it, refusing a forged, altered,
replayed or stale one, before it dials anything; the call-home connection starts
with the mutual handshake (channel ``callhome``). Replies carry an HMAC bound to the
caller's reply inbox (they hold no user data: accepted, or an error of the hop).

Failures come out of :meth:`NatsRequestClient.stream` typed like the TCP plane's:
``CannotConnect`` (no responders, NATS unreachable), ``ConnectionTimeout`` (no reply
to the NATS request in time), ``ResponseTimeout`` (the worker accepted but never
called home, or sent no first item within ``response_timeout``), ``Disconnected``
(the call-home connection dropped mid-stream), and the worker's own typed errors.

Modules: :mod:`.connect` (connecting, TLS, plane state), :mod:`.wire` (subjects, the
request message, its seal), :mod:`.server` (worker side), :mod:`.callhome` (the
caller's listener and its streams), :mod:`.client` (caller side). The stream
transport they share with the TCP plane is :mod:`kvmesh.runtime.stream`.
"""

from __future__ import annotations

from kvmesh.runtime.nats.callhome import CallHomeServer
from kvmesh.runtime.nats.client import PLANE_WAIT_S, NatsRequestClient
from kvmesh.runtime.nats.connect import connect_nats, nats_tls_context, plane_settling, sync_with_server
from kvmesh.runtime.nats.server import NatsRequestServer
from kvmesh.runtime.nats.wire import NatsReply, NatsRequest, reply_mac, request_seal, request_subject

__all__ = [
    "NatsRequest",
    "NatsReply",
    "NatsRequestServer",
    "NatsRequestClient",
    "CallHomeServer",
    "connect_nats",
    "sync_with_server",
    "request_subject",
    "plane_settling",
    "PLANE_WAIT_S",
    "request_seal",
    "reply_mac",
    "nats_tls_context",
]
