"""The few vLLM names the engine uses. Importing this module imports vLLM (seconds, and
only where vLLM is installed), so ``engine.py`` imports it on first use."""

from __future__ import annotations

from typing import Any

from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import GracefulHTTPError, VLLMClientError

try:  # a rendered token input skips vLLM's raw-prompt path (0.32 and later)
    from vllm.inputs import tokens_input as prompt
except ImportError:
    from vllm.inputs import TokensPrompt

    def prompt(ids: list[int]) -> Any:
        return TokensPrompt(prompt_token_ids=ids)


from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

__all__ = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "EngineDeadError",
    "GracefulHTTPError",
    "KVEventsConfig",
    "KVTransferConfig",
    "LoRARequest",
    "RequestOutputKind",
    "SamplingParams",
    "StatLoggerBase",
    "StructuredOutputsParams",
    "VLLMClientError",
    "prompt",
]
