"""Structured outputs: a :class:`~kvmesh.protocol.GuidedDecoding` constraint → a grammar
→ one token mask per generated token.

The grammar engine is llguidance (Earley parser over a lexer, Rust; no dependencies of
its own, so the mocker and the frontend can use it without torch). Chosen over
xgrammar by measurement (``bench/guided_mask.py``; xgrammar also pulls torch,
transformers, triton and apache-tvm-ffi into every install).

* :func:`grammar_text` turns a constraint into llguidance's grammar text: JSON Schema
  (compact separators, no free whitespace, so an undertrained model cannot pad
  forever), any JSON object, a regex (Rust ``regex`` syntax), a choice of literal
  strings, or a Lark grammar (llguidance's Lark dialect; ``guided_grammar``).
  :func:`check` validates it without a tokenizer (the frontend's 400 before routing).
* :class:`GuidedTokenizer`: one model's tokenizer for the grammar engine, with a cache
  of compiled grammars (one per distinct constraint, LRU): :meth:`~GuidedTokenizer.compile`
  is the costly part and is meant for a worker thread; :meth:`~GuidedTokenizer.guide`
  copies a compiled matcher for one request.
* :class:`Guide`: one request's matcher. :meth:`Guide.allowed` is the boolean mask of
  the next token; near the end of the budget it switches to the shortest way to close
  (EOS, else tokens made only of ``"``, ``}``, ``]``, else the lowest allowed id), so a
  JSON output ends complete within ``max_tokens`` even from a model that would
  otherwise write one string forever.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import msgspec
import numpy as np
import numpy.typing as npt

from kvmesh.errors import InvalidArgument
from kvmesh.protocol import GuidedDecoding

if TYPE_CHECKING:  # a TypedDict of llguidance's stub only
    from llguidance._lib import JsonCompileOptions

__all__ = ["grammar_text", "check", "GuidedTokenizer", "Guide", "MAX_SPEC_CHARS", "CLOSE_WATCH", "ENGINE_NAME"]

ENGINE_NAME = "llguidance"
MAX_SPEC_CHARS = 64 * 1024  # a schema / regex / grammar larger than this is refused
MAX_CHOICES = 256
CACHE_SIZE = 128  # compiled grammars kept per tokenizer
# From this many tokens of budget left, a guide measures its closing path each step;
# it takes that path when fewer than CLOSE_SLACK tokens would be left to spare.
CLOSE_WATCH = 48
CLOSE_SLACK = 4
_NEAR = 16  # with this few tokens to spare, every step is measured and every token drawn checked
_CLOSERS = frozenset('"}]')
_PROGRESS = "@.a0-:T"
# JSON: no free whitespace and compact separators (an untrained model would otherwise
# fill its budget with spaces); ``x-guidance`` in a schema may still override these.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}
_ANY_OBJECT = '{"type": "object"}'

BoolMask = npt.NDArray[np.bool_]


def grammar_text(g: GuidedDecoding) -> str:
    """llguidance's grammar text for ``g`` (not yet validated); InvalidArgument for a
    constraint that is malformed on its face."""
    if g.kind == "choice":
        return _choice_grammar(g.choices)
    if len(g.spec) > MAX_SPEC_CHARS:
        raise InvalidArgument(f"the {g.kind} constraint has {len(g.spec)} characters; at most {MAX_SPEC_CHARS}")
    if g.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, overrides=_JSON_OPTIONS)
    if g.kind == "json_schema":
        try:
            schema = msgspec.json.decode(g.spec)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("the JSON schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(g.spec, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidArgument(f"the JSON schema is not usable: {exc}") from None
    if g.kind == "regex":
        if not g.spec:
            raise InvalidArgument("guided_regex must not be empty")
        return llguidance.LLMatcher.grammar_from_regex(g.spec)
    if g.kind == "grammar":
        if not g.spec.strip():
            raise InvalidArgument("guided_grammar must not be empty")
        return llguidance.LLMatcher.grammar_from_lark(g.spec)
    raise InvalidArgument(f"unknown constraint kind {g.kind!r}")  # pragma: no cover - Literal on the wire


def _choice_grammar(choices: Sequence[str]) -> str:
    if not choices:
        raise InvalidArgument("guided_choice must hold at least one string")
    if len(choices) > MAX_CHOICES:
        raise InvalidArgument(f"guided_choice holds {len(choices)} strings; at most {MAX_CHOICES}")
    if sum(len(c) for c in choices) > MAX_SPEC_CHARS:
        raise InvalidArgument(f"guided_choice holds more than {MAX_SPEC_CHARS} characters")
    if any(c == "" for c in choices):
        raise InvalidArgument("guided_choice strings must not be empty")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _what(g: GuidedDecoding) -> str:
    return {
        "json_schema": "the JSON schema",
        "json_object": "response_format json_object",
        "regex": "guided_regex",
        "choice": "guided_choice",
        "grammar": "guided_grammar (Lark syntax)",
    }[g.kind]


def check(g: GuidedDecoding) -> str:
    """Validate ``g`` without a tokenizer and return its grammar text; InvalidArgument
    naming what the grammar engine refused (an unsupported schema feature, a bad
    regex, a grammar syntax error). CPU work: call it off the event loop."""
    text = grammar_text(g)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        detail = " ".join((messages[0] if messages else "rejected").split())[:400]
        raise InvalidArgument(f"{_what(g)} is not supported by the grammar engine ({ENGINE_NAME}): {detail}")
    return text


class GuidedTokenizer:
    """One model's tokenizer as the grammar engine sees it, plus its grammar cache.

    Thread-safe: compiles may run in worker threads while requests take copies."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int]) -> None:
        eos = sorted(set(eos_ids))
        if not eos:
            raise ValueError("a guided tokenizer needs at least one EOS id")
        self.vocab_size = vocab_size
        self.eos = eos[0]
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self._lock = threading.Lock()
        self._cache: OrderedDict[GuidedDecoding, llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0  # distinct grammars compiled (a cache miss each)
        self.closers = self._closing_tokens()
        # the closing path's preferences after EOS: closing tokens, then single characters
        # that finish common formats and patterns (an email, a number, a date)
        extra = [ids[0] for c in _PROGRESS if len(ids := self.tok.tokenize_str(c)) == 1 and 0 <= ids[0] < vocab_size]
        self.close_order = tuple(int(t) for t in np.flatnonzero(self.closers)) + tuple(dict.fromkeys(extra))

    @classmethod
    def from_folder(cls, folder: str | Path, vocab_size: int, eos_ids: Iterable[int]) -> GuidedTokenizer:
        text = (Path(folder) / "tokenizer.json").read_text(encoding="utf-8")
        return cls(text, vocab_size, eos_ids)

    def _closing_tokens(self) -> npt.NDArray[np.bool_]:
        """Tokens whose text is made only of closing characters (``"``, ``}``, ``]``)."""
        out = np.zeros(self.vocab_size, dtype=np.bool_)
        for t in range(min(self.vocab_size, self.tok.vocab_size)):
            if self.tok.is_special_token(t):
                continue
            text = self.tok.decode_bytes([t])
            if text and all(chr(b) in _CLOSERS for b in text):
                out[t] = True
        return out

    def compile(self, g: GuidedDecoding) -> llguidance.LLMatcher:
        """The compiled matcher for ``g`` (cached); InvalidArgument when the engine
        refuses it. Costly on a cache miss: call it from a worker thread."""
        with self._lock:
            hit = self._cache.get(g)
            if hit is not None:
                self._cache.move_to_end(g)
                return hit
        matcher = llguidance.LLMatcher(self.tok, grammar_text(g), log_level=0)
        if matcher.is_error():
            detail = " ".join(matcher.get_error().split())[:400]
            raise InvalidArgument(f"{_what(g)} is not supported by the grammar engine ({ENGINE_NAME}): {detail}")
        with self._lock:
            self.compiles += 1
            self._cache[g] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def guide(self, g: GuidedDecoding, generated: Sequence[int] = ()) -> Guide:
        """A fresh matcher for one request, advanced over ``generated`` (the tokens a
        migrated request already streamed); InvalidArgument if they do not match."""
        matcher = self.compile(g).deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise InvalidArgument(f"the tokens already generated do not match {_what(g)}: {matcher.get_error()}")
        return Guide(matcher, self)


class Guide:
    """One request's position in its grammar. Used by one thread at a time (the
    engine's sampler): ``allowed`` for the next token, then ``consume`` the one drawn.

    Ending within budget: once ``remaining`` tokens are few (:data:`CLOSE_WATCH`), the
    guide measures how many tokens the shortest way to close costs (a copy of the matcher
    follows :meth:`_close_pick`: EOS, else a closing token, else a character that finishes
    common formats, else the lowest allowed id; never the same token three times running),
    again after a third of the tokens it had to spare (every step once 16 or fewer are, each token drawn then checked by :meth:`settle`);
    when that no longer leaves :data:`CLOSE_SLACK` tokens to spare, the guide switches
    for good to that same deterministic path, which is complete in as many tokens as
    measured. Sampling is untouched until then.
    """

    __slots__ = ("matcher", "_tok", "_closing", "_next_check", "_recent", "_near")

    def __init__(self, matcher: llguidance.LLMatcher, tok: GuidedTokenizer) -> None:
        self.matcher = matcher
        self._tok = tok
        self._closing = False
        self._next_check = CLOSE_WATCH  # measure the closing path again at this many tokens left
        self._recent = (-1, -1)  # the last two tokens consumed (the closing path avoids a third in a row)
        self._near = False  # the last measure left _NEAR tokens or fewer to spare: each token drawn is checked

    def allowed(self, remaining: int | None = None) -> BoolMask:
        """Which token ids may come next (length: the model's vocabulary); with
        ``remaining`` (tokens of budget left), the closing path when it is due."""
        m = self.matcher
        if m.is_error():
            return self._only(self._tok.eos)
        if remaining is not None and not self._closing and remaining <= self._next_check:
            spare = remaining - self.closing_cost(remaining) - CLOSE_SLACK
            self._closing = spare <= 0
            self._near = spare <= _NEAR
            # the path grows by a token or two per token at most: look again a third of the spare later
            self._next_check = remaining - (1 if spare <= _NEAR else spare // 3)
        if self._closing:
            return self._only(self._close_pick(m, self._recent))
        return self._mask(m)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def eos(self) -> int:
        return self._tok.eos

    def _mask(self, m: llguidance.LLMatcher) -> BoolMask:
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        mask: BoolMask = np.unpackbits(words, bitorder="little")[: self._tok.vocab_size].view(np.bool_)
        return mask

    def _close_pick(self, m: llguidance.LLMatcher, recent: tuple[int, int]) -> int:
        """EOS, else the first allowed of the tokenizer's closing preferences, else the
        lowest allowed id; never a third time in a row (a ``}`` can be string content)."""
        mask = self._mask(m)
        eos = self._tok.eos
        if mask[eos]:
            return eos
        repeat = recent[0] if recent[0] == recent[1] else -1
        for t in self._tok.close_order:
            if mask[t] and t != repeat:
                return t
        ids = np.flatnonzero(mask)
        pick = ids[ids != repeat]
        return int(pick[0] if len(pick) else ids[0])

    def settle(self, token: int, remaining: int | None) -> int:
        """The token to emit in place of the one drawn: the same, unless (in the last few
        tokens of the budget) it would leave the output unable to close in time, e.g. one
        that opens an optional property; then the closing path's, and closing from now on."""
        if remaining is None or self._closing or token == self._tok.eos or not self._near:
            return token
        after = self.matcher.deep_copy()
        if not after.consume_token(token):
            return token
        if self._cost(after, (self._recent[1], token), remaining) <= remaining - 2:
            return token
        self._closing = True
        return self._close_pick(self.matcher, self._recent)

    def closing_cost(self, limit: int) -> int:
        """Tokens the closing path needs before the output is complete (``limit`` + 1:
        more than ``limit``)."""
        return self._cost(self.matcher.deep_copy(), self._recent, limit)

    def _cost(self, m: llguidance.LLMatcher, recent: tuple[int, int], limit: int) -> int:
        for n in range(limit + 1):
            if m.is_error():
                break
            token = self._close_pick(m, recent)
            if token == self._tok.eos:
                return n
            m.consume_token(token)
            recent = (recent[1], token)
        return limit + 1

    def _only(self, token: int) -> BoolMask:
        mask = np.zeros(self._tok.vocab_size, dtype=np.bool_)
        mask[token] = True
        return mask

    def consume(self, token: int) -> bool:
        """Advance over the token drawn; False (and the matcher in error) if it broke the grammar."""
        self._recent = (self._recent[1], token)
        if self.matcher.is_stopped():
            return token == self._tok.eos or self.matcher.consume_token(token)
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        return self.matcher.is_stopped()
