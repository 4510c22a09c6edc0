"""A Hugging Face-style model folder read into one immutable :class:`ModelInfo` value.

Files read (only the first two are required)::

    config.json              context length, vocab size, eos ids
    tokenizer.json           the fast tokenizer (read later by :mod:`.tokenizer`)
    tokenizer_config.json    special tokens, model_max_length, chat_template
    generation_config.json   more eos ids
    chat_template.jinja      the chat template, when it is kept out of tokenizer_config.json

Every problem with a folder is an :class:`~kvmesh.errors.InvalidArgument` that names
the file and says what to fix. Nothing here touches the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import InvalidArgument

__all__ = ["ModelInfo", "load_model_folder", "bundled_model_path", "BUNDLED_MODEL_NAME"]

BUNDLED_MODEL_NAME = "kvmesh-tiny"

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# config.json keys that carry the context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
# transformers writes model_max_length = int(1e30) when a tokenizer has no limit.
_NO_LIMIT = 10**12
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the runtime needs to know about one model folder. Immutable; cheap to share.

    ``eos_token_ids`` is the union, in first-seen order, of config.json
    ``eos_token_id``, generation_config.json ``eos_token_id`` and the id of
    tokenizer_config.json ``eos_token``. ``bos_token_id`` is the id of
    tokenizer_config.json ``bos_token`` (None when the tokenizer has no BOS).
    """

    name: str
    path: Path
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token: str | None = None
    bos_token_id: int | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    special_token_ids: tuple[int, ...] = ()

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_FILE

    def special_tokens(self) -> dict[str, str]:
        """The special tokens that are set, under the names chat templates use."""
        values = (self.bos_token, self.eos_token, self.pad_token, self.unk_token)
        return {k: v for k, v in zip(_SPECIAL_TOKEN_NAMES, values, strict=True) if v is not None}


def bundled_model_path() -> Path:
    """The ``kvmesh-tiny`` folder shipped inside the installed package."""
    return Path(__file__).resolve().parent.parent / "models" / BUNDLED_MODEL_NAME


def load_model_folder(path: str | os.PathLike[str], *, name: str | None = None) -> ModelInfo:
    """Read a model folder. ``name`` is the served model name (default: the folder's name)."""
    folder = _check_folder(Path(path).expanduser())
    config = _read_json(folder / CONFIG_FILE, required=True)
    if not (folder / TOKENIZER_FILE).is_file():
        raise InvalidArgument(
            f"{folder} has no {TOKENIZER_FILE}: kvmesh needs a fast tokenizer; create it with "
            f"transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
        )
    tok_config = _read_json(folder / TOKENIZER_CONFIG_FILE, required=False)
    gen_config = _read_json(folder / GENERATION_CONFIG_FILE, required=False)
    tokens = {k: _token_content(tok_config, k) for k in _SPECIAL_TOKEN_NAMES}
    resolver = _TokenIds(folder, tok_config)
    eos_ids = [
        *_int_list(config, "eos_token_id", folder / CONFIG_FILE),
        *_int_list(gen_config, "eos_token_id", folder / GENERATION_CONFIG_FILE),
    ]
    if tokens["eos_token"] is not None:
        eos_ids.append(resolver.id_of(tokens["eos_token"], "eos_token"))
    bos = tokens["bos_token"]
    return ModelInfo(
        name=name or folder.name,
        path=folder,
        context_length=_context_length(folder, config, tok_config),
        vocab_size=_vocab_size(config, resolver),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        bos_token=bos,
        bos_token_id=None if bos is None else resolver.id_of(bos, "bos_token"),
        eos_token=tokens["eos_token"],
        pad_token=tokens["pad_token"],
        unk_token=tokens["unk_token"],
        chat_template=_chat_template(folder, tok_config),
        special_token_ids=resolver.special_ids(),
    )


def _check_folder(folder: Path) -> Path:
    if not folder.exists():
        raise InvalidArgument(
            f"model folder {folder} does not exist: pass the path of a Hugging Face-style "
            f"model folder (one with {CONFIG_FILE} and {TOKENIZER_FILE})"
        )
    if not folder.is_dir():
        raise InvalidArgument(
            f"model path {folder} is a file, not a folder: pass the folder that holds "
            f"{CONFIG_FILE} and {TOKENIZER_FILE}"
        )
    return folder.resolve()


def _read_json(file: Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise InvalidArgument(
                f"{file.parent} has no {file.name}: a model folder needs the model's "
                f"Hugging Face {file.name}"
            )
        return {}
    try:
        value = json.loads(file.read_bytes())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{file} cannot be read as JSON ({exc}): fix or replace the file") from exc
    if not isinstance(value, dict):
        raise InvalidArgument(f"{file} holds a JSON {type(value).__name__}, not an object: fix or replace the file")
    return value


def _token_content(tok_config: Mapping[str, Any], key: str) -> str | None:
    """tokenizer_config.json stores a special token as a string or as an AddedToken dict."""
    value = tok_config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise InvalidArgument(f"{TOKENIZER_CONFIG_FILE} {key} is {value!r}: set it to a token string or null")


def _int_list(config: Mapping[str, Any], key: str, file: Path) -> list[int]:
    value = config.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(type(v) is int and v >= 0 for v in values):
        raise InvalidArgument(f"{file} {key} is {value!r}: set it to a token id or a list of token ids")
    return values


def _positive_int(config: Mapping[str, Any], key: str, file: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise InvalidArgument(f"{file} {key} is {value!r}: set it to a positive integer")
    return value


def _nested_lookup(config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    """First of ``keys`` set in config.json or in its ``text_config`` (multimodal models)."""
    sections = [config]
    if isinstance(config.get("text_config"), dict):
        sections.append(config["text_config"])
    for section in sections:
        for key in keys:
            value = _positive_int(section, key, CONFIG_FILE)
            if value is not None:
                return value
    return None


def _context_length(folder: Path, config: Mapping[str, Any], tok_config: Mapping[str, Any]) -> int:
    limits = [_nested_lookup(config, _CONTEXT_KEYS)]
    tok_limit = tok_config.get("model_max_length")
    if type(tok_limit) is int and 0 < tok_limit < _NO_LIMIT:
        limits.append(tok_limit)
    known = [n for n in limits if n is not None]
    if not known:
        raise InvalidArgument(
            f"{folder} does not say its context length: set max_position_embeddings in "
            f"{CONFIG_FILE} or model_max_length in {TOKENIZER_CONFIG_FILE}"
        )
    return min(known)


def _vocab_size(config: Mapping[str, Any], resolver: _TokenIds) -> int:
    size = _nested_lookup(config, ("vocab_size",))
    return size if size is not None else resolver.tokenizer_vocab_size()


def _chat_template(folder: Path, tok_config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json (as in transformers)."""
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = tok_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return _pick_named_template(folder, value)
    raise InvalidArgument(
        f"{folder / TOKENIZER_CONFIG_FILE} chat_template is a {type(value).__name__}: "
        f"set it to a template string or a list of {{name, template}} objects"
    )


def _pick_named_template(folder: Path, entries: list[Any]) -> str | None:
    """The list form: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]."""
    named: dict[str, str] = {}
    for entry in entries:
        fields = (entry.get("name"), entry.get("template")) if isinstance(entry, dict) else (None, None)
        if not all(isinstance(f, str) for f in fields):
            raise InvalidArgument(
                f"{folder / TOKENIZER_CONFIG_FILE} chat_template has an entry {entry!r}: "
                f"each entry needs a string name and a string template"
            )
        named[entry["name"]] = entry["template"]
    if "default" in named:
        return named["default"]
    # NOTE: with one template and no "default" the choice is unambiguous.
    return next(iter(named.values())) if len(named) == 1 else None


class _TokenIds:
    """Resolves token strings to ids: tokenizer_config.json first, tokenizer.json if needed.

    tokenizer.json is parsed only when tokenizer_config.json lacks ``added_tokens_decoder``
    (old folders), because parsing a large vocabulary costs a noticeable fraction of a second.
    """

    def __init__(self, folder: Path, tok_config: Mapping[str, Any]) -> None:
        self._folder = folder
        self._known: dict[str, int] = {}
        self._special: list[int] = []
        decoder = tok_config.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            for key, token in decoder.items():
                if isinstance(token, dict) and isinstance(token.get("content"), str) and key.isdigit():
                    self._known[token["content"]] = int(key)
                    if token.get("special"):
                        self._special.append(int(key))
        self._tokenizer: Any = None

    def special_ids(self) -> tuple[int, ...]:
        """Ids of the added tokens marked special (from tokenizer_config.json)."""
        return tuple(sorted(self._special))

    def _load(self) -> Any:
        if self._tokenizer is None:
            from kvmesh.preprocess.tokenizer import load_tokenizers_file  # the tokenizers library: only if needed

            self._tokenizer = load_tokenizers_file(self._folder / TOKENIZER_FILE)
        return self._tokenizer

    def id_of(self, token: str, key: str) -> int:
        if token in self._known:
            return self._known[token]
        token_id = self._load().token_to_id(token)
        if token_id is None:
            raise InvalidArgument(
                f"{self._folder / TOKENIZER_CONFIG_FILE} {key} is {token!r}, which is not in "
                f"{TOKENIZER_FILE}: set {key} to a token the tokenizer has"
            )
        return int(token_id)

    def tokenizer_vocab_size(self) -> int:
        return int(self._load().get_vocab_size(with_added_tokens=True))
