"""A LoRA load reads a folder on the worker's host (admin-only routes): whatever the
folder holds, the worker reads bounded amounts and answers a clear 400, never allocates
what a header claims, and loads nothing that is not a LoRA weight (issue 30)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import pytest

from kvmesh.engines.lora import MAX_CONFIG_BYTES, MAX_WEIGHTS_BYTES, check_name, read_adapter
from kvmesh.errors import InvalidArgument
from kvmesh.protocol import LoraCommand
from kvmesh.testing.lora import write_adapter

pytestmark = pytest.mark.timeout(30)


def test_a_header_claiming_a_huge_length_is_refused_before_reading(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(InvalidArgument, match="header length"):
        read_adapter(str(folder))


def test_oversized_files_are_refused_by_their_size(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    with (folder / "adapter_model.safetensors").open("r+b") as f:
        f.truncate(MAX_WEIGHTS_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(InvalidArgument, match="more than"):
        read_adapter(str(folder))
    folder = write_adapter(tmp_path / "b")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "pad": "x" * MAX_CONFIG_BYTES}))
    with pytest.raises(InvalidArgument, match="more than"):
        read_adapter(str(folder))


def test_base_model_weights_cannot_ride_along(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    raw = (folder / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["model.embed_tokens.weight"] = {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}
    body = json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    with pytest.raises(InvalidArgument, match="not a LoRA weight"):
        read_adapter(str(folder))


@pytest.mark.parametrize("name", ["", "../etc", "a\nb", "a b", "x" * 129, "\u0430dapter"])
def test_adapter_names_are_plain(name: str) -> None:
    with pytest.raises(InvalidArgument, match="adapter name"):
        check_name(name)


def test_a_command_with_an_overlong_path_does_not_decode() -> None:
    payload = msgspec.msgpack.encode({"op": "load", "name": "a", "path": "/" * 5000})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(payload, type=LoraCommand)
