"""Each engine's settings, declared once (:func:`kvmesh.settings.setting`): the flags,
``KVMESH_*`` variables and config-file keys of ``--engine mocker | hf | vllm`` are
derived from these classes, and a worker receives the resolved object.

Light on purpose (no torch, no vLLM, no engine code): the CLI imports it to build its
parser. :mod:`kvmesh.engines.registry` pairs each class with its engine's factory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvmesh.settings import EngineSettings, check, non_negative, positive, setting, within

__all__ = ["MockerSettings", "HfSettings", "VllmSettings", "options_from"]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

O = TypeVar("O", bound="DataclassInstance")


def options_from(options: type[O], *sources: DataclassInstance, **given: Any) -> O:
    """An engine's ``options`` object from dataclass ``sources`` (resolved settings, the
    worker's :class:`~kvmesh.engines.registry.EngineSpec`): each option takes the value
    of the same-named field of the last source that has one that is not None, ``given``
    wins over all; an option no source names keeps its default, which for a declared
    setting is the declaration's (the CLI's)."""
    names = {f.name for f in dataclasses.fields(options)}
    values: dict[str, Any] = {}
    for source in sources:
        for f in dataclasses.fields(source):
            value = getattr(source, f.name)
            if f.name in names and value is not None:
                values[f.name] = value
    values.update(given)
    return options(**values)


def _fault_ok(value: object) -> str | None:
    if not value:
        return None
    from kvmesh.engines.mocker.fault_spec import FaultSpec  # light: no engine code

    try:
        FaultSpec.parse(str(value))
    except (ValueError, TypeError) as exc:
        return f"is not a fault spec ({exc})"
    return None


_MOCKER = "mocker engine"


@dataclass(frozen=True)
class MockerSettings(EngineSettings):
    """``--engine mocker`` (the block size is the worker's ``--block-size``)."""

    speedup: float = setting(
        1.0, "divide modelled step times by this (1e9: as fast as possible)", env="KVMESH_MOCKER_SPEEDUP",
        check=positive, group=_MOCKER,
    )  # fmt: skip
    num_blocks: int = setting(8192, "KV blocks per worker", env="KVMESH_MOCKER_NUM_BLOCKS", check=positive, group=_MOCKER)
    max_num_seqs: int = setting(
        256, "max running sequences per worker", env="KVMESH_MOCKER_MAX_NUM_SEQS", check=positive, group=_MOCKER
    )
    max_num_batched_tokens: int = setting(
        8192, "token budget per step", env="KVMESH_MOCKER_MAX_NUM_BATCHED_TOKENS", check=positive, group=_MOCKER
    )
    fault: str = setting(
        "", "inject a fault: crash | hang | slow:factor=K | corrupt | start [,after_tokens=N,probability=P]",
        env="KVMESH_MOCKER_FAULT", check=_fault_ok, group=_MOCKER,
    )  # fmt: skip
    eos_probability: float = setting(
        0.0, "chance of a natural end-of-sequence per generated token (0: every request gets max_tokens)",
        env="KVMESH_MOCKER_EOS_PROBABILITY", check=within(0.0, 1.0), group=_MOCKER,
    )  # fmt: skip
    # chunked prefill beside short prompts (vLLM V1's names; kvmesh.engines.batching.scheduler)
    long_prefill_token_threshold: int = setting(
        0, "a prefill with more tokens left than this is long: its chunk is capped at it while other prefills "
        "share the pass (0: off, vLLM's default with one partial prefill)",
        env="KVMESH_MOCKER_LONG_PREFILL_TOKEN_THRESHOLD", check=non_negative, group=_MOCKER,
    )  # fmt: skip
    max_long_partial_prefills: int = setting(
        1, "long prompts prefilling at once (shorter ones are admitted past the rest)",
        env="KVMESH_MOCKER_MAX_LONG_PARTIAL_PREFILLS", check=positive, group=_MOCKER,
    )  # fmt: skip
    max_num_partial_prefills: int = setting(
        0, "prefills in one pass (0: no cap)", env="KVMESH_MOCKER_MAX_NUM_PARTIAL_PREFILLS", check=non_negative,
        group=_MOCKER,
    )  # fmt: skip
    # KV transfer (disaggregation, migration, kvmesh replay's arms): a transfer of n blocks
    # takes n × block size × kv_bytes_per_token ÷ kv_bandwidth seconds (÷ speedup)
    kv_bytes_per_token: int = setting(
        4096, "modelled KV bytes per token (4096: kvmesh-tiny in fp32)", env="KVMESH_MOCKER_KV_BYTES_PER_TOKEN",
        check=positive, group=_MOCKER,
    )  # fmt: skip
    kv_bandwidth: float = setting(
        10e9, "modelled KV-transfer link, bytes/s", env="KVMESH_MOCKER_KV_BANDWIDTH", check=positive, group=_MOCKER
    )
    lora_load_ms: float = setting(
        50.0, "modelled time to load a LoRA adapter (÷ speedup; the router's own estimate is --lora-load-ms)",
        flag="--mocker-lora-load-ms", env="KVMESH_MOCKER_LORA_LOAD_MS",
        check=non_negative, group=_MOCKER,
    )  # fmt: skip
    # KV tiers below the device pool (engines/batching/tiers.py): evicted blocks are written
    # down to host memory, then disk; a prefix hit there is brought back at the tier's bandwidth
    host_kv_blocks: int = setting(
        0, "host-memory KV tier (G2), in blocks (0: none)", env="KVMESH_MOCKER_HOST_KV_BLOCKS", check=non_negative,
        group=_MOCKER,
    )  # fmt: skip
    disk_kv_blocks: int = setting(
        0, "local-disk KV tier (G3), in blocks (0: none)", env="KVMESH_MOCKER_DISK_KV_BLOCKS", check=non_negative,
        group=_MOCKER,
    )  # fmt: skip
    host_kv_gbps: float = setting(
        25.0, "modelled host-to-device KV bandwidth, GB/s", env="KVMESH_MOCKER_HOST_KV_GBPS", check=positive,
        group=_MOCKER,
    )  # fmt: skip
    disk_kv_gbps: float = setting(
        3.0, "modelled disk-to-device KV bandwidth, GB/s", env="KVMESH_MOCKER_DISK_KV_GBPS", check=positive,
        group=_MOCKER,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check(self)


_HF = "hf engine (PyTorch on the CPU or a CUDA GPU)"

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _device_ok(value: object) -> str | None:
    text = str(value)
    base, _, index = text.partition(":")
    if base in _DEVICES and (not index or (base == "cuda" and index.isdigit())):
        return None
    return "must be auto, cpu, cuda or cuda:N"


def _dtype_ok(value: object) -> str | None:
    return None if value in _DTYPES else f"must be one of {', '.join(_DTYPES)}"


# the shapes of kvmesh.engines.hf.shapes (named here: this module imports no torch)
RANDOM_SHAPES = ("llama-1b", "llama-8b")


def _shape_ok(value: object) -> str | None:
    return None if not value or value in RANDOM_SHAPES else f"must be one of {', '.join(RANDOM_SHAPES)}"


@dataclass(frozen=True)
class HfSettings(EngineSettings):
    """``--engine hf`` (the block size is the worker's ``--block-size``)."""

    num_blocks: int | None = setting(
        None, "KV blocks (default: as many as fit in --hf-kv-cache-mb)", flag="--hf-num-blocks",
        env="KVMESH_HF_NUM_BLOCKS", check=positive, group=_HF,
    )  # fmt: skip
    kv_cache_mb: int = setting(256, "KV cache size in MiB", flag="--hf-kv-cache-mb", env="KVMESH_HF_KV_CACHE_MB",
                               check=positive, group=_HF)  # fmt: skip
    max_num_seqs: int = setting(64, "max running sequences", flag="--hf-max-num-seqs", env="KVMESH_HF_MAX_NUM_SEQS",
                                check=positive, group=_HF)  # fmt: skip
    max_num_batched_tokens: int = setting(
        512, "tokens per forward pass (long prompts prefill in chunks of it)", flag="--hf-max-num-batched-tokens",
        env="KVMESH_HF_MAX_NUM_BATCHED_TOKENS", check=positive, group=_HF,
    )  # fmt: skip
    threads: int = setting(0, "torch threads (0: the CPUs this process may use: affinity and cgroup quota)", flag="--hf-threads", env="KVMESH_HF_THREADS",
                           check=non_negative, group=_HF)  # fmt: skip
    seed: int | None = setting(None, "sampler seed of requests without one", flag="--hf-seed", env="KVMESH_HF_SEED", group=_HF)
    long_prefill_token_threshold: int = setting(
        0, "a prefill with more tokens left than this is long: its chunk is capped at it while other prefills "
        "share the pass (0: off)", flag="--hf-long-prefill-token-threshold",
        env="KVMESH_HF_LONG_PREFILL_TOKEN_THRESHOLD", check=non_negative, group=_HF,
    )  # fmt: skip
    max_long_partial_prefills: int = setting(
        1, "long prompts prefilling at once", flag="--hf-max-long-partial-prefills",
        env="KVMESH_HF_MAX_LONG_PARTIAL_PREFILLS", check=positive, group=_HF,
    )  # fmt: skip
    max_num_partial_prefills: int = setting(
        0, "prefills in one pass (0: no cap)", flag="--hf-max-num-partial-prefills",
        env="KVMESH_HF_MAX_NUM_PARTIAL_PREFILLS", check=non_negative, group=_HF,
    )  # fmt: skip

    device: str = setting(
        "auto", "where the model runs: cpu, cuda, cuda:N (auto: cuda when a GPU is visible)", flag="--device",
        env="KVMESH_HF_DEVICE", check=_device_ok, group=_HF,
    )  # fmt: skip
    dtype: str = setting(
        "auto", "weights and KV dtype: bfloat16, float16, float32 (auto: float32 on the CPU, the model's 16-bit "
        "dtype on a GPU, else bfloat16)", flag="--dtype", env="KVMESH_HF_DTYPE", check=_dtype_ok, group=_HF,
    )  # fmt: skip
    gpu_memory_fraction: float = setting(
        0.9, "GPU: the share of the card's memory this worker may fill (weights, KV pool, activations); the KV "
        "pool gets what is left of it after loading (two workers on one card: 0.45 each)",
        flag="--gpu-memory-fraction", env="KVMESH_HF_GPU_MEMORY_FRACTION", check=within(0.01, 1.0), group=_HF,
    )  # fmt: skip
    random_weights: str = setting(
        "", "synthetic weights in a known shape (llama-1b, llama-8b) for benchmarks without the model files; "
        "the model folder gives only the tokenizer (the text is noise)", flag="--random-weights",
        env="KVMESH_HF_RANDOM_WEIGHTS", check=_shape_ok, group=_HF,
    )  # fmt: skip
    enforce_eager: bool = setting(
        False, "GPU: no CUDA graphs (decode passes are captured per batch size at start otherwise)",
        flag="--enforce-eager", env="KVMESH_HF_ENFORCE_EAGER", group=_HF,
    )  # fmt: skip
    max_lora_rank: int = setting(
        16, "the highest LoRA rank an adapter may have (sizes the adapter slots' weights)", flag="--max-lora-rank",
        env="KVMESH_HF_MAX_LORA_RANK", check=positive, group=_HF,
    )  # fmt: skip
    # KV tiers below the device pool (engines/hf/tiers.py): evicted blocks' K/V kept in host
    # memory, then a memory-mapped file, and copied back for a prefix hit
    host_kv_blocks: int = setting(
        0, "host-memory KV tier (G2), in blocks (0: none; pinned when on a GPU)", flag="--hf-host-kv-blocks",
        env="KVMESH_HF_HOST_KV_BLOCKS", check=non_negative, group=_HF,
    )  # fmt: skip
    disk_kv_blocks: int = setting(
        0, "local-disk KV tier (G3), in blocks (0: none; needs --hf-disk-kv-path)", flag="--hf-disk-kv-blocks",
        env="KVMESH_HF_DISK_KV_BLOCKS", check=non_negative, group=_HF,
    )  # fmt: skip
    disk_kv_path: str = setting(
        "", "folder for the disk KV tier's memory-mapped file (created; the file is unlinked once mapped)",
        flag="--hf-disk-kv-path", env="KVMESH_HF_DISK_KV_PATH", group=_HF, metavar="DIR",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check(self)


_VLLM = "vllm engine"


def _fraction(value: object) -> str | None:
    ok = isinstance(value, float) and 0 < value <= 1
    return None if ok else "must be in (0, 1]"


@dataclass(frozen=True)
class VllmSettings(EngineSettings):
    """``--engine vllm``: what the worker tells vLLM (see VllmOptions)."""

    block_size: int = setting(
        32, "KV block size (vLLM's CPU attention needs a multiple of 32)", flag="--vllm-block-size",
        env="KVMESH_VLLM_BLOCK_SIZE", check=positive, group=_VLLM,
    )  # fmt: skip
    max_model_len: int | None = setting(None, "context length (default: the model's)", flag="--vllm-max-model-len",
                                        env="KVMESH_VLLM_MAX_MODEL_LEN", check=positive, group=_VLLM)  # fmt: skip
    max_num_seqs: int = setting(64, "max running sequences", flag="--vllm-max-num-seqs", env="KVMESH_VLLM_MAX_NUM_SEQS",
                                check=positive, group=_VLLM)  # fmt: skip
    max_num_batched_tokens: int | None = setting(
        None, "tokens per step", flag="--vllm-max-num-batched-tokens", env="KVMESH_VLLM_MAX_NUM_BATCHED_TOKENS",
        check=positive, group=_VLLM,
    )  # fmt: skip
    dtype: str = setting("auto", "weights dtype", flag="--vllm-dtype", env="KVMESH_VLLM_DTYPE", group=_VLLM)
    seed: int = setting(0, "vLLM's seed", flag="--vllm-seed", env="KVMESH_VLLM_SEED", group=_VLLM)
    enforce_eager: bool = setting(False, "no torch.compile (a much faster start on a CPU)", flag="--vllm-enforce-eager",
                                  env="KVMESH_VLLM_ENFORCE_EAGER", group=_VLLM)  # fmt: skip
    enable_prefix_caching: bool = setting(
        True, "vLLM's prefix cache", flag="--vllm-enable-prefix-caching", env="KVMESH_VLLM_ENABLE_PREFIX_CACHING",
        group=_VLLM, hidden=True,  # on by default; a store_true flag cannot turn it off (use the variable)
    )  # fmt: skip
    kv_cache_gb: int | None = setting(None, "CPU KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE, an integer to vLLM)",
                                      flag="--vllm-kv-cache-gb",
                                        env="KVMESH_VLLM_KV_CACHE_GB", check=positive, group=_VLLM)  # fmt: skip
    gpu_memory_utilization: float | None = setting(
        None, "fraction of GPU memory vLLM may use", flag="--vllm-gpu-memory-utilization",
        env="KVMESH_VLLM_GPU_MEMORY_UTILIZATION", check=_fraction, group=_VLLM,
    )  # fmt: skip
    kv_transfer_config: Mapping[str, object] | None = setting(
        None, "vLLM's KVTransferConfig (JSON object)", flag="--vllm-kv-transfer-config",
        env="KVMESH_VLLM_KV_TRANSFER_CONFIG", group=_VLLM, metavar="JSON",
    )  # fmt: skip
    engine_args: Mapping[str, object] | None = setting(
        None, "further AsyncEngineArgs fields (JSON object)", flag="--vllm-engine-args",
        env="KVMESH_VLLM_ENGINE_ARGS", group=_VLLM, metavar="JSON",
    )  # fmt: skip
    def __post_init__(self) -> None:
        check(self)
