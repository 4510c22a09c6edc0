"""Write the bundled ``kvmesh-tiny`` model folder: tokenizer and configs, no weights.

The folder is a Hugging Face-style checkpoint for a tiny Llama. The mocker engine
needs no weights; a later change adds trained weights that must use this exact
tokenizer, so the tokenizer is the part that matters:

* byte-level BPE (every byte sequence encodes, every id sequence decodes), trained
  with the ``tokenizers`` library on CPython's standard-library ``.py`` sources,
  read in sorted order and capped at ``--max-bytes`` so training is quick;
* vocabulary of exactly 2048 ids, the special tokens first:
  ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 (the chat EOS);
* a ChatML chat template in ``tokenizer_config.json``.

Usage::

    python scripts/make_tiny_model.py            # writes src/kvmesh/models/kvmesh-tiny
    python scripts/make_tiny_model.py --out DIR

Re-running with the same Python version gives the same files (the corpus is the
running interpreter's standard library, so another version gives another merge
table; the committed folder is the reference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "src" / "kvmesh" / "models" / "kvmesh-tiny"

VOCAB_SIZE = 2048
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# NOTE: order fixes the ids: the trainer assigns special tokens ids 0, 1, 2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CONTEXT_LENGTH = 2048
DEFAULT_MAX_BYTES = 6_000_000

# Pre-tokenizer split (the Llama-3 / Qwen2 family pattern): contractions, words with
# one leading non-letter, numbers in runs of at most 3 digits, punctuation runs,
# newline runs, then other whitespace. Code-friendly: indentation stays one piece.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# ChatML. Content may be a string, a list of OpenAI content parts (text parts are
# concatenated, others skipped) or null (an assistant turn carrying tool calls).
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- elif message['content'] is iterable %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}"
)

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def corpus_files(stdlib: Path) -> list[Path]:
    """Standard-library sources in a machine-independent order (tests excluded)."""
    files = [
        p
        for p in stdlib.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def read_corpus(files: list[Path], max_bytes: int) -> Iterator[str]:
    """Yield whole files (UTF-8 only) until ``max_bytes`` have been yielded."""
    total = 0
    for path in files:
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if total + len(data) > max_bytes:
            return
        total += len(data)
        yield text


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    return tok


def train_tokenizer(texts: Iterator[str]) -> Tokenizer:
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def check_tokenizer(tok: Tokenizer) -> dict[str, int]:
    """Fail loudly if the trained tokenizer breaks a promise the runtime relies on."""
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"vocab size is {tok.get_vocab_size()}, expected {VOCAB_SIZE}: raise --max-bytes")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if [ids[t] for t in SPECIAL_TOKENS] != [0, 1, 2]:
        raise SystemExit(f"special token ids are {ids}, expected 0, 1, 2")
    sample = "héllo wörld 日本語 🙂\n\tdef f(x):\n        return x  # ok"
    if tok.decode(tok.encode(sample).ids) != sample:
        raise SystemExit("tokenizer does not round-trip UTF-8 text")
    if tok.encode(f"{IM_START}user\n").ids[0] != ids[IM_START]:
        raise SystemExit("special tokens are not parsed out of text")
    return ids


def tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": CONTEXT_LENGTH,
        "pad_token": ENDOFTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def model_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT_LENGTH,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
    }


README = """\
# kvmesh-tiny

A tiny Llama-architecture model folder bundled with kvmesh (no weights yet).
It lets the mocker engine, the frontend and the tests run a real tokenizer and
chat template without downloading anything.

- tokenizer: byte-level BPE, 2048 ids, trained on CPython's standard library
- special tokens: `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2 (chat EOS)
- chat template: ChatML
- architecture: LlamaForCausalLM, hidden 256, 4 layers, 4 heads (2 KV heads), context 2048

Regenerate with `python scripts/make_tiny_model.py`.
"""


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_folder(out: Path, tok: Tokenizer, ids: dict[str, int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    write_json(out / "config.json", model_config(ids))
    write_json(out / "generation_config.json", generation_config(ids))
    (out / "README.md").write_text(README, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write (default: %(default)s)")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="training corpus cap in bytes")
    args = parser.parse_args(argv)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    started = time.perf_counter()
    tok = train_tokenizer(read_corpus(corpus_files(stdlib), args.max_bytes))
    ids = check_tokenizer(tok)
    write_folder(args.out, tok, ids)
    digest = hashlib.sha256((args.out / "tokenizer.json").read_bytes()).hexdigest()[:16]
    print(
        f"wrote {args.out} in {time.perf_counter() - started:.1f}s "
        f"(Python {sys.version.split()[0]}, special ids {ids}, tokenizer.json sha256 {digest})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
