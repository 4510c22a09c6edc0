"""Configuration of the ``hf`` engine (a Llama-family model on the CPU through PyTorch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.engines.settings import HfSettings

__all__ = ["HfOptions", "ENV_PREFIX"]

ENV_PREFIX = "KVMESH_HF_"  # the variables are declared in kvmesh.engines.settings.HfSettings


@dataclass(frozen=True, slots=True)
class HfOptions:
    """Everything :class:`~kvmesh.engines.hf.engine.HfEngine` needs; read-only.

    ``model_path``: a Hugging Face model folder (``config.json`` + ``*.safetensors``).
    ``num_blocks`` None: as many ``block_size``-token KV blocks as fit in
    ``kv_cache_mb`` MiB (at most enough for ``max_num_seqs`` full contexts).
    ``max_num_batched_tokens`` bounds the tokens of one forward pass (long prompts are
    prefilled in chunks of it). ``threads`` 0: one per CPU this process may use (:func:`~kvmesh.engines.hf.cpus.auto_threads`).
    ``seed`` seeds the sampler of requests that bring no seed of their own.
    """

    model_path: str
    served_model_name: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_mb: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    threads: int = 0
    worker_id: int = 0
    enable_prefix_caching: bool = True
    event_ring_capacity: int = 1024
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path must name a model folder")
        for name in ("block_size", "kv_cache_mb", "max_num_seqs", "max_num_batched_tokens", "event_ring_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.worker_id < 0:
            raise ValueError(f"worker_id must be >= 0, got {self.worker_id}")

    @classmethod
    def from_settings(cls, settings: HfSettings, model_path: str, **given: Any) -> HfOptions:
        """Options from the declared ``--hf-*`` settings (kvmesh.engines.settings) and
        what the worker knows (``given``: served name, worker id, block size)."""
        values: dict[str, Any] = {k: v for k, v in dataclasses.asdict(settings).items() if v is not None}
        values.update(given)
        return cls(model_path=model_path, **values)

    @classmethod
    def from_env(cls, model_path: str, env: Mapping[str, str] | None = None, **given: Any) -> HfOptions:
        """Options for a worker: ``given`` ones, the rest from ``KVMESH_HF_<OPTION>``
        variables (``KVMESH_HF_THREADS=1``, ``KVMESH_HF_KV_CACHE_MB=1024``, ...), as
        declared in :class:`~kvmesh.engines.settings.HfSettings`."""
        from kvmesh.settings import resolve

        return cls.from_settings(resolve(HfSettings, env=env), model_path, **given)
