"""Model folders: the bundled one, and each way a folder can be wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.preprocess import BUNDLED_MODEL_NAME, ModelInfo, bundled_model_path, load_model_folder


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A writable copy of the bundled model folder."""
    dest = tmp_path / "my-model"
    shutil.copytree(bundled_model_path(), dest)
    return dest


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_bundled_folder_loads() -> None:
    info = load_model_folder(bundled_model_path())
    assert info.name == BUNDLED_MODEL_NAME
    assert info.path == bundled_model_path()
    assert info.context_length == 2048
    assert info.vocab_size == 2048
    assert info.eos_token_ids == (2, 0)  # <|im_end|> first: config.json's eos_token_id
    assert info.eos_token == "<|im_end|>"
    assert info.bos_token is None and info.bos_token_id is None
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    assert info.special_tokens() == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_bundled_path_is_inside_the_package() -> None:
    import kvmesh.preprocess

    path = bundled_model_path()
    assert path.is_relative_to(Path(kvmesh.preprocess.__file__).parent.parent)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).is_file()


def test_served_name_defaults_to_folder_name_and_can_be_overridden(folder: Path) -> None:
    assert load_model_folder(folder).name == "my-model"
    assert load_model_folder(folder, name="served").name == "served"
    assert isinstance(load_model_folder(str(folder)), ModelInfo)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_model_folder(tmp_path / "nope")


def test_path_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"")
    with pytest.raises(InvalidArgument, match="is a file, not a folder"):
        load_model_folder(file)


def test_config_missing(folder: Path) -> None:
    (folder / "config.json").unlink()
    with pytest.raises(InvalidArgument, match="has no config.json"):
        load_model_folder(folder)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff"])
def test_config_unparseable(folder: Path, content: str) -> None:
    (folder / "config.json").write_text(content, encoding="latin-1")
    with pytest.raises(InvalidArgument, match="config.json") as info:
        load_model_folder(folder)
    assert "fix or replace" in info.value.message


def test_tokenizer_missing(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    with pytest.raises(InvalidArgument, match="has no tokenizer.json"):
        load_model_folder(folder)


def test_optional_files_may_be_absent(folder: Path) -> None:
    (folder / "tokenizer_config.json").unlink()
    (folder / "generation_config.json").unlink()
    info = load_model_folder(folder)
    assert info.eos_token_ids == (2,)
    assert info.chat_template is None
    assert info.context_length == 2048


def test_context_length_takes_the_smaller_limit(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", model_max_length=512)
    assert load_model_folder(folder).context_length == 512
    # transformers' "no limit" sentinel is ignored
    edit_json(folder / "tokenizer_config.json", model_max_length=int(1e30))
    assert load_model_folder(folder).context_length == 2048


def test_context_length_from_tokenizer_when_config_lacks_it(folder: Path) -> None:
    edit_json(folder / "config.json", max_position_embeddings=...)
    edit_json(folder / "tokenizer_config.json", model_max_length=1000)
    assert load_model_folder(folder).context_length == 1000
    edit_json(folder / "tokenizer_config.json", model_max_length=...)
    with pytest.raises(InvalidArgument, match="set max_position_embeddings"):
        load_model_folder(folder)


def test_context_length_from_text_config(folder: Path) -> None:
    edit_json(folder / "config.json", max_position_embeddings=..., text_config={"max_position_embeddings": 4096})
    assert load_model_folder(folder).context_length == 2048  # tokenizer_config's 2048 is smaller
    edit_json(folder / "tokenizer_config.json", model_max_length=...)
    assert load_model_folder(folder).context_length == 4096


def test_bad_numbers_are_named(folder: Path) -> None:
    edit_json(folder / "config.json", max_position_embeddings="long")
    with pytest.raises(InvalidArgument, match="max_position_embeddings is 'long'"):
        load_model_folder(folder)


def test_eos_ids_are_the_union_of_all_sources(folder: Path) -> None:
    edit_json(folder / "config.json", eos_token_id=[5, 2])
    edit_json(folder / "generation_config.json", eos_token_id=7)
    edit_json(folder / "tokenizer_config.json", eos_token={"content": "<|endoftext|>", "special": True})
    assert load_model_folder(folder).eos_token_ids == (5, 2, 7, 0)


def test_special_tokens_resolve_through_tokenizer_json(folder: Path) -> None:
    # old folders have no added_tokens_decoder: ids come from tokenizer.json
    edit_json(folder / "tokenizer_config.json", added_tokens_decoder=..., bos_token="<|im_start|>")
    info = load_model_folder(folder)
    assert info.bos_token == "<|im_start|>" and info.bos_token_id == 1
    assert 2 in info.eos_token_ids


def test_unknown_eos_token(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", added_tokens_decoder=..., eos_token="</s>")
    with pytest.raises(InvalidArgument, match="eos_token is '</s>', which is not in tokenizer.json"):
        load_model_folder(folder)


def test_bad_eos_id(folder: Path) -> None:
    edit_json(folder / "generation_config.json", eos_token_id="2")
    with pytest.raises(InvalidArgument, match="generation_config.json eos_token_id"):
        load_model_folder(folder)


def test_vocab_size_falls_back_to_the_tokenizer(folder: Path) -> None:
    edit_json(folder / "config.json", vocab_size=...)
    assert load_model_folder(folder).vocab_size == 2048


def test_named_chat_templates_pick_default(folder: Path) -> None:
    edit_json(
        folder / "tokenizer_config.json",
        chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    )
    assert load_model_folder(folder).chat_template == "D"
    edit_json(folder / "tokenizer_config.json", chat_template=[{"name": "only", "template": "O"}])
    assert load_model_folder(folder).chat_template == "O"
    two = [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]
    edit_json(folder / "tokenizer_config.json", chat_template=two)
    assert load_model_folder(folder).chat_template is None
    edit_json(folder / "tokenizer_config.json", chat_template=[{"name": "a"}])
    with pytest.raises(InvalidArgument, match="each entry needs a string name and a string template"):
        load_model_folder(folder)


def test_chat_template_jinja_file_wins(folder: Path) -> None:
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert load_model_folder(folder).chat_template == "{{ messages[0]['content'] }}"
