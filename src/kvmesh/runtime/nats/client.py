"""The NATS request plane, caller side: a request as a NATS message, its response
over the call-home connection (:mod:`kvmesh.runtime.nats.callhome`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from kvmesh.errors import CannotConnect, ConnectionTimeout, Disconnected, InvalidArgument, ResponseTimeout, from_wire
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import KILL, STOP
from kvmesh.runtime.nats.callhome import CallHomeServer, CallHomeStream
from kvmesh.runtime.nats.connect import plane_settling
from kvmesh.runtime.nats.wire import NatsReply, NatsRequest, reply_mac, request_seal, request_subject
from kvmesh.runtime.seal import MessageSeal
from kvmesh.runtime.stream import Mailbox, StreamClient

__all__ = ["NatsRequestClient", "PLANE_WAIT_S"]

log = logging.getLogger("kvmesh.runtime.nats")

# How long a request waits for the NATS plane to come back before its error goes to
# the caller (NatsRequestClient); override per client with ``plane_wait_s``.
PLANE_WAIT_S = 15.0


class NatsRequestClient(StreamClient):
    """Streams requests to one worker instance (``lease_id``) over NATS + call-home TCP.

    Same ``stream``/``close`` surface as :class:`~kvmesh.runtime.tcp_client.TcpClient`.
    ``connect_timeout`` bounds the NATS request/reply and the wait for the worker to
    call home; ``response_timeout`` (if set) the wait for the first response item.

    A request whose NATS hop fails because the plane itself is down (this process is
    disconnected from NATS, or reconnected less than ``plane_wait_s`` ago, when the
    worker may not have re-subscribed yet) is not failed at once: it waits for the
    plane and is sent again, under a new stream id, until ``plane_wait_s``
    (:data:`PLANE_WAIT_S`, 15 s by default) after the first failure; then the error
    goes to the caller (the frontend migrates the request). Only requests no worker
    has called home for are sent again, and a late answer to an earlier send is
    killed, so a request is never served twice.
    """

    def __init__(
        self,
        nc: NatsClient,
        callhome: CallHomeServer,
        namespace: str,
        component: str,
        lease_id: int,
        connect_timeout: float = 5.0,
        response_timeout: float | None = None,
        plane_wait_s: float | None = None,
    ) -> None:
        request_subject(namespace, component, "x", lease_id)  # validates the names
        self.nc = nc
        self.callhome = callhome
        self.plane_wait_s = PLANE_WAIT_S if plane_wait_s is None else plane_wait_s
        self.namespace = namespace
        self.component = component
        self.lease_id = lease_id
        self.connect_timeout = connect_timeout
        self.response_timeout = response_timeout
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_reply = msgspec.msgpack.Decoder(NatsReply).decode
        self._seal: MessageSeal | None = None  # with the call-home server's secret, made on first use

    def subject(self, endpoint: str) -> str:
        return request_subject(self.namespace, self.component, endpoint, self.lease_id)

    async def _open(
        self, endpoint: str, payload: bytes, ctx: Context, box: Mailbox
    ) -> Callable[[], Awaitable[None] | None]:
        try:
            subject = self.subject(endpoint)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        home = self.callhome
        await home.start()
        stream = home.open(box)
        loop = asyncio.get_running_loop()
        if self.response_timeout is not None:
            box.timer = loop.call_later(self.response_timeout, self._timed_out, stream, subject)
        # The NATS reply and the worker's call-home frames race; the stream does not wait
        # for the reply, which only matters when it is an error (see _replied).
        request = asyncio.ensure_future(self._request(subject, stream, payload))
        request.add_done_callback(lambda task: self._replied(task, stream, subject))
        ctx.on_stop(lambda c: home.control(stream, KILL if c.is_killed() else STOP))

        def done() -> None:
            if not request.done():
                request.cancel()
            if not box.ended:
                home.abandon(stream)

        return done

    def _replied(self, request: asyncio.Task[str | None], stream: CallHomeStream, subject: str) -> None:
        if request.cancelled():
            return
        error = request.exception()  # retrieved in every case
        if stream.box.ended or stream.conn is not None:
            return  # the worker called home: the stream is under way whatever the reply said
        if error is not None:
            self.callhome.abandon(stream, error)
        else:
            loop = asyncio.get_running_loop()
            stream.ack_timer = loop.call_later(self.connect_timeout, self._no_call_home, stream, subject, request.result())

    async def _request(self, subject: str, stream: CallHomeStream, payload: bytes) -> str | None:
        """The NATS hop, sent again while the plane itself is down or settling (see the
        class docstring); any other failure, or one past ``plane_wait_s``, is raised."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        delay = 0.05
        while True:
            try:
                return await self._request_once(subject, stream, payload)
            except (CannotConnect, ConnectionTimeout) as exc:
                if not plane_settling(self.nc, self.plane_wait_s):
                    raise
                deadline = deadline or loop.time() + self.plane_wait_s
                if loop.time() >= deadline or stream.conn is not None or stream.box.ended:
                    raise
                log.info("NATS plane down or settling (%s); sending %s again", exc.message, subject)
            await self._plane_back(deadline)
            await asyncio.sleep(delay)  # let the worker's subscription come back too
            delay = min(delay * 2, 0.5)
            if stream.conn is not None or stream.box.ended:
                return None  # answered after all (a late reply), or abandoned meanwhile
            self.callhome.rekey(stream)

    async def _plane_back(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not self.nc.is_connected and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def _request_once(self, subject: str, stream: CallHomeStream, payload: bytes) -> str | None:
        """Send the request; raise the worker's typed error. Returns None, or with a
        cluster secret the text of a reply that was ignored for want of a valid MAC."""
        secret = self.callhome.secret
        data = self._encode(NatsRequest(stream.sid, self.callhome.address, msgspec.Raw(payload)))
        if secret is not None:
            if self._seal is None:
                self._seal = request_seal(secret)
            data = self._seal.seal(data, subject.encode(), time.time())
        try:
            msg = await self.nc.request(subject, data, timeout=self.connect_timeout)
        except nats.errors.NoRespondersError:
            raise CannotConnect(f"nobody serves {subject}") from None
        except TimeoutError:  # nats.errors.TimeoutError included
            raise ConnectionTimeout(f"no answer on {subject} within {self.connect_timeout} s") from None
        except nats.errors.Error as exc:
            raise CannotConnect(f"NATS request on {subject} failed: {exc or type(exc).__name__}") from None
        try:
            reply = self._decode_reply(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Disconnected(f"malformed reply on {subject}: {exc}") from None
        if secret is not None and not hmac.compare_digest(reply.mac, reply_mac(secret, msg.subject, reply.kind, reply.message)):
            log.warning("ignoring a reply on %s not signed with this fleet's cluster secret", subject)
            # no verdict: the stream waits for the worker's call-home, within its timeouts
            return f"a reply not signed with this fleet's cluster secret was ignored ({reply.kind or 'accepted'}: {reply.message})"
        if reply.kind:
            raise from_wire(reply.kind, reply.message)
        return None

    def _timed_out(self, stream: CallHomeStream, subject: str) -> None:
        stream.box.timer = None
        if stream.box.answered or stream.box.ended:
            return
        message = f"the worker on {subject} sent no response within {self.response_timeout} s"
        self.callhome.abandon(stream, ResponseTimeout(message))

    def _no_call_home(self, stream: CallHomeStream, subject: str, note: str | None = None) -> None:
        stream.ack_timer = None
        if stream.conn is None:
            message = f"the worker on {subject} accepted but did not call home within {self.connect_timeout} s"
            if note is not None:
                message = f"no worker on {subject} called home within {self.connect_timeout} s; {note}"
            self.callhome.abandon(stream, ResponseTimeout(message))

    async def close(self) -> None:
        """Nothing to release: the NATS client and the call-home server are shared."""

