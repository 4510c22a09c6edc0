"""The frontend-facing Preprocessor over the bundled model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvmesh.preprocess
from kvmesh.errors import InvalidArgument
from kvmesh.preprocess import Preprocessor, bundled_model_path

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor.from_folder(bundled_model_path())


def test_public_api() -> None:
    assert sorted(kvmesh.preprocess.__all__) == kvmesh.preprocess.__all__
    assert all(hasattr(kvmesh.preprocess, name) for name in kvmesh.preprocess.__all__)


def test_model_facts(pre: Preprocessor) -> None:
    assert pre.info.name == "kvmesh-tiny"
    assert pre.info.context_length == 2048
    assert pre.info.vocab_size == 2048
    assert pre.eos_token_ids == frozenset({0, 2})


def test_chat_prompt_parses_special_tokens(pre: Preprocessor) -> None:
    messages = [{"role": "user", "content": "héllo 🙂"}]
    ids = pre.chat_prompt(messages)
    assert ids[0] == 1  # <|im_start|> is one id, not its characters
    assert ids.count(1) == 2 and ids.count(2) == 1
    prompt_tail = pre.tokenizer.encode("<|im_start|>assistant\n")
    assert ids[-len(prompt_tail) :] == prompt_tail
    assert pre.tokenizer.decode(ids, skip_special_tokens=False) == pre.render_chat(messages)
    assert pre.chat_prompt(messages, add_generation_prompt=False)[-2:] == [2, pre.tokenizer.encode("\n")[0]]


def test_text_prompt(pre: Preprocessor) -> None:
    assert pre.text_prompt("hello") == pre.tokenizer.encode("hello")
    assert pre.text_prompt([5, 6, 7]) == [5, 6, 7]
    assert pre.text_prompt((0, 2047)) == [0, 2047]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([1, 2048], r"token id 2048 is outside the vocabulary .* \[0, 2048\)"),
        ([-1], "token id -1 is outside"),
        ([1, "2"], "must all be integers"),
        ([1] * 2048, "has 2048 tokens but model 'kvmesh-tiny' has a context of 2048"),
        ("a" * 3000, "shorten the prompt"),
    ],
)
def test_bad_prompts(pre: Preprocessor, prompt: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        pre.text_prompt(prompt)  # type: ignore[arg-type]


def test_detokenizer_streams_generated_ids(pre: Preprocessor) -> None:
    ids = pre.tokenizer.encode("Bonjour, ça va? 🙂<|im_end|>")
    detok = pre.detokenizer()
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == "Bonjour, ça va? 🙂"


def test_stop_matcher_from_openai_field(pre: Preprocessor) -> None:
    assert pre.stop_matcher(None).feed("a\n\nb") == ("a\n\nb", False)
    assert pre.stop_matcher("\n\n").feed("a\n\nb") == ("a", True)
    assert pre.stop_matcher(["x", "\n\n"], include_stop=True).feed("a\n\nb") == ("a\n\n", True)


def test_model_without_chat_template(tmp_path: Path) -> None:
    folder = tmp_path / "base-model"
    shutil.copytree(bundled_model_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    pre = Preprocessor.from_folder(folder)
    assert pre.chat_template is None
    with pytest.raises(InvalidArgument, match="has no chat template: send a text prompt"):
        pre.chat_prompt([{"role": "user", "content": "hi"}])
    assert pre.text_prompt("hi")


def test_broken_chat_template_fails_at_load(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(bundled_model_path(), folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}", encoding="utf-8")
    with pytest.raises(InvalidArgument, match=f"chat template of {folder} does not compile"):
        Preprocessor.from_folder(folder)


@pytest.mark.slow
def test_make_tiny_model_script(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(out), "--max-bytes", "3000000"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pre = Preprocessor.from_folder(out)
    assert pre.tokenizer.vocab_size == 2048
    assert pre.chat_prompt([{"role": "user", "content": "hi"}])[0] == 1
    assert pre.eos_token_ids == frozenset({0, 2})
