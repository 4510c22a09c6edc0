"""Configuration of the mocker engine, and its timing model.

The timing model is two polynomials fitted to a GPU running vLLM (coefficients are
options, highest degree first):

* ``prefill_ms(T) = a·T² + b·T + c`` for ``T`` new (uncached) tokens in one pass;
* ``decode_ms(p) = a·p² + b·p + c`` for a pass with decodes, ``p`` being the KV the
  pass's decodes attend to (their context tokens, a shared prefix once per sequence)
  over the pool's token slots, at most 1: attention reads each sequence's own context,
  and the blocks that prefilling sequences hold cost the decodes nothing (as in
  Dynamo's mocker; before, ``p`` was the fraction of blocks in use).

A pass that has both costs the sum; every duration is divided by ``speedup``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvmesh.engines.batching.options import BatchingOptions, check_positive_ints
from kvmesh.engines.batching.tiers import G2, G3
from kvmesh.engines.mocker.fault_spec import FaultSpec
from kvmesh.engines.settings import MockerSettings, options_from
from kvmesh.settings import non_negative, positive, require, within

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["MockerOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MockerOptions(BatchingOptions):
    """Everything a mocker scheduler and engine need; read-only after construction.
    Keyword-only; the defaults of declared settings are :class:`MockerSettings`'s (the CLI's).

    ``eos_rate`` is the probability, per generated position, of a natural EOS (see
    :mod:`kvmesh.engines.mocker.tokens`; the CLI's ``--eos-probability``). It is 0 by
    default: a request gets the ``max_tokens`` it asked for, as a simulator used for
    capacity tests must; the first token of a completion is never an EOS, so a
    completion is never empty unless ``max_tokens`` is 0. ``speedup`` divides every step time; a huge
    value (``1e9``) runs as fast as the CPU allows. ``load_report_interval_steps``: the
    engine checks whether its load changed (and publishes a report if so) every N steps.
    ``fault``: a fault to inject from the start (see :mod:`.faults`; none by default).
    """

    model: str = "mocker"
    num_blocks: int = MockerSettings.num_blocks
    max_num_seqs: int = MockerSettings.max_num_seqs
    max_num_batched_tokens: int = MockerSettings.max_num_batched_tokens
    speedup: float = MockerSettings.speedup
    vocab_size: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    special_token_ids: tuple[int, ...] = ()
    context_length: int = 2048
    prefill_coeffs: tuple[float, float, float] = (4.21e-7, 1.518e-2, 16.5)
    decode_coeffs: tuple[float, float, float] = (-25.74, 54.01, 5.74)
    eos_rate: float = MockerSettings.eos_probability
    # chunked prefill beside short requests (vLLM V1's knobs; see the batching core):
    # 0: off (a prefill may take the whole budget), as vLLM and Dynamo's mocker do by
    # default: a cap shortens short prompts' TTFT beside a long one but costs every
    # decode in those passes (the trace replay's ITL p99, per-request mean: 53 vs 43 ms)
    long_prefill_token_threshold: int = MockerSettings.long_prefill_token_threshold
    # KV transfer (disaggregation, migration): the modelled size of one token's KV
    # (kvmesh-tiny in fp32: 4 layers × 2 KV heads × 64 dims × K and V × 4 bytes) and the
    # link's bandwidth; a transfer of n blocks takes n·block_size·kv_bytes_per_token ÷
    # kv_bandwidth seconds, divided by speedup.
    kv_bytes_per_token: int = MockerSettings.kv_bytes_per_token
    kv_bandwidth: float = MockerSettings.kv_bandwidth
    lora_load_ms: float = MockerSettings.lora_load_ms  # a LoRA adapter's modelled load time
    # KV tiers (engines/batching/tiers.py): sizes in blocks, and the bandwidths (GB/s) that
    # onboarding a block of block_size · kv_bytes_per_token bytes from them is charged at
    host_kv_blocks: int = MockerSettings.host_kv_blocks
    disk_kv_blocks: int = MockerSettings.disk_kv_blocks
    host_kv_gbps: float = MockerSettings.host_kv_gbps
    disk_kv_gbps: float = MockerSettings.disk_kv_gbps
    load_report_interval_steps: int = 1
    fault: FaultSpec = FaultSpec()

    def __post_init__(self) -> None:
        BatchingOptions.__post_init__(self)  # no zero-argument super() in a slots dataclass
        check_positive_ints(self, "num_blocks", "vocab_size", "context_length", "load_report_interval_steps", "kv_bytes_per_token")
        require("kv_bandwidth", self.kv_bandwidth, positive)
        require("lora_load_ms", self.lora_load_ms, non_negative)
        for name in ("host_kv_gbps", "disk_kv_gbps"):
            require(name, getattr(self, name), positive)
        if self.host_kv_blocks < 0 or self.disk_kv_blocks < 0:
            raise ValueError("host_kv_blocks and disk_kv_blocks must be >= 0")
        if not self.model:
            raise ValueError("model must be a non-empty string")
        require("speedup", self.speedup, positive)
        require("eos_rate (--eos-probability)", self.eos_rate, within(0.0, 1.0))
        for name in ("prefill_coeffs", "decode_coeffs"):
            coeffs = getattr(self, name)
            if len(coeffs) != 3 or not all(math.isfinite(c) for c in coeffs):
                raise ValueError(f"{name} must be three finite numbers (a, b, c), got {coeffs!r}")
        excluded = {t for t in (*self.eos_token_ids, *self.special_token_ids) if 0 <= t < self.vocab_size}
        if len(excluded) >= self.vocab_size:
            raise ValueError("eos_token_ids and special_token_ids leave no token to draw from the vocabulary")

    @classmethod
    def from_settings(cls, settings: MockerSettings, *sources: DataclassInstance, **given: Any) -> MockerOptions:
        """Options from the declared ``--speedup``, ``--num-blocks``, ... settings, the
        fields of the same name of ``sources`` (an :class:`~kvmesh.engines.registry.EngineSpec`)
        and ``given`` (see :func:`~kvmesh.engines.settings.options_from`)."""
        fault = FaultSpec.parse(settings.fault) if settings.fault else FaultSpec()
        return options_from(cls, *sources, settings, **{"eos_rate": settings.eos_probability, "fault": fault, **given})

    @property
    def served_name(self) -> str:
        """The name clients use: ``served_model_name``, or ``model`` when unset."""
        return self.served_model_name or self.model

    @property
    def total_tokens(self) -> int:
        """How many tokens the whole KV pool holds."""
        return self.num_blocks * self.block_size

    def prefill_ms(self, new_tokens: int) -> float:
        """Model time of prefilling ``new_tokens`` uncached tokens in one pass (no speedup)."""
        a, b, c = self.prefill_coeffs
        return max(0.0, (a * new_tokens + b) * new_tokens + c)

    def decode_ms(self, kv_usage: float) -> float:
        """Model time of one decode pass at KV usage fraction ``kv_usage`` (no speedup)."""
        a, b, c = self.decode_coeffs
        return max(0.0, (a * kv_usage + b) * kv_usage + c)

    def remote_prefill_ms(self, new_tokens: int) -> float:
        """Model time of a prefill worker computing ``new_tokens`` alone (speedup applied;
        the engine's step loop takes as long for a job alone, the replay's arms charge this):
        the step physics of an aggregated worker prefilling a prompt with nothing beside
        it, i.e. passes of ``max_num_batched_tokens`` new tokens. (The long-prefill
        threshold only caps a long prompt while other prefills share its passes, which a
        prefill worker running one job at a time never has: chunking by it charged the
        polynomial's constant once per 512 tokens, ~21k tokens/s against ~48k.)"""
        total, left = 0.0, new_tokens
        budget = self.max_num_batched_tokens
        while left > 0:
            chunk = min(left, budget)
            total += self.prefill_ms(chunk)
            left -= chunk
        return total / self.speedup

    @property
    def kv_block_bytes(self) -> int:
        """Modelled bytes of one KV block."""
        return self.block_size * self.kv_bytes_per_token

    def onboard_ms(self, blocks_by_tier: Mapping[int, int]) -> float:
        """Model time of bringing blocks up from G2/G3 (tier → blocks) into the device
        pool, no speedup: each tier's bytes ÷ its bandwidth, one after the other."""
        gbps = {G2: self.host_kv_gbps, G3: self.disk_kv_gbps}
        return sum(n * self.kv_block_bytes / (gbps[t] * 1e6) for t, n in blocks_by_tier.items() if n and t in gbps)

    @property
    def onboard_tiers(self) -> tuple[int, ...]:
        """The lower tiers worth onboarding from: copying a token's KV up takes less
        than prefilling it (the timing model's linear term)."""
        prefill_ms = self.prefill_coeffs[1]
        gbps = {G2: self.host_kv_gbps, G3: self.disk_kv_gbps}
        return tuple(t for t, g in gbps.items() if self.kv_bytes_per_token / (g * 1e6) < prefill_ms)

    def tiered_step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float, onboard_ms: float) -> float:
        """:meth:`step_ms` of a pass whose prefills wait for ``onboard_ms`` of onboarding
        (no speedup): the copies overlap the pass's decode part, which does not need
        them, and delay its prefill part by what is left."""
        decode = self.decode_ms(kv_usage) if decode_seqs > 0 else 0.0
        return self.step_ms(prefill_tokens, decode_seqs, kv_usage) + max(0.0, onboard_ms - decode) / self.speedup

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float:
        """Duration of one pass, speedup applied: the prefill part over all the pass's new
        prefill tokens if it prefills (one forward pass: several prefills share the
        polynomial's constant, as in Dynamo's mocker, whose polynomial model charges the
        batch's total new tokens), plus the decode part if it decodes; 0 for an empty pass."""
        total = 0.0
        if prefill_tokens > 0:
            total += self.prefill_ms(prefill_tokens)
        if decode_seqs > 0:
            total += self.decode_ms(kv_usage)
        return total / self.speedup

