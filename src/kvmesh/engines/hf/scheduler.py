"""The ``hf`` engine's scheduler: the shared batching core
(:mod:`kvmesh.engines.batching.scheduler`) over sequences that carry sampling
parameters. Pure: no torch, no asyncio, no clock.

The engine's step loop calls ``schedule()``, runs the forward pass in a thread (abort,
detach and release may be called meanwhile: blocks of sequences in the pass are freed
only after it), then ``complete(plan, sampled)``. Before ``min_tokens`` tokens are out
the sampler bans EOS and stop ids (:meth:`Seq.banned`), so they cannot end a stream
early.
"""

from __future__ import annotations

from typing import Any

from kvmesh.engines.batching.scheduler import Finished, Plan, SchedulerLimits, State
from kvmesh.engines.batching.scheduler import Scheduler as BatchScheduler
from kvmesh.engines.batching.scheduler import Seq as BatchSeq
from kvmesh.engines.hf.sampling import SampleParams

__all__ = ["Scheduler", "SchedulerLimits", "Seq", "State", "Plan", "Finished"]


class Seq(BatchSeq):
    """A request with the sampling parameters its rows of the forward pass use."""

    __slots__ = ("params", "lora_slot")

    def __init__(self, request_id: str, tokens: list[int], params: SampleParams, **limits: Any) -> None:
        """``limits``: the keyword arguments of :class:`~kvmesh.engines.batching.scheduler.Seq`
        (``max_tokens``, ``min_tokens``, ``ignore_eos``, ``eos_ids``, ``stop_ids``,
        ``rank``, ``prefill_upto``, ``salt``, ``adapter``)."""
        super().__init__(request_id, tokens, **limits)
        self.params = params
        self.lora_slot = 0  # the LoRA adapter slot of its rows (0: the base model)


class Scheduler(BatchScheduler[Seq]):
    """One hf engine's queues and KV block pool (the shared core, typed for :class:`Seq`)."""
