"""Text <-> token ids over a ``tokenizers`` fast tokenizer, and streaming detokenization.

* :class:`Tokenizer` is built once per model and shared by every request; all its
  methods are read-only.
* Special tokens written as text (``<|im_start|>``) are control tokens only where the
  caller says so: text a user typed is encoded with them split into plain pieces
  (``parse_special=False``), so a user cannot spoof a role or end a turn;
  :func:`encode_chat` keeps the chat template's own markers as control tokens while
  the user's text in it (messages' content, template arguments) is plain text.
* A :class:`Detokenizer` is built once per request (one stream of generated ids) and
  is not shared: it holds the ids whose text is not yet complete. For a byte-level BPE
  tokenizer (GPT-2, Llama 3, Qwen: decoder ``ByteLevel`` alone) it is a
  :class:`ByteLevelDetokenizer` (a cached text per id, UTF-8 read incrementally; issue
  36), else an :class:`IncrementalDetokenizer` (``DecodeStream``).
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from kvmesh.errors import InvalidArgument

__all__ = ["Tokenizer", "Detokenizer", "IncrementalDetokenizer", "ByteLevelDetokenizer", "load_tokenizers_file", "encode_chat"]

# Inputs longer than this (in characters) go through ``encode_batch_fast``: it skips
# offset tracking (~30% faster) and releases the GIL, so a caller may tokenize a long
# prompt in a worker thread without stalling the event loop. Short inputs take the
# plain path, which has less per-call overhead.
_LONG_INPUT_CHARS = 1024
# Inputs longer than this are cut into pieces at word starts and the pieces encoded as
# one batch: ``tokenizers`` encodes a batch's items on all cores (a 72k-token text:
# 67 ms whole, 27 ms in 8 pieces on 2 cores). Only for tokenizers whose ids do not
# change when a text is cut there (:func:`_cuts_are_exact`, checked once per tokenizer).
_SPLIT_INPUT_CHARS = 32 * 1024
_SPLIT_PIECE_CHARS = 8 * 1024
_SPLIT_MAX_PIECES = 16


def load_tokenizers_file(path: str | os.PathLike[str]) -> tokenizers.Tokenizer:
    """Load ``tokenizer.json`` with padding and truncation switched off.

    Some published tokenizer.json files enable truncation; left on, it would silently
    cut prompts, so the runtime never uses it (context limits are checked explicitly).
    """
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises plain Exception for any bad file
        raise InvalidArgument(f"{path} is not a valid tokenizers file ({exc}): replace it") from exc
    tok.no_truncation()
    tok.no_padding()
    return tok


class Tokenizer:
    """A model's tokenizer. Thread-safe; build once, share everywhere."""

    __slots__ = (
        "_tok", "_encode", "_encode_long", "_decode", "vocab_size", "specials", "_plain", "max_token_chars", "_splits",
        "_framing", "_bytes",
    )  # fmt: skip

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self._tok = tok
        # Bound methods cached: encode/decode sit on the per-request path.
        self._encode = tok.encode
        self._encode_long = tok.encode_batch_fast
        self._decode = tok.decode
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        # the special tokens' text, and a copy of the tokenizer that reads it as plain text
        self.specials: tuple[str, ...] = tuple(
            t.content for t in tok.get_added_tokens_decoder().values() if t.special and t.content
        )
        self._plain: tokenizers.Tokenizer | None = None
        # (an upper bound on) the most characters one token stands for: a text of more
        # than context × this characters cannot fit, whatever it tokenizes to. A
        # vocabulary entry's length counts its bytes (byte-level BPE) or characters.
        self.max_token_chars: int = max(map(len, tok.get_vocab(with_added_tokens=True)), default=1) or 1
        self._splits = _cuts_are_exact(tok)
        self._framing = _post_processor_framing(tok)
        self._bytes: _BytePieces | None | bool = False  # False: not looked at yet (on the first detokenizer)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        return cls(load_tokenizers_file(Path(path)))

    @property
    def raw(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for APIs this wrapper does not cover)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``parse_special`` (trusted text: a chat template's output), special tokens
        written as text (``<|im_start|>``) become their single id; without it (text a
        user typed) they are encoded as the plain characters they are.
        ``add_special_tokens`` applies the tokenizer's post-processor (e.g. prepends BOS
        for tokenizers that ask for it); chat templates write BOS themselves, so it is
        off by default.
        """
        if not parse_special and self.has_special(text):
            plain = self._plain_tokenizer()
            if len(text) < _LONG_INPUT_CHARS:
                return plain.encode(text, add_special_tokens=add_special_tokens).ids
            return self._encode_pieces(plain.encode_batch_fast, text, add_special_tokens)
        if len(text) < _LONG_INPUT_CHARS:
            return self._encode(text, add_special_tokens=add_special_tokens).ids
        return self._encode_pieces(self._encode_long, text, add_special_tokens)

    def _encode_pieces(self, encode_batch: Callable[..., Any], text: str, add_special_tokens: bool) -> list[int]:
        """``text`` encoded without the GIL; a long one in pieces on all cores when that
        gives the same ids (the pieces without the post-processor's tokens, which frame
        the whole once: :func:`_post_processor_framing`)."""
        framing = self._framing if add_special_tokens else ([], [])
        if not self._splits or framing is None or len(text) < _SPLIT_INPUT_CHARS:
            return list(encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        ids = list(framing[0])
        for enc in encode_batch(split_at_word_starts(text, _SPLIT_PIECE_CHARS, _SPLIT_MAX_PIECES),
                                add_special_tokens=False):  # fmt: skip
            ids += enc.ids
        return ids + framing[1]

    def has_special(self, text: str) -> bool:
        """Whether ``text`` holds the text of a special token."""
        return any(s in text for s in self.specials)

    def _plain_tokenizer(self) -> tokenizers.Tokenizer:
        plain = self._plain
        if plain is None:  # built on first need (most requests never need it)
            plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return plain

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        """One stream's detokenizer: byte-level tokenizers get the table-driven one."""
        pieces = self._bytes
        if pieces is False:
            pieces = self._bytes = _BytePieces.of(self._tok)
        if isinstance(pieces, _BytePieces):
            return ByteLevelDetokenizer(pieces, skip_special_tokens)
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class Detokenizer:
    """Turns one request's stream of generated ids into text, a piece at a time:
    ``step(ids)`` for each chunk of ids, then ``flush()`` once at the end. The
    concatenation of everything returned equals ``tokenizer.decode(all_ids,
    skip_special_tokens)``; a UTF-8 character split across tokens is held back until
    its last byte arrives, and ``flush`` releases what is still held (an unfinished
    character becomes U+FFFD) and starts over."""

    __slots__ = ()

    def step(self, token_ids: Sequence[int]) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        raise NotImplementedError


# GPT-2's byte-level alphabet: byte b is written as the character _BYTE_CHARS[b]
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_BYTE_CHARS = {b: chr(b) if b in _PRINTABLE else "" for b in range(256)}
for _n, _b in enumerate(b for b in range(256) if b not in _PRINTABLE):
    _BYTE_CHARS[_b] = chr(256 + _n)
_TO_LATIN1 = {ord(c): b for b, c in _BYTE_CHARS.items()}  # str.translate: alphabet → chr(byte)
_ALPHABET = {ord(c): None for c in _BYTE_CHARS.values()}  # str.translate: drops the alphabet
_utf8_decode = codecs.utf_8_decode  # (data, errors, final) -> (text, bytes used): what the incremental decoder runs
_PROBE = 512  # ids checked against tokenizers' own decode before the table is trusted


class _BytePieces:
    """Each token id's bytes and (when they are whole UTF-8) text, for a tokenizer whose
    decoder is ``ByteLevel`` alone: there, decoding ids is joining their bytes (a
    token's characters mapped back through the byte-level alphabet; one with a
    character outside it: its UTF-8) and reading them as UTF-8, invalid bytes as U+FFFD
    (``tokenizers``' ``from_utf8_lossy``, which Python's ``"replace"`` matches). Texts
    are cached per id as ids are seen (at most the vocabulary; thread-safe enough: a
    race computes an entry twice)."""

    __slots__ = ("_tok", "_size", "_special", "texts", "raw")

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self._tok = tok
        self._size = tok.get_vocab_size(with_added_tokens=True)
        self._special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        # by skip_special_tokens: an id's text (None: its bytes are not whole UTF-8) ...
        self.texts: tuple[dict[int, str | None], dict[int, str | None]] = ({}, {})
        self.raw: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})  # ... and then its bytes

    @classmethod
    def of(cls, tok: tokenizers.Tokenizer) -> _BytePieces | None:
        """The table for ``tok``, or None when its decoder is not ``ByteLevel`` alone or
        a probe of ids (the added tokens, the first and a spread of the rest) decodes
        otherwise than ``tokenizers`` does."""
        if type(tok.decoder) is not tokenizers.decoders.ByteLevel:
            return None
        pieces = cls(tok)
        size = pieces._size
        probe = sorted({*tok.get_added_tokens_decoder(), *range(min(size, _PROBE)), *range(0, size, max(1, size // _PROBE))})
        for skip in (False, True):
            want = tok.decode_batch([[i] for i in probe], skip_special_tokens=skip)
            if [pieces.piece(i, skip).decode("utf-8", "replace") for i in probe] != want:
                return None
        return pieces

    def piece(self, token_id: int, skip: bool) -> bytes:
        """The bytes of ``token_id`` (b"": a skipped special token, an id outside the
        vocabulary, which ``tokenizers`` ignores too)."""
        if not 0 <= token_id < self._size or (skip and token_id in self._special):
            return b""
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if token.translate(_ALPHABET):  # a character outside the alphabet (an added token's text)
            return token.encode()
        return token.translate(_TO_LATIN1).encode("latin-1")

    def learn(self, token_id: int, skip: bool) -> bytes:
        """Cache ``token_id``'s text (or, when its bytes are not whole UTF-8, its
        bytes); return its bytes."""
        data = self.piece(token_id, skip)
        try:
            self.texts[skip][token_id] = data.decode()
        except UnicodeDecodeError:
            self.texts[skip][token_id] = None
            self.raw[skip][token_id] = data
        return data


class ByteLevelDetokenizer(Detokenizer):
    """A :class:`Detokenizer` over a byte-level tokenizer's :class:`_BytePieces`: a token
    whose bytes are whole UTF-8 (most) is a dictionary lookup while nothing is held;
    otherwise the bytes are read as UTF-8 after those held, and a character's first
    bytes are held until the rest arrive."""

    __slots__ = ("_pieces", "_skip", "_texts", "_raw", "_held")

    def __init__(self, pieces: _BytePieces, skip_special_tokens: bool = True) -> None:
        self._pieces = pieces
        self._skip = skip_special_tokens
        self._texts = pieces.texts[skip_special_tokens]
        self._raw = pieces.raw[skip_special_tokens]
        self._held = b""  # the start of a character, waiting for its other bytes

    def step(self, token_ids: Sequence[int]) -> str:
        if not self._held:
            texts = self._texts
            if len(token_ids) == 1:
                text = texts.get(token_ids[0])
                if text is not None:
                    return text
            else:
                parts = [texts.get(i) for i in token_ids]
                if None not in parts:
                    return "".join(parts)  # type: ignore[arg-type]  # no None among them
        return self._decode(token_ids)

    def _decode(self, token_ids: Sequence[int]) -> str:
        texts, raw = self._texts, self._raw
        parts = [self._held]
        for i in token_ids:
            text = texts.get(i)
            if text is not None:
                parts.append(text.encode())
            elif i in raw:
                parts.append(raw[i])
            else:
                parts.append(self._pieces.learn(i, self._skip))
        data = b"".join(parts)
        out, used = _utf8_decode(data, "replace", False)  # an unfinished character at the end stays
        self._held = data[used:]
        return out

    def flush(self) -> str:
        if not self._held:
            return ""
        out, _ = _utf8_decode(self._held, "replace", True)
        self._held = b""
        return out


class IncrementalDetokenizer(Detokenizer):
    """Turns one request's stream of generated ids into text, a piece at a time.

    Lifecycle: ``step(ids)`` for each chunk of ids the engine yields, then ``flush()``
    once when the stream ends. The concatenation of everything returned equals
    ``tokenizer.decode(all_ids, skip_special_tokens)``.

    Invariant: text is released only when it does not end in U+FFFD, so a UTF-8
    character split across tokens is held back until its last byte arrives;
    ``flush`` releases what is still held (an unfinished character becomes U+FFFD).

    Built on ``tokenizers.decoders.DecodeStream`` (the prefix-offset algorithm in
    Rust). DecodeStream has no flush, so the ids it still holds are mirrored here:
    ``_last`` (the ids of the last released piece, the decoding context) and
    ``_pending`` (ids received since).
    """

    __slots__ = ("_tokenizer", "_raw", "_stream", "_skip", "_last", "_pending")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._raw = tokenizer.raw
        self._skip = skip_special_tokens
        self._reset()

    def _reset(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._last: list[int] = []
        self._pending: list[int] = []

    def step(self, token_ids: Sequence[int]) -> str:
        """Add the next generated ids; return the text they complete ('' if none yet)."""
        if len(token_ids) == 1:
            # NOTE: an int argument takes DecodeStream's cheaper path than a 1-item list.
            text = self._stream.step(self._raw, token_ids[0])
        elif token_ids:
            text = self._stream.step(self._raw, list(token_ids))
        else:
            return ""
        self._pending += token_ids
        if text is None:
            return ""
        self._last = self._pending
        self._pending = []
        return text

    def flush(self) -> str:
        """End of stream: return the text still held back, and start over empty."""
        pending, last = self._pending, self._last
        self._reset()
        if not pending:
            return ""
        decode = self._tokenizer.decode
        text = decode(last + pending, self._skip)
        prefix = decode(last, self._skip) if last else ""
        return text[len(prefix) :]


def split_at_word_starts(text: str, piece_chars: int, max_pieces: int) -> list[str]:
    """``text`` cut into at most ``max_pieces`` pieces of about ``piece_chars`` or more,
    each cut just before a space that follows a non-space and precedes a letter (the
    start of a word: a pre-tokenizer boundary for byte-level BPE); a stretch with no
    such place stays whole."""
    pieces = max(1, min(max_pieces, len(text) // piece_chars))
    step = len(text) // pieces
    out: list[str] = []
    start = 0
    for k in range(1, pieces):
        cut = _word_start(text, max(start + 1, k * step))
        if cut < 0:
            break
        if cut > start:
            out.append(text[start:cut])
            start = cut
    out.append(text[start:])
    return out


def _word_start(text: str, at: int) -> int:
    """The first index ``i >= at`` with ``text[i] == " "``, ``text[i-1]`` not white
    space and ``text[i+1]`` a letter; -1 if none."""
    i = text.find(" ", at)
    while 0 < i < len(text) - 1:
        if not text[i - 1].isspace() and text[i + 1].isalpha():
            return i
        i = text.find(" ", i + 1)
    return -1


# A text with every kind of place the cut rule could meet: words, punctuation, digits,
# apostrophes, runs of spaces, new lines, tabs and letters outside ASCII.
_CUT_PROBE = (
    "The quick brown fox's 3 jumps, over 12,345 lazy dogs.  Again:\n  it isn't (really) \"so\" -- "
    "naïve café Ärger über 日本語 の テキスト; x=1, y = 2\t z\n\nEnd of line. ok? yes! "
)


def _cuts_are_exact(tok: tokenizers.Tokenizer) -> bool:
    """Whether cutting a text at every word start (:func:`_word_start`) and encoding the
    pieces apart gives the ids of the whole text, for this tokenizer (it does for
    byte-level BPE; a tokenizer that prepends a marker to every input does not)."""
    if any(any(c.isspace() for c in t.content) for t in tok.get_added_tokens_decoder().values()):
        return False  # a cut could fall inside an added token's text
    text = _CUT_PROBE * 3
    whole = tok.encode(text, add_special_tokens=False).ids
    cuts, i = [], _word_start(text, 1)
    while i > 0:
        cuts.append(i)
        i = _word_start(text, i + 1)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parts = tok.encode_batch(pieces, add_special_tokens=False)
    return len(cuts) > 10 and [x for p in parts for x in p.ids] == whole


def _post_processor_framing(tok: tokenizers.Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a single text (e.g. BOS), when
    it only frames it with fixed ids (checked on two texts); None otherwise."""
    framings = []
    for text in ("a", _CUT_PROBE):
        bare = tok.encode(text, add_special_tokens=False).ids
        full = tok.encode(text, add_special_tokens=True).ids
        i = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), -1)
        if not bare or i < 0:
            return None
        framings.append((full[:i], full[i + len(bare) :]))
    return framings[0] if framings[0] == framings[1] else None


_SENTINEL = "\ue000kvmesh-user-{}\ue001"

_SENTINELS = re.compile("\ue000kvmesh-user-(\\d+)\ue001")
_MARKS = ("\ue000", "\ue001")  # a sentinel's ends: one left in the template's text was cut


def encode_chat(
    render: Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any]], str],
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    arguments: Mapping[str, Any] | None = None,
) -> list[int]:  # fmt: skip
    """Token ids of a rendered chat whose user text is plain text: the messages'
    content and the string values of the template's ``arguments`` (``render(messages,
    arguments)`` renders the template).

    The common case (no user text holds a special token's text) renders and encodes
    once. Otherwise each such text is replaced by a sentinel, the template is rendered
    around the sentinels, and the pieces are encoded apart: the template's text with
    its control tokens, each user text as plain text. A template that does not pass
    such a text through unchanged (a content must appear exactly once, an argument any
    number of times, and no sentinel may come out cut) cannot keep it apart, and the
    request is refused.
    """
    args = arguments or {}
    marked = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str) and tokenizer.has_special(m["content"])]
    named = [k for k, v in args.items() if isinstance(v, str) and tokenizer.has_special(v)] if args else []
    if not marked and not named:
        return tokenizer.encode(render(messages, args))
    texts = {i: messages[i]["content"] for i in marked}
    keys = {len(messages) + j: k for j, k in enumerate(named)}  # argument sentinels follow the messages'
    texts.update((i, args[k]) for i, k in keys.items())
    swapped = [dict(m, content=_SENTINEL.format(i)) if i in texts else m for i, m in enumerate(messages)]
    pieces = _SENTINELS.split(render(swapped, {**args, **{k: _SENTINEL.format(i) for i, k in keys.items()}}))
    _check_passed_through(pieces, marked, keys)  # template, index, template, index, ..., template
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            ids += tokenizer.encode(texts[int(piece)], parse_special=False)
        elif piece:
            ids += tokenizer.encode(piece)
    return ids


def _check_passed_through(pieces: list[str], contents: list[int], arguments: Mapping[int, str]) -> None:
    """Refuse a render where a marked content did not come out exactly once, or a
    sentinel came out cut (the template transformed the text: it cannot be kept apart).
    A sentinel typed by the user in an unmarked text shows as an unknown index."""
    cut = any(mark in piece for piece in pieces[::2] for mark in _MARKS)
    if cut and arguments:
        key = next(iter(arguments.values()))
        raise InvalidArgument(
            f"template argument {key!r} holds a special token's text, and this model's chat template does not pass "
            f"it through unchanged; remove the special-token text from it - at `$.chat_template_kwargs.{key}`"
        )
    if cut or sorted(int(i) for i in pieces[1::2] if int(i) not in arguments) != contents:
        raise InvalidArgument(
            "a message holds a special token's text, and this model's chat template does not pass "
            "message content through unchanged; remove the special-token text from the message"
        )
