"""OpenAI Responses requests (``POST /v1/responses``): the schema kvmesh serves, its
limits, and its translation into the internal chat request (pure: no I/O).

A Responses request runs as a chat request (:class:`~kvmesh.frontend.schemas.ChatCompletionRequest`)
through the same request path as ``/v1/chat/completions``: ``instructions`` become the
first system message, the conversation of ``previous_response_id`` follows, then the
``input`` items (messages, ``function_call`` and ``function_call_output`` items become
assistant tool calls and ``tool`` messages); ``tools``, ``tool_choice`` and
``text.format`` become the chat request's tools, tool choice and ``response_format``
(the structured-output path); ``max_output_tokens`` is its ``max_completion_tokens``.

Unknown fields are ignored (as OpenAI's clients send extras); input item types other
than ``message``, ``function_call`` and ``function_call_output``, and content parts
other than text, are a 400 naming them. :func:`check_limits` bounds the request in its
own terms (``input[2].content``) before it is translated; the chat request is then held
to the chat route's limits too, history included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument
from kvmesh.frontend import schemas
from kvmesh.frontend.dialects.common import check_prompt_text
from kvmesh.frontend.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDef,
    JsonSchema,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    NonNegInt,
    PositiveInt,
    ResponseFormat,
    Seed,
    Temperature,
    Tool,
    TopP,
    function_text_fields,
)

__all__ = [
    "ResponsesRequest",
    "ResponsesChat",
    "InputItem",
    "FunctionTool",
    "parse",
    "check_limits",
    "to_chat",
    "encode_turns",
    "decode_turns",
    "output_turn",
]

_FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
_Id = Annotated[str, Meta(min_length=1, max_length=128)]
_Choice = Literal["none", "auto", "required"]
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


Content = Union[str, list[ContentPart], None]


class InputItem(msgspec.Struct, omit_defaults=True):
    """One ``input`` item. A message may leave ``type`` out (OpenAI's "easy" input
    message); the fields a type needs are checked when it is translated."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Content = None
    call_id: _Id | None = None
    name: _FunctionName | None = None
    arguments: str | None = None
    output: Content = None
    id: str | None = None
    status: str | None = None

    def text_fields(self, at: str) -> Iterator[tuple[str, int]]:
        for field, value in (("content", self.content), ("output", self.output)):
            if value is not None:
                yield f"{at}.{field}", _chars(value)
        for field, text in (("name", self.name), ("call_id", self.call_id), ("arguments", self.arguments)):
            if text is not None:
                yield f"{at}.{field}", len(text)


class FunctionTool(msgspec.Struct, omit_defaults=True):
    type: Literal["function"]
    name: _FunctionName
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None

    def text_fields(self, at: str) -> Iterator[tuple[str, int]]:
        return function_text_fields(at, self.name, self.description, self.parameters)


class FunctionChoice(msgspec.Struct):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Meta(max_length=64)] = "response"
    schema: JsonSchema | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, omit_defaults=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields kvmesh reads (OpenAI's names, plus kvmesh's sampling extensions)."""

    model: str
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=128)] | None = None
    tool_choice: Union[_Choice, FunctionChoice, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: _Id | None = None
    metadata: Annotated[dict[str, Annotated[str, Meta(max_length=512)]], Meta(max_length=16)] | None = None
    user: str | None = None
    # extensions (the chat route's names)
    seed: Seed | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=1e6)] | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    priority: Literal["premium", "standard", "best_effort"] | None = None

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)]
        return self.input

    def text_fields(self) -> Iterator[tuple[str, int]]:
        """(path, characters) of every field that reaches the prompt."""
        if self.instructions is not None:
            yield "instructions", len(self.instructions)
        if isinstance(self.input, str):
            yield "input", len(self.input)
        else:
            for i, item in enumerate(self.input):
                yield from item.text_fields(f"input[{i}]")
        for i, tool in enumerate(self.tools or ()):
            yield from tool.text_fields(f"tools[{i}]")


def _chars(content: Content) -> int:
    if content is None or isinstance(content, str):
        return len(content or "")
    return sum(len(part.text or "") for part in content)


_decoder = msgspec.json.Decoder(ResponsesRequest)


def parse(body: bytes) -> ResponsesRequest:
    """Decode and validate a body; every failure is an InvalidArgument naming the field."""
    return schemas.decode_body(body, _decoder)


def check_limits(req: ResponsesRequest, limits: SecurityConfig) -> None:
    """The chat route's limits in this request's own terms: input items (count), the
    characters of every field that reaches the prompt (naming the largest)."""
    if isinstance(req.input, list) and len(req.input) > limits.max_messages:
        raise InvalidArgument(
            f"input holds {len(req.input)} items; at most {limits.max_messages} - at `$.input`"
        )
    check_prompt_text(req.text_fields(), limits)


class ResponsesChat(ChatCompletionRequest, kw_only=True):
    """The chat request a Responses request runs as, with what its encoders need: the
    request (every response object echoes its settings), the response's id, and the
    conversation so far (``turns``: the earlier turns and this input, without
    ``instructions``; what a later ``previous_response_id`` continues)."""

    source: ResponsesRequest
    response_id: str
    turns: list[ChatMessage]
    scope: str = ""  # whose stored conversations it may continue and leaves its own in (responses._scope)


def to_chat(req: ResponsesRequest, history: list[ChatMessage], response_id: str) -> ResponsesChat:
    """The chat request ``req`` runs as, after the conversation ``history``."""
    turns = history + [_message(item, f"input[{i}]") for i, item in enumerate(req.items())]
    messages = turns if req.instructions is None else [ChatMessage(role="system", content=req.instructions), *turns]
    if not messages:
        raise InvalidArgument("input is empty; send text or at least one input item - at `$.input`")
    return ResponsesChat(
        source=req, response_id=response_id, turns=turns, model=req.model, messages=messages, stream=req.stream, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        priority=req.priority, user=req.user, tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_format(req.text),
    )  # fmt: skip


def _message(item: InputItem, at: str) -> ChatMessage:
    if item.type == "message":
        if item.role is None:
            raise InvalidArgument(f"an input message needs a role (user, assistant, system, developer) - at `$.{at}.role`")
        role = "system" if item.role == "developer" else item.role
        return ChatMessage(role=role, content=_text(item.content, f"{at}.content"))
    if item.call_id is None:
        raise InvalidArgument(f"a {item.type} item needs its call_id - at `$.{at}.call_id`")
    if item.type == "function_call":
        if item.name is None or item.arguments is None:
            raise InvalidArgument(f"a function_call item needs name and arguments - at `$.{at}`")
        return ChatMessage(role="assistant", tool_calls=[_call(item.call_id, item.name, item.arguments)])
    if item.output is None:
        raise InvalidArgument(f"a function_call_output item needs its output - at `$.{at}.output`")
    return ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output, f"{at}.output"))


def _text(content: Content, at: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for i, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise InvalidArgument(
                f"content part type {part.type!r} is not supported; send input_text parts only - at `$.{at}[{i}].type`"
            )
    return "".join(part.text or "" for part in content)


def _call(call_id: str, name: str, arguments: str) -> msgspec.Raw:
    """A chat tool call (the shape ChatMessage.tool_calls carries)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return msgspec.Raw(msgspec.json.encode(call))


def _tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    if not tools:
        return None
    return [Tool("function", FunctionDef(t.name, t.description, t.parameters, t.strict)) for t in tools]


def _tool_choice(choice: _Choice | FunctionChoice | None) -> _Choice | NamedToolChoice | None:
    if isinstance(choice, FunctionChoice):
        return NamedToolChoice("function", NamedFunction(choice.name))
    return choice


def _format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat("json_object")
    if fmt.schema is None:
        raise InvalidArgument("text.format json_schema needs its schema (a JSON Schema) - at `$.text.format.schema`")
    return ResponseFormat("json_schema", JsonSchemaFormat(fmt.name, fmt.schema, fmt.description, fmt.strict))


# ---- the stored conversation (previous_response_id)

_turns_decoder = msgspec.json.Decoder(list[ChatMessage])


def encode_turns(turns: list[ChatMessage]) -> bytes:
    return msgspec.json.encode(turns)


def decode_turns(stored: bytes) -> list[ChatMessage]:
    return _turns_decoder.decode(stored)


def output_turn(text: str, calls: list[tuple[str, str, str]]) -> ChatMessage:
    """The answer as the next request's history: text, or tool calls ``(call_id, name, arguments)``."""
    if calls:
        return ChatMessage(role="assistant", content=text or None, tool_calls=[_call(*c) for c in calls])
    return ChatMessage(role="assistant", content=text)
