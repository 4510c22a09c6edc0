"""``VllmOptions``: what a kvmesh worker tells vLLM when it builds its engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engines.settings import VllmSettings

__all__ = ["VllmOptions", "ENV_PREFIX"]

ENV_PREFIX = "KVMESH_VLLM_"  # the variables are declared in kvmesh.engines.settings.VllmSettings


@dataclass(frozen=True)
class VllmOptions:
    """Options of :class:`~kvmesh.engines.vllm.VllmEngine`; validated on construction.

    ``block_size`` is also the KV router's block size for this worker (vLLM's CPU
    attention needs a multiple of 32; GPUs take 16). ``kv_cache_gb`` sets vLLM's CPU
    KV cache (``VLLM_CPU_KVCACHE_SPACE``; ignored on GPUs, where
    ``gpu_memory_utilization`` rules). ``kv_transfer_config`` is vLLM's
    ``KVTransferConfig`` as a mapping (``kv_connector``, ``kv_role``,
    ``kv_connector_extra_config``): disaggregation through vLLM's KV connectors.
    ``engine_args`` are any further ``AsyncEngineArgs`` fields, passed unchanged.
    """

    model: str
    served_model_name: str = ""
    worker_id: int = 0
    block_size: int = 32
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    kv_events: bool = True
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float | None = None
    kv_transfer_config: Mapping[str, Any] | None = None
    engine_args: Mapping[str, Any] = field(default_factory=dict)

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

    @classmethod
    def from_settings(
        cls, settings: VllmSettings, model: str, served_model_name: str = "", worker_id: int = 0
    ) -> VllmOptions:
        """Options from the declared ``--vllm-*`` settings (kvmesh.engines.settings)."""
        values: dict[str, Any] = {k: v for k, v in dataclasses.asdict(settings).items() if v is not None}
        return cls(model=model, served_model_name=served_model_name, worker_id=worker_id, **values)

    @classmethod
    def from_env(cls, model: str, served_model_name: str = "", worker_id: int = 0, env: Mapping[str, str] | None = None) -> VllmOptions:
        """Options for a worker, the rest from ``KVMESH_VLLM_<OPTION>`` variables
        (``KVMESH_VLLM_BLOCK_SIZE=32``, ``KVMESH_VLLM_ENFORCE_EAGER=1``,
        ``KVMESH_VLLM_KV_TRANSFER_CONFIG='{"kv_connector": ...}'`` (JSON), ...), as
        declared in :class:`~kvmesh.engines.settings.VllmSettings`."""
        from kvmesh.settings import resolve

        return cls.from_settings(resolve(VllmSettings, env=env), model, served_model_name, worker_id)

    def engine_kwargs(self) -> dict[str, Any]:
        """``AsyncEngineArgs`` keyword arguments, except the KV events and transfer
        configs (vLLM objects the engine builds itself)."""
        kw: dict[str, Any] = {
            "model": self.model,
            "served_model_name": self.served_model_name or None,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "dtype": self.dtype,
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
        kw.update(self.engine_args)
        return kw
