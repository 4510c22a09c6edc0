"""The typed delta stream: what one request's owner yields, whatever the API dialect.

A request's owner (:mod:`kvmesh.frontend.owner`) turns the worker's token chunks into
these values; a dialect encoder (Chat Completions, Completions, OpenAI Responses,
Anthropic Messages; SSE or one JSON body) turns them into bytes. Nothing here knows a
dialect: ids carry no dialect prefix, finish reasons are kvmesh's own, logprobs are
token text and numbers, not any API's JSON shape.

Grammar of one stream (``?`` at most once, ``*`` any number)::

    stream   := Start body Finish
              | Start body <raises KvmeshError>        (a failure after the start)
    body     := Text* ToolCall*

* :class:`Start` comes exactly once, first, when the worker stream is open (the
  request is routed; errors before it are plain HTTP errors, not stream events).
* :class:`Text` carries text released by the detokenizer and the stop strings, in
  order; concatenated they are the output. ``text`` may be empty only when the delta
  carries ``logprobs`` (tokens that released no text yet). When the request asked for
  logprobs, every generated token's :class:`TokenLogprob` arrives in exactly one Text.
* :class:`ToolCall` fragments come after every Text (an output read as tool calls is
  held back until it is complete). Calls are numbered from 0 by ``index``; a call's
  fragments are contiguous, its first fragment carries ``id`` and ``name`` (later ones
  None), and its ``arguments`` fragments concatenate to the call's JSON arguments.
* :class:`Finish` comes exactly once, last, with the reason and the :class:`Usage`
  (usage is built here only; encoders never count tokens themselves).

A consumer that stops iterating early (client gone) stops the request; an error after
Start is raised by the iterator (a :class:`~kvmesh.errors.KvmeshError`) and no Finish
follows. Values are immutable; an encoder may keep them. The consumers:
:class:`StreamEncoder` (SSE) and :class:`BodyEncoder` (one JSON body), one pair per
dialect (:mod:`kvmesh.frontend.dialects`).
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

__all__ = [
    "Delta", "FinishReason", "Finish", "Start", "Text", "TokenLogprob", "ToolCall", "Usage", "StreamEncoder",
    "BodyEncoder",
]  # fmt: skip

# stop: the model ended (EOS, a stop token) or a stop string matched (``stop_sequence``);
# length: max_tokens reached; tool_calls: the output was read as tool calls;
# cancelled: the request's context was stopped (client gone, server draining)
FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


class Start(msgspec.Struct, frozen=True, gc=False):
    """The stream is open: the request was routed and a worker is generating."""

    request_id: str  # kvmesh's id; encoders add their dialect's prefix (``chatcmpl-``, ``msg_`` ...)
    model: str  # the served model's name
    created: int  # unix seconds
    prompt_tokens: int  # known from the start (Anthropic's ``message_start`` reports it)


class TokenLogprob(msgspec.Struct, frozen=True, gc=False):
    """One generated token: its text (special tokens spelled out), its log-probability,
    and the most likely alternatives at that position, best first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


class Text(msgspec.Struct, frozen=True, gc=False):
    """Output text, and the logprobs of the tokens this delta covers (None when the
    request did not ask for logprobs)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None


class ToolCall(msgspec.Struct, frozen=True, gc=False):
    """A fragment of tool call ``index``: the first fragment names it (``id``, ``name``);
    ``arguments`` fragments concatenate to the call's arguments as JSON text."""

    index: int
    arguments: str
    id: str | None = None  # e.g. ``call_<hex>``; only on a call's first fragment
    name: str | None = None  # the function's name; only on a call's first fragment


class Usage(msgspec.Struct, frozen=True, gc=False):
    """Tokens of the request: the prompt's (of which ``cached_tokens`` were found in the
    worker's KV cache) and the ones generated."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Finish(msgspec.Struct, frozen=True, gc=False):
    """The stream's end: why, and the request's token counts. ``stop_sequence``: the
    stop string that ended it (reason ``stop``), None when the model itself ended."""

    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None


Delta = Start | Text | ToolCall | Finish


class StreamEncoder(Protocol):
    """A dialect's streamed answer: each delta's bytes (SSE events), in stream order.

    ``encode`` returns ``b""`` when a delta writes nothing; the bytes of :class:`Finish`
    end the response (the writer sends them with the end of the body in one write).
    After a failure, ``error`` gives the response's last bytes instead.
    """

    def encode(self, delta: Delta) -> bytes: ...

    def error(self, message: str, kind: str, status: int) -> bytes: ...


class BodyEncoder(Protocol):
    """A dialect's unary answer: ``add`` every delta, then ``body`` (after Finish)."""

    def add(self, delta: Delta) -> None: ...

    def body(self) -> bytes: ...
