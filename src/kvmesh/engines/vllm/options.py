"""``VllmOptions``: what a kvmesh worker tells vLLM when it builds its engine."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engines.settings import VllmSettings

__all__ = ["VllmOptions", "ENV_PREFIX", "default_kv_cache_gb", "model_dtype", "mem_available_bytes"]

# CPU defaults (issue 18): with no KVMESH_VLLM_KV_CACHE_GB, vLLM's CPU KV cache gets this
# share of the memory really available now (MemAvailable), within these bounds, instead
# of vLLM's own default, which wants most of the NUMA node and refuses to start on a
# shared host.
KV_CACHE_SHARE = 0.25
KV_CACHE_MIN_GB = 1  # vLLM reads VLLM_CPU_KVCACHE_SPACE as whole GiB
KV_CACHE_MAX_GB = 16


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available for new work (None where unknown)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_kv_cache_gb(available: int | None) -> int | None:
    """vLLM's CPU KV cache size in whole GiB (vLLM parses ``VLLM_CPU_KVCACHE_SPACE`` as an
    integer: "5.55" stops its start) for a host with ``available`` bytes free: a quarter,
    rounded down, within 1..16; None when unknown (vLLM's own default then)."""
    if available is None:
        return None
    gb = int(available * KV_CACHE_SHARE) >> 30
    return min(max(gb, KV_CACHE_MIN_GB), KV_CACHE_MAX_GB)


def model_dtype(folder: str) -> str | None:
    """The dtype a model folder's config.json declares (``torch_dtype`` or ``dtype``),
    e.g. ``"float32"``; None when it says nothing. vLLM's ``auto`` would downcast a
    float32 model to bfloat16 on a CPU (SmolLM2 then answers nonsense)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return value if isinstance(value, str) and value in ("float32", "float16", "bfloat16") else None

ENV_PREFIX = "KVMESH_VLLM_"  # the variables are declared in kvmesh.engines.settings.VllmSettings


@dataclass(frozen=True)
class VllmOptions:
    """Options of :class:`~kvmesh.engines.vllm.VllmEngine`; validated on construction.

    ``block_size`` is also the KV router's block size for this worker (vLLM's CPU
    attention needs a multiple of 32; GPUs take 16). ``kv_cache_gb`` sets vLLM's CPU
    KV cache (``VLLM_CPU_KVCACHE_SPACE``; ignored on GPUs, where
    ``gpu_memory_utilization`` rules); unset, it is :func:`default_kv_cache_gb` of the
    memory available when the engine starts. ``dtype`` ``auto`` means the model's own
    (:func:`model_dtype`), not vLLM's ``auto``. ``kv_transfer_config`` is vLLM's
    ``KVTransferConfig`` as a mapping (``kv_connector``, ``kv_role``,
    ``kv_connector_extra_config``): disaggregation through vLLM's KV connectors.
    ``engine_args`` are any further ``AsyncEngineArgs`` fields, passed unchanged.
    The defaults of declared settings are :class:`VllmSettings`'s (the CLI's); build
    from resolved settings with :func:`~kvmesh.engines.settings.options_from`.
    """

    model: str
    served_model_name: str = ""
    worker_id: int = 0
    block_size: int = VllmSettings.block_size
    max_model_len: int | None = VllmSettings.max_model_len
    max_num_seqs: int = VllmSettings.max_num_seqs
    max_num_batched_tokens: int | None = VllmSettings.max_num_batched_tokens
    dtype: str = VllmSettings.dtype
    seed: int = VllmSettings.seed
    enforce_eager: bool = VllmSettings.enforce_eager
    enable_prefix_caching: bool = VllmSettings.enable_prefix_caching
    kv_events: bool = True
    kv_cache_gb: int | None = VllmSettings.kv_cache_gb
    gpu_memory_utilization: float | None = VllmSettings.gpu_memory_utilization
    kv_transfer_config: Mapping[str, Any] | None = VllmSettings.kv_transfer_config
    engine_args: Mapping[str, Any] = field(default_factory=dict)  # VllmSettings.engine_args None: none
    # LoRA adapters (issue 30): --lora NAME=PATH turns on vLLM's LoRA (enable_lora) with
    # max_loras adapters per batch; without --lora the worker serves none (vLLM's LoRA
    # layers cost memory and speed, so they are not on by default)
    loras: tuple[str, ...] = ()
    max_loras: int = 4

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("VllmOptions.model must name a model folder")
        for name in ("block_size", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"VllmOptions.{name} must be positive, got {getattr(self, name)}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_gb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"VllmOptions.{name} must be positive, got {value}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"VllmOptions.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        clash = {"model", "served_model_name", "kv_events_config", "kv_transfer_config"} & set(self.engine_args)
        if clash:
            raise ValueError(f"VllmOptions.engine_args must not set {sorted(clash)}: use the options of the same name")

    def engine_kwargs(self) -> dict[str, Any]:
        """``AsyncEngineArgs`` keyword arguments, except the KV events and transfer
        configs (vLLM objects the engine builds itself)."""
        kw: dict[str, Any] = {
            "model": self.model,
            "served_model_name": self.served_model_name or None,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "dtype": self.dtype if self.dtype != "auto" else (model_dtype(self.model) or "auto"),
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "disable_log_stats": True,
        }
        optional = {
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }
        kw.update({k: v for k, v in optional.items() if v is not None})
        if self.serves_loras:
            kw.update(enable_lora=True, max_loras=self.max_loras)
        kw.update(self.engine_args)
        return kw

    @property
    def serves_loras(self) -> bool:
        return bool(self.loras) and self.max_loras > 0
