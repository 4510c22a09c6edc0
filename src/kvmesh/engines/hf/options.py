"""Configuration of the ``hf`` engine (a Llama-family model on the CPU through PyTorch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engines.batching.options import BatchingOptions, check_positive_ints
from kvmesh.engines.settings import HfSettings
from kvmesh.settings import non_negative, positive, require

__all__ = ["HfOptions", "ENV_PREFIX"]

ENV_PREFIX = "KVMESH_HF_"  # the variables are declared in kvmesh.engines.settings.HfSettings


@dataclass(frozen=True, slots=True, kw_only=True)
class HfOptions(BatchingOptions):
    """Everything :class:`~kvmesh.engines.hf.engine.HfEngine` needs; read-only. The
    defaults of declared settings are :class:`HfSettings`'s (the CLI's); build from
    resolved settings with :func:`~kvmesh.engines.settings.options_from`.

    ``model_path`` (the one positional argument): a Hugging Face model folder
    (``config.json`` + ``*.safetensors``).
    ``num_blocks`` None: as many ``block_size``-token KV blocks as fit in
    ``kv_cache_mb`` MiB (at most enough for ``max_num_seqs`` full contexts).
    ``max_num_batched_tokens`` bounds the tokens of one forward pass (long prompts are
    prefilled in chunks of it). ``threads`` 0: one per CPU this process may use (:func:`~kvmesh.engines.hf.cpus.auto_threads`).
    ``seed`` seeds the sampler of requests that bring no seed of their own (and the
    synthetic weights of ``random_weights``).
    ``device`` ``auto``: the first CUDA GPU when one is visible, else the CPU; ``dtype``
    ``auto``: float32 on the CPU, the model's 16-bit dtype (else bfloat16) on a GPU. On a
    GPU the KV pool fills what ``gpu_memory_fraction`` of the card leaves after the
    weights and the largest pass's activations (unless ``num_blocks`` is given), and
    decode passes replay CUDA graphs unless ``enforce_eager``.
    """

    model_path: str = field(kw_only=False)
    num_blocks: int | None = HfSettings.num_blocks
    kv_cache_mb: int = HfSettings.kv_cache_mb
    max_num_seqs: int = HfSettings.max_num_seqs
    max_num_batched_tokens: int = HfSettings.max_num_batched_tokens
    threads: int = HfSettings.threads
    seed: int | None = HfSettings.seed
    # chunked prefill beside short prompts (the batching core's SchedulerLimits; 0: off)
    long_prefill_token_threshold: int = HfSettings.long_prefill_token_threshold
    max_long_partial_prefills: int = HfSettings.max_long_partial_prefills
    max_num_partial_prefills: int = HfSettings.max_num_partial_prefills
    # the device (kvmesh.engines.hf.device): where, in what dtype, how much of a GPU
    device: str = HfSettings.device
    dtype: str = HfSettings.dtype
    gpu_memory_fraction: float = HfSettings.gpu_memory_fraction
    random_weights: str = HfSettings.random_weights
    enforce_eager: bool = HfSettings.enforce_eager
    max_lora_rank: int = HfSettings.max_lora_rank  # LoRA slots are sized for this rank (engines/hf/lora.py)
    # KV tiers below the device pool (engines/hf/tiers.py), in blocks; the disk tier's folder
    host_kv_blocks: int = HfSettings.host_kv_blocks
    disk_kv_blocks: int = HfSettings.disk_kv_blocks
    disk_kv_path: str = HfSettings.disk_kv_path

    def __post_init__(self) -> None:
        BatchingOptions.__post_init__(self)  # no zero-argument super() in a slots dataclass
        if not self.model_path:
            raise ValueError("model_path must name a model folder")
        check_positive_ints(self, "kv_cache_mb")
        if self.num_blocks is not None:
            require("num_blocks", self.num_blocks, positive)
        require("threads", self.threads, non_negative)
        require("max_lora_rank", self.max_lora_rank, positive)
        require("host_kv_blocks", self.host_kv_blocks, non_negative)
        require("disk_kv_blocks", self.disk_kv_blocks, non_negative)
        if self.disk_kv_blocks and not self.disk_kv_path:
            raise ValueError("--hf-disk-kv-blocks needs --hf-disk-kv-path (a folder for the tier's file)")
