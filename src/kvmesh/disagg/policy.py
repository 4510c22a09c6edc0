"""Conditional disaggregation: where one request's prefill runs. Pure.

A decode worker has allocated the request's blocks (so it knows its prefix-cache hit)
and asks: remote only if the tokens left to compute exceed
``max_local_prefill_length`` (short prefills piggyback on decode steps; a long prefix
hit makes the rest memory-bound) and the global queue holds fewer than
``max_prefill_queue_size`` jobs and, with ``max_prefill_queue_tokens``, fewer tokens to
prefill than that (a long queue means the prefill workers lag behind: better to
prefill here until more join). The queue applies the same bound atomically when the
job is put (:meth:`~kvmesh.disagg.queue.PrefillQueue.offer`): this check only saves
building a job the queue would refuse.
"""

from __future__ import annotations

from typing import Literal

from kvmesh.protocol import DisaggThresholds

__all__ = ["Placement", "needs_queue_check", "place_prefill"]

Placement = Literal["remote", "local", "local_queue_full"]


def needs_queue_check(prompt_len: int, cached_tokens: int, t: DisaggThresholds) -> bool:
    """Whether the prompt is long enough that the queue's depth matters (saves asking)."""
    return t.wants_remote(prompt_len, cached_tokens)


def place_prefill(
    prompt_len: int, cached_tokens: int, queue_depth: int, t: DisaggThresholds, queue_tokens: int = 0
) -> Placement:
    """Where to prefill a prompt of ``prompt_len`` tokens with ``cached_tokens`` already
    cached, the queue holding ``queue_depth`` jobs of ``queue_tokens`` tokens."""
    if not t.wants_remote(prompt_len, cached_tokens):
        return "local"
    if not t.admits(queue_depth, queue_tokens):
        return "local_queue_full"
    return "remote"
