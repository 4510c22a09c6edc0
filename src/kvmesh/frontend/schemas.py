"""OpenAI request schemas (the subset kvmesh serves), validated by msgspec.

A body that does not match raises ``msgspec.ValidationError`` whose message names the
field (``Expected `int` >= 1 - at `$.max_tokens```); :func:`parse` turns that into an
:class:`~kvmesh.errors.InvalidArgument`. Unknown fields are ignored, as OpenAI's own
clients send extras. Every number has a range that fits the wire (int32 counts, int64
seeds); :func:`check_limits` bounds what a request may ask of the frontend (stop
strings, messages, the characters of every field that reaches the prompt) before any of
it is templated or tokenized.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypeVar, Union, cast

import msgspec
from msgspec import Meta

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument

__all__ = ["ResponseFormat", "Tool", "NamedToolChoice", "ChatMessage", "ChatCompletionRequest", "CompletionRequest", "StreamOptions", "parse", "decode_body", "check_limits", "largest_text_field"]

T = TypeVar("T")

_I32 = 2**31 - 1
NonNegInt = Annotated[int, Meta(ge=0, le=_I32)]
PositiveInt = Annotated[int, Meta(ge=1, le=_I32)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Meta(ge=0, le=_I32)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[msgspec.Raw] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise InvalidArgument(f"content part type {part.type!r} is not supported; send text parts only")
            parts.append(part.text or "")
        return "".join(parts)

    def extra_chars(self) -> int:
        """Characters this message brings to the prompt besides its text: name, tool
        call id and tool calls (their JSON)."""
        return sum(n for _, n in self.text_fields("")) - len(self.text())

    def text_fields(self, at: str) -> Iterator[tuple[str, int]]:
        """(path, characters) of each field :meth:`chars` counts; ``at``: the message's path."""
        yield f"{at}.content", len(self.text())
        for field, value in (("name", self.name), ("tool_call_id", self.tool_call_id)):
            if value is not None:
                yield f"{at}.{field}", len(value)
        if self.tool_calls:
            yield f"{at}.tool_calls", sum(map(len, self.tool_calls))


# ---- structured outputs and tools (issue 18). JSON Schemas are plain JSON values: the
# grammar engine reads them (kvmesh.preprocess.guided), the frontend never walks them.


# A JSON Schema as decoded JSON (values of any JSON type, hence Any); never walked here.
JsonSchema = dict[str, Any]


class JsonSchemaFormat(msgspec.Struct, omit_defaults=True):
    name: Annotated[str, Meta(max_length=64)] = "response"
    schema: JsonSchema | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def function_text_fields(
    at: str, name: str, description: str | None, schema: JsonSchema | None, schema_field: str = "parameters"
) -> Iterator[tuple[str, int]]:
    """(path, characters) of the text a function tool brings to the prompt, in any
    dialect: its name, description and parameters schema (counted as JSON, under the
    dialect's ``schema_field``); ``at``: the path up to the function's fields."""
    yield f"{at}.name", len(name)
    if description is not None:
        yield f"{at}.description", len(description)
    if schema is not None:
        yield f"{at}.{schema_field}", len(msgspec.json.encode(schema))


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDef

    def chars(self) -> int:
        fn = self.function
        chars = len(fn.name) + len(fn.description or "")
        return chars if fn.parameters is None else chars + len(msgspec.json.encode(fn.parameters))

    def text_fields(self, at: str) -> Iterator[tuple[str, int]]:
        """(path, characters) of the text this tool brings to the prompt (its
        parameters schema counted as JSON: :meth:`chars` is their sum); ``at``: the
        tool's path."""
        fn = self.function
        return function_text_fields(f"{at}.function", fn.name, fn.description, fn.parameters)


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions (OpenAI names, plus extensions)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    stop: Union[str, list[str], None] = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # extensions (vLLM / Dynamo names)
    top_k: Annotated[int, Meta(ge=-1, le=_I32)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=1e6)] | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Literal["premium", "standard", "best_effort"] | None = None
    kv_overlap_weight: Annotated[float, Meta(ge=0.0, le=1e6)] | None = None
    router_temperature: Annotated[float, Meta(ge=0.0, le=1e6)] | None = None
    router_explain: bool = False
    # structured outputs, vLLM's names: regex (Rust regex syntax), choice, Lark grammar, JSON schema
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json: JsonSchema | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if any(s == "" for s in stops):
            raise InvalidArgument("stop strings must not be empty - at `$.stop`")
        return stops


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Union[str, int, float, bool, None]] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_chars(self) -> int:
        """Characters of the user's text that reach the prompt (messages, tools, template
        arguments), counted without templating or tokenizing."""
        chars = 0
        for m in self.messages:  # NOTE: per request; the extra fields are rare
            chars += len(m.text())
            if m.name is not None or m.tool_call_id is not None or m.tool_calls:
                chars += m.extra_chars()
        if self.tools:
            chars += sum(t.chars() for t in self.tools)
        if self.chat_template_kwargs:
            chars += sum(n for _, n in self._argument_fields())
        return chars

    def text_fields(self) -> Iterator[tuple[str, int]]:
        """(path, characters) of each field :meth:`prompt_chars` counts."""
        for i, m in enumerate(self.messages):
            yield from m.text_fields(f"messages[{i}]")
        for i, tool in enumerate(self.tools or ()):
            yield from tool.text_fields(f"tools[{i}]")
        yield from self._argument_fields()

    def _argument_fields(self) -> Iterator[tuple[str, int]]:
        for key, value in (self.chat_template_kwargs or {}).items():
            yield f"chat_template_kwargs.{key}", len(key) + (len(value) if isinstance(value, str) else 0)

    def logprob_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidArgument("top_logprobs needs logprobs set to true")
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Sampling, kw_only=True):
    # msgspec allows one array type per union: the list's shape is checked in single_prompt
    prompt: Union[str, list[Union[TokenId, str, list[TokenId]]]]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None

    def token_limit(self) -> int:
        # OpenAI's documented default for completions
        return self.max_tokens if self.max_tokens is not None else 16

    def text_fields(self) -> Iterator[tuple[str, int]]:
        yield "prompt", self.prompt_chars()

    def prompt_chars(self) -> int:
        """Characters of text (or count of ids) in the prompt, without tokenizing it."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or type(prompt[0]) is int:
            return len(prompt)  # text, or token ids (one "character" each)
        return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        prompt: object = self.prompt
        if isinstance(self.prompt, list) and self.prompt and not all(type(p) is int for p in self.prompt):
            if not (all(isinstance(p, str) for p in self.prompt) or all(isinstance(p, list) for p in self.prompt)):
                raise InvalidArgument("prompt must be a string, a list of token ids, or a list of one of those")
            if len(self.prompt) != 1:
                raise InvalidArgument(f"prompt holds {len(self.prompt)} prompts; send one prompt per request")
            prompt = self.prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise InvalidArgument("prompt must not be empty")
        if self.echo:
            raise InvalidArgument("echo is not supported; set echo to false")
        if self.suffix:
            raise InvalidArgument("suffix is not supported; leave it out")
        # a string or token ids: a list of strings or of lists was unwrapped above
        return cast("str | list[int]", prompt)


# each built by its route's first request (issue 36: the chat one, messages and tools,
# is ~10 ms of the frontend's start)
_chat_decoder: msgspec.json.Decoder[ChatCompletionRequest] | None = None
_completion_decoder: msgspec.json.Decoder[CompletionRequest] | None = None


def parse(body: bytes, kind: Literal["chat", "completion"]) -> ChatCompletionRequest | CompletionRequest:
    """Decode and validate a request body; every failure is an InvalidArgument."""
    global _chat_decoder, _completion_decoder
    if kind == "chat":
        if _chat_decoder is None:
            _chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
        return decode_body(body, _chat_decoder)
    if _completion_decoder is None:
        _completion_decoder = msgspec.json.Decoder(CompletionRequest)
    return decode_body(body, _completion_decoder)


def decode_body(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """``body`` decoded and validated by ``decoder`` (any route's schema); every failure
    is an InvalidArgument naming the field."""
    if not body:
        raise InvalidArgument("the request body is empty; send a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"the request body is not valid UTF-8 (byte {exc.start}): send JSON text in UTF-8"
        ) from None
    except RecursionError:
        raise InvalidArgument("the request body nests arrays or objects too deeply") from None


# Names a chat template receives from kvmesh itself: a request may not override them.
RESERVED_TEMPLATE_ARGS = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token", "pad_token", "unk_token"}
)


def largest_text_field(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, int]:
    """(path, characters) of the request's largest field of prompt text (for errors)."""
    return max(req.text_fields(), key=lambda field: field[1])


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: SecurityConfig) -> None:
    """What a request may ask of the frontend, checked before any templating or
    tokenizing: stop strings (count and length: the matcher's work is linear in their
    total), messages (count), the characters of every field that reaches the prompt
    (messages, tools, template arguments, a completions prompt), template arguments
    that would replace the frontend's own."""
    stops = req.stop_strings()
    if len(stops) > limits.max_stop:
        raise InvalidArgument(f"stop holds {len(stops)} strings; at most {limits.max_stop} - at `$.stop`")
    for i, stop in enumerate(stops):
        if len(stop) > limits.max_stop_chars:
            raise InvalidArgument(
                f"stop string {i} has {len(stop)} characters; at most {limits.max_stop_chars} - at `$.stop`"
            )
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > limits.max_messages:
            raise InvalidArgument(
                f"messages holds {len(req.messages)} messages; at most {limits.max_messages} - at `$.messages`"
            )
        clash = RESERVED_TEMPLATE_ARGS.intersection(req.chat_template_kwargs or ())
        if clash:
            raise InvalidArgument(
                f"chat_template_kwargs may not set {', '.join(sorted(clash))}: send them as request fields "
                f"(messages, add_generation_prompt) or leave them out - at `$.chat_template_kwargs`"
            )
    chars = req.prompt_chars()
    if chars > limits.max_message_chars:
        where, largest = largest_text_field(req)
        raise InvalidArgument(
            f"the request's prompt text holds {chars} characters; at most {limits.max_message_chars} "
            f"(the largest field has {largest} characters) - at `$.{where}`"
        )
