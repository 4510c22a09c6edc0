"""The options every batching engine has (mocker, hf): what the scheduler's limits and
the worker's card are built from. An engine's options subclass this and declare its
own defaults for the pool size and budgets, taken from its settings declaration
(:mod:`kvmesh.engines.settings`), so an engine built in code starts from the CLI's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config import WorkerConfig
from kvmesh.engines.lora import parse_lora_flags
from kvmesh.protocol import MAX_ADAPTERS
from kvmesh.settings import non_negative, positive, require, within

__all__ = ["BatchingOptions", "check_positive_ints"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchingOptions:
    """Keyword-only, so a subclass may put its own required field first."""

    served_model_name: str | None = None
    block_size: int = WorkerConfig.block_size  # the worker's --block-size
    max_num_seqs: int
    max_num_batched_tokens: int
    worker_id: int = 0
    enable_prefix_caching: bool = True
    event_ring_capacity: int = 1024
    # chunked prefill beside short prompts (vLLM's knobs; the scheduler's limits): a
    # prefill with more than long_prefill_token_threshold tokens left is long (0: none is)
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1
    max_num_partial_prefills: int = 0  # 0: no cap on the prefills of one pass
    # LoRA adapters (issue 30): NAME=PATH loaded at start, and how many may be resident
    loras: tuple[str, ...] = WorkerConfig.lora
    max_loras: int = WorkerConfig.max_loras

    def __post_init__(self) -> None:
        check_positive_ints(self, "block_size", "max_num_seqs", "max_num_batched_tokens", "event_ring_capacity")
        if self.worker_id < 0:
            raise ValueError(f"worker_id must be >= 0, got {self.worker_id}")
        require("long_prefill_token_threshold", self.long_prefill_token_threshold, non_negative)
        require("max_num_partial_prefills", self.max_num_partial_prefills, non_negative)
        require("max_long_partial_prefills", self.max_long_partial_prefills, positive)
        require("max_loras", self.max_loras, within(0, MAX_ADAPTERS))
        if parse_lora_flags(self.loras) and self.max_loras == 0:
            raise ValueError("--lora needs --max-loras above 0")


def check_positive_ints(options: object, *names: str) -> None:
    """``ValueError`` naming the first of ``names`` that is not a positive integer."""
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
