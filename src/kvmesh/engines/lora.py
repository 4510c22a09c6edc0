"""LoRA adapters, the engine side without torch: reading and checking a PEFT folder, and
the table of resident adapters every engine keeps (issue 30).

A PEFT adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.N.{self_attn|mlp}.P.lora_{A|B}.weight``: ``A`` is
``(r, in)``, ``B`` ``(out, r)``, and the adapted linear computes
``y = x W^T + scale · (x A^T) B^T`` with ``scale = lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``). :func:`read_adapter` reads only the config and the safetensors header
(sizes bounded before anything is allocated) and says what is wrong in an
:class:`~kvmesh.errors.InvalidArgument`; an engine then loads the tensors it checked.

:class:`AdapterTable` is pure (no I/O, no clock): which adapters are resident in which
slot, which paths are known, how many running sequences use each, and which adapter a
load past capacity evicts (the least recently used one that no sequence uses).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import InvalidArgument, ModelNotFound, ResourceExhausted
from kvmesh.protocol import MAX_ADAPTER_NAME, MAX_ADAPTERS, MAX_KNOWN_ADAPTERS, LoraState

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "TARGETS",
    "AdapterFiles",
    "AdapterTable",
    "parse_lora_flags",
    "read_adapter",
    "check_name",
    "check_against",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 16
MAX_HEADER_BYTES = 1 << 22  # a safetensors JSON header
MAX_WEIGHTS_BYTES = 4 << 30
MAX_RANK = 512
# the projections of a Llama-family layer an adapter may target, and where they live
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
# PEFT config keys whose non-default value changes the maths this engine does not do
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """A checked PEFT folder: its rank and scale, and per (layer, projection) the
    safetensors names and shapes of ``A`` (r, in) and ``B`` (out, r)."""

    path: str
    rank: int
    scale: float
    targets: tuple[str, ...]
    tensors: dict[tuple[int, str], tuple[str, tuple[int, int], str, tuple[int, int]]]

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE


def check_name(name: str) -> str:
    """``name`` if it can name an adapter (and a model on the wire), else InvalidArgument."""
    if not 0 < len(name) <= MAX_ADAPTER_NAME or not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"adapter name {name[:40]!r} must be 1..{MAX_ADAPTER_NAME} characters of letters, digits and ._:/@+-"
        )
    return name


def parse_lora_flags(values: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--lora NAME=PATH`` values as {name: path}; ValueError that names the bad one."""
    out: dict[str, str] = {}
    for text in values:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora wants NAME=PATH, got {text!r}")
        try:
            check_name(name)
        except InvalidArgument as exc:
            raise ValueError(f"--lora {text!r}: {exc.message}") from None
        if name in out:
            raise ValueError(f"--lora names adapter {name!r} twice")
        out[name] = path
    return out


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > limit:
            raise InvalidArgument(f"{path}: {what} is {size} bytes, more than {limit}")
        with path.open("rb") as f:
            return f.read(limit + 1)[:limit]
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read {what} ({exc.strerror or exc})") from None


def _config(folder: Path) -> tuple[int, float, tuple[str, ...]]:
    raw = _read_bounded(folder / CONFIG_FILE, MAX_CONFIG_BYTES, "the adapter config")
    where = folder / CONFIG_FILE
    try:
        cfg = json.loads(raw)
        rank, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
        targets = cfg["target_modules"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"{where}: not a PEFT LoRA config (needs r, lora_alpha, target_modules): {exc}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if not isinstance(rank, int) or not 0 < rank <= MAX_RANK or not isinstance(alpha, (int, float)):
        raise InvalidArgument(f"{where}: r must be an integer in 1..{MAX_RANK} and lora_alpha a number")
    for key, default in _UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, None, [], {}):
            raise InvalidArgument(f"{where}: {key}={cfg[key]!r} is not supported (only plain LoRA: {key}={default!r})")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t in TARGETS for t in targets):
        raise InvalidArgument(f"{where}: target_modules must name some of {', '.join(TARGETS)}, got {targets!r}")
    scale = float(alpha) / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return rank, scale, tuple(sorted(set(targets)))


def _header(path: Path) -> dict[str, object]:
    """The safetensors header (bounded) of ``path``."""
    try:
        size = path.stat().st_size
        if size > MAX_WEIGHTS_BYTES:
            raise InvalidArgument(f"{path}: {size} bytes of adapter weights, more than {MAX_WEIGHTS_BYTES}")
        with path.open("rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise InvalidArgument(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read the adapter weights ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise InvalidArgument(f"{path}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{path}: not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    return header


def _shape(path: Path, name: str, entry: object) -> tuple[int, int]:
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        raise InvalidArgument(f"{path}: tensor {name!r} must be one of {', '.join(_DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise InvalidArgument(f"{path}: tensor {name!r} must be 2-dimensional, got shape {shape!r}")
    return shape[0], shape[1]


def read_adapter(path: str) -> AdapterFiles:
    """Check the PEFT folder at ``path`` (config and safetensors header; every tensor a
    LoRA A or B of a known projection, each with its pair, ranks matching ``r``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidArgument(f"LoRA adapter path {path!r} is not a folder on this worker's host")
    rank, scale, targets = _config(folder)
    weights = folder / WEIGHTS_FILE
    found: dict[tuple[int, str], dict[str, tuple[str, tuple[int, int]]]] = {}
    for name, entry in _header(weights).items():
        m = _TENSOR.fullmatch(name)
        if m is None or TARGETS.get(m.group(3)) != m.group(2) or m.group(3) not in targets:
            raise InvalidArgument(f"{weights}: tensor {name!r} is not a LoRA weight of {', '.join(targets)}")
        found.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = (name, _shape(weights, name, entry))
    tensors = {}
    for key, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise InvalidArgument(f"{weights}: layer {key[0]} {key[1]} has lora_{''.join(pair)} without its pair")
        (a_name, a_shape), (b_name, b_shape) = pair["A"], pair["B"]
        if a_shape[0] != rank or b_shape[1] != rank:
            raise InvalidArgument(f"{weights}: layer {key[0]} {key[1]}: A {a_shape} and B {b_shape} are not of rank {rank}")
        tensors[key] = (a_name, a_shape, b_name, b_shape)
    if not tensors:
        raise InvalidArgument(f"{weights}: no LoRA weights")
    return AdapterFiles(str(folder), rank, scale, targets, tensors)


def check_against(files: AdapterFiles, num_layers: int, shapes: dict[str, tuple[int, int]], max_rank: int) -> None:
    """``files`` fits a model of ``num_layers`` layers whose projections are (in, out)
    ``shapes``, at ``max_rank`` at most; InvalidArgument naming the mismatch."""
    if files.rank > max_rank:
        raise InvalidArgument(f"{files.path}: adapter rank {files.rank} is above this worker's --max-lora-rank {max_rank}")
    for (layer, target), (_, a_shape, _, b_shape) in files.tensors.items():
        if layer >= num_layers:
            raise InvalidArgument(f"{files.path}: layer {layer} is past the model's {num_layers} layers")
        fan_in, fan_out = shapes[target]
        if a_shape[1] != fan_in or b_shape[0] != fan_out:
            raise InvalidArgument(
                f"{files.path}: layer {layer} {target} is A {a_shape}, B {b_shape}; the model's {target} takes "
                f"{fan_in} inputs to {fan_out} outputs: this adapter was made for another model"
            )


class AdapterTable:
    """Resident adapters in slots ``1 .. capacity`` (0: the base model) and the paths
    known for every name (``--lora`` and earlier loads). Pure; which adapters running
    sequences use is the caller's to say (``in_use``), so nothing here can leak a count."""

    def __init__(self, capacity: int, known: dict[str, str] | None = None) -> None:
        if not 0 <= capacity <= MAX_ADAPTERS:
            raise ValueError(f"max_loras must be in 0..{MAX_ADAPTERS}, got {capacity}")
        self.capacity = capacity
        self.known: dict[str, str] = dict(known or {})
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first

    def state(self, load_ms: float = 0.0) -> LoraState:
        known = sorted(self.known)[:MAX_KNOWN_ADAPTERS]  # (the frontend serves these names)
        return LoraState(adapters=self.resident, max_adapters=self.capacity, load_ms=load_ms, known=known)

    @property
    def resident(self) -> list[str]:
        return sorted(self._slots)

    def slot(self, name: str) -> int | None:
        """The resident adapter's slot (touching it: most recently used), else None."""
        slot = self._slots.get(name)
        if slot is not None:
            self._slots.move_to_end(name)
        return slot

    def path_of(self, name: str) -> str:
        """The path ``name`` loads from; ModelNotFound when the worker knows none."""
        path = self.known.get(name)
        if path is None:
            raise ModelNotFound(f"this worker has no LoRA adapter {name!r} (load it first, or start it with --lora)")
        return path

    def place(self, name: str, in_use: set[str]) -> tuple[int, str | None]:
        """A slot to load ``name`` into (its own if resident) and the adapter evicted to
        free it (None: a free slot), the least recently used one not ``in_use``. Both
        leave the resident set now, so no request starts on a slot being rewritten;
        :meth:`put` records the load. ResourceExhausted when every slot holds an adapter in use."""
        if self.capacity == 0:
            raise InvalidArgument("this worker serves no LoRA adapters (--max-loras 0)")
        if name in self._slots:
            return self._slots.pop(name), None
        used = set(self._slots.values())
        free = [s for s in range(1, self.capacity + 1) if s not in used]
        if free:
            return free[0], None
        for victim, slot in self._slots.items():  # least recently used first
            if victim not in in_use:
                del self._slots[victim]
                return slot, victim
        raise ResourceExhausted(f"all {self.capacity} LoRA slots hold adapters in use; {name!r} cannot load now")

    def clear_resident(self) -> None:
        """Nothing is resident any more (the engine restarted: its slots are gone); the
        known paths stay."""
        self._slots.clear()

    def put(self, name: str, slot: int, path: str) -> None:
        """Record ``name`` loaded into ``slot`` (from :meth:`place`) from ``path``."""
        self._slots[name] = slot
        self.known[name] = path

    def remove(self, name: str, in_use: set[str]) -> int:
        """Unload ``name`` and forget its path; its slot (0: it was not resident).
        Refused while a running sequence uses it."""
        if name not in self._slots and name not in self.known:
            raise ModelNotFound(f"this worker has no LoRA adapter {name!r}")
        if name in in_use:
            raise InvalidArgument(f"LoRA adapter {name!r} is in use by running requests; unload it when they end")
        self.known.pop(name, None)
        return self._slots.pop(name, 0)
