"""ByteLevelDetokenizer (issue 36): a byte-level tokenizer's streams are detokenized
from a per-id table, with exactly the text ``tokenizers`` decodes and the streaming
rules of IncrementalDetokenizer (a split character held back, U+FFFD only at flush);
any other decoder keeps the DecodeStream detokenizer."""

from __future__ import annotations

import json

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.preprocess import Tokenizer, bundled_model_path
from kvmesh.preprocess.tokenizer import ByteLevelDetokenizer, Detokenizer, IncrementalDetokenizer

pytestmark = pytest.mark.timeout(120)

VOCAB = 2048
TEXT = "héllo wörld 日本語 🙂 <|im_end|>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(bundled_model_path() / "tokenizer.json")


def stream(detok: Detokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(ids)), len(ids)]
    return [*(detok.step(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)), detok.flush()]


def test_the_bundled_byte_level_tokenizer_gets_the_table(tok: Tokenizer) -> None:
    assert type(tok.detokenizer()) is ByteLevelDetokenizer
    assert type(tok.detokenizer(skip_special_tokens=False)) is ByteLevelDetokenizer


@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=20),
    skip=st.booleans(),
)
@settings(max_examples=400, deadline=None)
def test_same_text_as_decode_and_decode_stream(tok: Tokenizer, ids: list[int], cuts: list[int], skip: bool) -> None:
    fast = stream(tok.detokenizer(skip_special_tokens=skip), ids, cuts)
    slow = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, cuts)
    assert "".join(fast) == "".join(slow) == tok.decode(ids, skip_special_tokens=skip)


@given(text=st.text(max_size=80), cuts=st.lists(st.integers(0, 200), max_size=30))
@settings(max_examples=200, deadline=None)
def test_valid_text_never_shows_a_replacement_character(tok: Tokenizer, text: str, cuts: list[int]) -> None:
    ids = tok.encode(text, parse_special=False)
    singles = [[i] for i in ids]  # one token per step: the split characters
    detok = tok.detokenizer(skip_special_tokens=False)
    pieces = [detok.step(one) for one in singles] + [detok.flush()]
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)
    assert "".join(stream(tok.detokenizer(skip_special_tokens=False), ids, cuts)) == text


def test_split_character_held_then_flushed_as_replacement(tok: Tokenizer) -> None:
    emoji = [tok.token_to_id(c) for c in "ðŁĻĤ"]  # 🙂's four bytes, one token each
    detok = tok.detokenizer()
    assert [detok.step([i]) for i in emoji[:3]] == ["", "", ""]
    assert detok.flush() == "\ufffd" and detok.flush() == ""
    assert "".join(detok.step([i]) for i in emoji) == "🙂"  # started over


def test_ids_outside_the_vocabulary_are_ignored_like_decode(tok: Tokenizer) -> None:
    ids = [*tok.encode("ok"), VOCAB + 5, -1, *tok.encode("!")]
    assert "".join(stream(tok.detokenizer(), ids, [1, 2, 3])) == tok.decode([i for i in ids if 0 <= i < VOCAB]) == "ok!"


def test_special_tokens_skipped_or_spelled(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert "".join(stream(tok.detokenizer(), ids, [1])) == "assistant\nhi"
    assert "".join(stream(tok.detokenizer(skip_special_tokens=False), ids, [1])) == "<|im_start|>assistant\nhi<|im_end|>"


def test_another_decoder_keeps_decode_stream(tok: Tokenizer) -> None:
    spec = json.loads(tok.raw.to_str())
    spec["decoder"] = {"type": "Sequence", "decoders": [spec["decoder"]]}  # same text, not ByteLevel alone
    other = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))
    detok = other.detokenizer()
    assert type(detok) is IncrementalDetokenizer
    assert "".join(stream(detok, other.encode(TEXT), [2, 5])) == TEXT.replace("<|im_end|>", "")


def test_a_table_that_disagrees_with_the_probe_is_not_used(tok: Tokenizer) -> None:
    from kvmesh.preprocess.tokenizer import _BytePieces

    class Skewed:  # a ByteLevel tokenizer whose decode says otherwise than its vocabulary
        decoder = tokenizers.decoders.ByteLevel()

        def __getattr__(self, name: str) -> object:
            return getattr(tok.raw, name)

        def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
            return [s + ("?" if b == [7] else "") for s, b in zip(tok.raw.decode_batch(batch, skip_special_tokens=skip_special_tokens), batch)]

    assert _BytePieces.of(tok.raw) is not None
    assert _BytePieces.of(Skewed()) is None  # type: ignore[arg-type]


def test_a_broken_character_stays_in_its_place(tok: Tokenizer) -> None:
    lead, a = tok.token_to_id("â"), tok.token_to_id("A")  # 0xE2 starts a 3-byte character; "A" cannot continue it
    detok = tok.detokenizer()
    pieces = [detok.step([lead]), detok.step([a]), detok.step([a, a]), detok.flush()]
    assert "".join(pieces) == tok.decode([lead, a, a, a]) == "\ufffdAAA"
    assert pieces[0] == ""  # held: it might have been the start of a character
