"""Tokenizer round trips and streaming detokenization."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from kvmesh.errors import InvalidArgument
from kvmesh.preprocess import IncrementalDetokenizer, Tokenizer, bundled_model_path

TEXT = "héllo wörld 日本語 🙂"
VOCAB = 2048


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(bundled_model_path() / "tokenizer.json")


def byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """One id per UTF-8 byte of ``text``: the worst case for a streaming decoder."""
    mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]
    ids = [tok.token_to_id(ch) for ch in mapped]
    assert None not in ids and len(ids) == len(text.encode())
    return ids  # type: ignore[return-value]


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Feed ``ids`` cut at ``cuts``; return every piece emitted, flush included."""
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(ids)), len(ids)]
    pieces = [detok.step(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [*pieces, detok.flush()]


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert tok.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("text", [TEXT, "", "def f(x):\n\treturn x  # ok\n", "a" * 5000, (TEXT + "\n") * 200])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == tok.raw.encode(text, add_special_tokens=False).ids  # long and short paths agree


@given(text=st.text(max_size=300))
@settings(max_examples=200, deadline=None)
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_bad_tokenizer_file(tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(InvalidArgument, match="is not a valid tokenizers file"):
        Tokenizer.from_file(path)


def test_multibyte_split_across_tokens_never_emits_replacement(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok, TEXT)
    detok = tok.detokenizer()
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") == len(TEXT.encode()) - len(TEXT)  # held exactly while a char was incomplete


def test_model_tokens_split_characters_too(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    detok = tok.detokenizer()
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == TEXT
    assert "" in pieces and all("\ufffd" not in p for p in pieces)


def test_unfinished_character_becomes_replacement_at_flush(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok, "ok 🙂")[:-1]  # drop the emoji's last byte
    detok = tok.detokenizer()
    assert "".join(detok.step([i]) for i in ids) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_flush_starts_over(tok: Tokenizer) -> None:
    detok = tok.detokenizer()
    assert detok.step(tok.encode("abc")) == "abc"
    assert detok.flush() == ""
    assert "".join(stream(detok, tok.encode(TEXT), [3])) == TEXT
    assert detok.step([]) == ""


def test_special_tokens_skipped_unless_asked(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert "".join(stream(tok.detokenizer(), ids, [])) == "assistant\nhi"
    pieces = stream(tok.detokenizer(skip_special_tokens=False), ids, list(range(len(ids))))
    assert "".join(pieces) == "<|im_start|>assistant\nhi<|im_end|>"


@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=20),
    skip=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_streaming_equals_full_decode(tok: Tokenizer, ids: list[int], cuts: list[int], skip: bool) -> None:
    pieces = stream(tok.detokenizer(skip_special_tokens=skip), ids, cuts)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@given(text=st.text(max_size=80), cuts=st.lists(st.integers(0, 200), max_size=30))
@settings(max_examples=200, deadline=None)
def test_streaming_valid_text_never_emits_replacement(tok: Tokenizer, text: str, cuts: list[int]) -> None:
    ids = byte_token_ids(tok, text) if text else []
    pieces = stream(tok.detokenizer(skip_special_tokens=False), ids, cuts)
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


def test_a_long_text_with_special_token_text_is_plain_text_on_the_gil_free_path(tok: Tokenizer) -> None:
    # over 1,024 characters the plain (parse_special=False) path uses encode_batch_fast,
    # which releases the GIL; the ids are the ones the offsets path gives
    text = ("user says <|im_end|> and then <|im_start|>system " * 40).strip()
    assert len(text) > 1024
    ids = tok.encode(text, parse_special=False)
    assert 1 not in ids and 2 not in ids  # no control tokens
    assert ids == tok._plain_tokenizer().encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


# ---------------------------------------------------------------------------- long texts in pieces

_WORDS = st.sampled_from(["the", "fox's", "naïve", "日本語", "x=1,", "(a)", "12,345", "--", "Ärger", "ok?", "🙂", "it", "é"])
_GAPS = st.sampled_from([" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n "])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_WORDS, _GAPS), min_size=1, max_size=200), st.integers(1, 64), st.integers(1, 20))
def test_pieces_cut_at_word_starts_encode_to_the_whole_texts_ids(tok: Tokenizer, parts: list[tuple[str, str]],
                                                                  piece_chars: int, max_pieces: int) -> None:  # fmt: skip
    from kvmesh.preprocess.tokenizer import split_at_word_starts

    text = "".join(w + g for w, g in parts)
    pieces = split_at_word_starts(text, piece_chars, max_pieces)
    assert "".join(pieces) == text and len(pieces) <= max_pieces
    got = [i for p in pieces for i in tok.raw.encode(p, add_special_tokens=False).ids]
    assert got == tok.raw.encode(text, add_special_tokens=False).ids


def test_a_long_prompt_is_encoded_in_pieces_to_the_same_ids(tok: Tokenizer) -> None:
    from kvmesh.preprocess import tokenizer as mod

    text = "<|im_start|>user\n" + " ".join(f"word{i % 97} and, more: {i}" for i in range(6000)) + "<|im_end|>\n"
    assert len(text) > mod._SPLIT_INPUT_CHARS and tok._splits
    assert len(mod.split_at_word_starts(text, mod._SPLIT_PIECE_CHARS, mod._SPLIT_MAX_PIECES)) > 1
    assert tok.encode(text) == tok.raw.encode(text, add_special_tokens=False).ids
    user = " ".join(["plain <|im_end|> text"] * 3000)  # special-token text typed by a user stays plain
    plain = tok.encode(user, parse_special=False)
    assert 2 not in plain and plain == tok._plain_tokenizer().encode(user, add_special_tokens=False).ids


def test_a_tokenizer_that_marks_every_input_is_not_cut() -> None:
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, normalizers
    from tokenizers import pre_tokenizers as pre

    raw = Raw(models.WordLevel({"[UNK]": 0, "▁a": 1, "▁b": 2, "b": 3, "▁": 4}, unk_token="[UNK]"))
    raw.normalizer = normalizers.Prepend("▁")  # SentencePiece's legacy prefix: a piece would get one too
    raw.pre_tokenizer = pre.WhitespaceSplit()
    wrapped = Tokenizer(raw)
    assert not wrapped._splits
    text = " ".join(["a b"] * 20000)
    assert wrapped.encode(text) == raw.encode(text, add_special_tokens=False).ids


def test_a_long_prompt_in_pieces_keeps_the_post_processors_tokens() -> None:
    from tokenizers import processors

    raw = Tokenizer.from_file(bundled_model_path() / "tokenizer.json").raw
    raw.post_processor = processors.TemplateProcessing(single="<|im_start|> $A <|endoftext|>",
                                                       special_tokens=[("<|im_start|>", 1), ("<|endoftext|>", 0)])  # fmt: skip
    wrapped = Tokenizer(raw)
    text = " ".join(f"word{i % 97} and, more: {i}" for i in range(6000))
    ids = wrapped.encode(text, add_special_tokens=True)
    assert ids[0] == 1 and ids[-1] == 0 and ids == raw.encode(text, add_special_tokens=True).ids
