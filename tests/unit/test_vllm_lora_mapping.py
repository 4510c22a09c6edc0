"""The vLLM engine's LoRA mapping without vLLM (issue 30): adapter names get stable
positive ids and their paths (LoRARequest's arguments); an unknown adapter is a 404;
--lora turns on vLLM's LoRA with --max-loras."""

from __future__ import annotations

import pytest

from kvmesh.engines.vllm.mapping import LoraIds
from kvmesh.engines.vllm.options import VllmOptions
from kvmesh.errors import ModelNotFound


def test_adapters_map_to_lora_request_arguments_with_stable_ids() -> None:
    ids = LoraIds({"a": "/lora/a", "b": "/lora/b"})
    assert ids.request_args(None) is None
    assert ids.request_args("a") == ("a", 1, "/lora/a") and ids.request_args("b") == ("b", 2, "/lora/b")
    assert ids.add("c", "/lora/c") == ("c", 3, "/lora/c")
    assert ids.add("a", "/lora/a2") == ("a", 1, "/lora/a2")  # a reload keeps the id
    assert ids.remove("b") == 2 and ids.names == ["a", "c"]
    assert ids.add("b", "/lora/b") == ("b", 4, "/lora/b")  # ids are never reused
    with pytest.raises(ModelNotFound, match="no LoRA adapter 'zzz'"):
        ids.request_args("zzz")
    with pytest.raises(ModelNotFound):
        ids.remove("zzz")


def test_lora_flags_turn_on_vllms_lora() -> None:
    assert "enable_lora" not in VllmOptions(model="/m").engine_kwargs()
    kw = VllmOptions(model="/m", loras=("a=/lora/a",), max_loras=2).engine_kwargs()
    assert kw["enable_lora"] is True and kw["max_loras"] == 2
    assert VllmOptions(model="/m", loras=("a=/x",), engine_args={"max_lora_rank": 64}).engine_kwargs()["max_lora_rank"] == 64
