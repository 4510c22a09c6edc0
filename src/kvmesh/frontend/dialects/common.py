"""What the Responses and Messages dialects share (pure): the answer collected from a
delta stream, the dispatch of a delta to an encoder's method, and the prompt-text
bound checked in a dialect's own field names."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument
from kvmesh.frontend.deltas import Delta, Finish, Start, Text, ToolCall

__all__ = ["Answer", "EventEncoder", "check_prompt_text"]


class Answer:
    """The output so far: its text, and its tool calls by index."""

    __slots__ = ("parts", "calls")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.calls: list[list[str]] = []  # [call_id, name, arguments so far]

    def add(self, delta: Text | ToolCall) -> None:
        if isinstance(delta, Text):
            if delta.text:
                self.parts.append(delta.text)
        else:
            self.add_call(delta)

    def add_call(self, d: ToolCall) -> None:
        if d.index == len(self.calls):
            self.calls.append([d.id or "", d.name or "", d.arguments])
        else:
            self.calls[d.index][2] += d.arguments

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def call_list(self) -> list[tuple[str, str, str]]:
        return [(c[0], c[1], c[2]) for c in self.calls]


class EventEncoder(ABC):
    """A :class:`~kvmesh.frontend.deltas.StreamEncoder` whose ``encode`` hands each
    delta to the method for its kind."""

    __slots__ = ()

    def encode(self, delta: Delta) -> bytes:
        if isinstance(delta, Text):
            return self._text(delta)
        if isinstance(delta, ToolCall):
            return self._tool_call(delta)
        if isinstance(delta, Start):
            return self._start(delta)
        return self._finish(delta)

    @abstractmethod
    def _start(self, d: Start) -> bytes: ...

    @abstractmethod
    def _text(self, d: Text) -> bytes: ...

    @abstractmethod
    def _tool_call(self, d: ToolCall) -> bytes: ...

    @abstractmethod
    def _finish(self, d: Finish) -> bytes: ...

    @abstractmethod
    def error(self, message: str, kind: str, status: int) -> bytes: ...


def check_prompt_text(fields: Iterable[tuple[str, int]], limits: SecurityConfig) -> None:
    """The characters of every field that reaches the prompt (``(path, characters)``)
    within ``--max-message-chars``; past it, a 400 naming the largest field."""
    found = list(fields)
    chars = sum(n for _, n in found)
    if chars > limits.max_message_chars:
        where, largest = max(found, key=lambda field: field[1])
        raise InvalidArgument(
            f"the request's prompt text holds {chars} characters; at most {limits.max_message_chars} "
            f"(the largest field has {largest} characters) - at `$.{where}`"
        )
