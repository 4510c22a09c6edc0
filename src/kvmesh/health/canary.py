"""Canaries: known prompts with known greedy answers, and how to judge a reply.

A canary set is a JSON file (a :class:`CanarySet`) recorded once against a known-good
worker (``kvmesh canary record``, via :func:`record_canaries`) and replayed against
every worker at the check interval with temperature 0. A reply passes when, in order:

1. the worker answered at all (``output_tokens is None`` is a ``timeout``);
2. the greedy tokens equal ``expected_token_ids`` exactly (else ``wrong_tokens``):
   this catches crashes into garbage and gross silent data corruption;
3. when the canary has ``top_logprob_range`` and the reply carries log-probabilities,
   the top log-probability of the first generated token lies in that range (else
   ``logit_out_of_range``): subtle corruption flattens the distribution while the
   argmax, and so the token, is still right;
4. the latency is at most ``spike_factor`` (3) × the worker's EMA baseline (else
   ``latency_spike``): thermal throttling, a failing link. The frontend's monitor
   passes no baseline here: it judges speed against the worker's load and its peers
   (:class:`~kvmesh.health.state.FleetLatency`), not against an idle baseline alone.

Without a canary file the answers are learnt from the fleet, but never from one worker
alone (:class:`CanaryVotes`): each worker's greedy answers are a vote, and a set is
adopted once ``quorum`` (3) workers gave the same answers (the same tokens, top
log-probabilities within half the recorded margin). A fleet smaller than the quorum
needs all its live workers to agree; once every live worker has answered, a strict
majority of at least two is enough. So one corrupt worker can never poison the
expected answers, whichever worker is checked first.

:func:`evaluate` and :class:`CanaryVotes` are pure; :func:`load_canaries` /
:func:`save_canaries` are the only functions here that touch the file system.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from kvmesh.health.state import CheckKind, CheckResult

__all__ = [
    "Canary",
    "CanarySet",
    "CanaryOutput",
    "CanaryVotes",
    "DEFAULT_QUORUM",
    "DEFAULT_SPIKE_FACTOR",
    "DEFAULT_LOGPROB_MARGIN",
    "evaluate",
    "record_canaries",
    "encode_canaries",
    "decode_canaries",
    "load_canaries",
    "save_canaries",
]

DEFAULT_SPIKE_FACTOR = 3.0
# Half-width of a recorded top-logprob range (nats). kvmesh's choice: wide enough for
# numeric noise across GPUs and batch shapes, narrow enough to see a flattened softmax.
DEFAULT_LOGPROB_MARGIN = 1.0
CANARY_FORMAT_VERSION = 1
DEFAULT_QUORUM = 3  # workers that must agree before their answers become the canaries


class Canary(msgspec.Struct, frozen=True, omit_defaults=True):
    """One known prompt and its expected greedy continuation.

    ``top_logprob_range``: ``(lo, hi)`` bounds of the first generated token's top
    log-probability; ``None`` checks tokens only.
    """

    prompt_token_ids: list[int]
    expected_token_ids: list[int]
    top_logprob_range: tuple[float, float] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a canary needs a non-empty prompt")
        if not self.expected_token_ids:
            raise ValueError("a canary needs at least one expected token")
        rng = self.top_logprob_range
        if rng is not None and not (math.isfinite(rng[0]) and math.isfinite(rng[1]) and rng[0] <= rng[1]):
            raise ValueError(f"top_logprob_range must be finite (lo, hi) with lo <= hi, got {rng!r}")

    @property
    def max_tokens(self) -> int:
        """How many tokens to request (temperature 0, ``ignore_eos``)."""
        return len(self.expected_token_ids)


class CanarySet(msgspec.Struct, omit_defaults=True):
    """The file format: a version, the model the answers belong to, the canaries."""

    canaries: list[Canary]
    model: str = ""
    version: int = CANARY_FORMAT_VERSION


class CanaryOutput(msgspec.Struct, frozen=True):
    """What a known-good worker answered to one prompt, for :func:`record_canaries`.

    ``top_logprobs``: per generated token, its top log-probability (or ``None``).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    top_logprobs: list[float] | None = None
    name: str = ""


def evaluate(
    canary: Canary,
    output_tokens: Sequence[int] | None,
    top_logprobs: Sequence[float] | None,
    latency_s: float,
    baseline: float | None,
    *,
    spike_factor: float = DEFAULT_SPIKE_FACTOR,
) -> CheckResult:
    """Judge one canary reply; see the module docstring for the order of checks.

    ``baseline``: the worker's EMA latency in seconds (``None`` or 0: no spike check).
    """
    if output_tokens is None:
        return CheckResult(CheckKind.TIMEOUT, latency_s, "no response")
    if list(output_tokens) != canary.expected_token_ids:
        detail = f"expected {canary.expected_token_ids}, got {list(output_tokens)}"
        return CheckResult(CheckKind.WRONG_TOKENS, latency_s, detail)
    rng = canary.top_logprob_range
    if rng is not None and top_logprobs:
        top = top_logprobs[0]
        if not (rng[0] <= top <= rng[1]):
            detail = f"top logprob {top:.3f} outside [{rng[0]}, {rng[1]}]"
            return CheckResult(CheckKind.LOGIT_OUT_OF_RANGE, latency_s, detail)
    if baseline is not None and baseline > 0 and latency_s > spike_factor * baseline:
        detail = f"latency {latency_s:.4f}s > {spike_factor}x baseline {baseline:.4f}s"
        return CheckResult(CheckKind.LATENCY_SPIKE, latency_s, detail)
    return CheckResult(CheckKind.OK, latency_s)


def record_canaries(
    outputs: Iterable[CanaryOutput], *, model: str = "", logprob_margin: float = DEFAULT_LOGPROB_MARGIN
) -> CanarySet:
    """Turn known-good greedy outputs into a canary set.

    A top-logprob range ``[top - margin, min(0, top + margin)]`` is recorded for the
    first token when the output has log-probabilities.
    """
    if not (math.isfinite(logprob_margin) and logprob_margin >= 0):
        raise ValueError(f"logprob_margin must be a finite number >= 0, got {logprob_margin}")
    canaries = [_canary_from(out, logprob_margin) for out in outputs]
    return CanarySet(canaries=canaries, model=model)


def _canary_from(out: CanaryOutput, margin: float) -> Canary:
    rng = None
    if out.top_logprobs:
        top = out.top_logprobs[0]
        rng = (top - margin, min(0.0, top + margin))
    return Canary(list(out.prompt_token_ids), list(out.token_ids), rng, out.name)


def agree(a: Sequence[CanaryOutput], b: Sequence[CanaryOutput], tolerance: float) -> bool:
    """Whether two workers' answers to the same prompts are the same: equal tokens, and
    first top log-probabilities (when both have them) within ``tolerance``."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.prompt_token_ids != y.prompt_token_ids or x.token_ids != y.token_ids:
            return False
        if x.top_logprobs and y.top_logprobs and abs(x.top_logprobs[0] - y.top_logprobs[0]) > tolerance:
            return False
    return True


class CanaryVotes:
    """Answers offered by distinct workers until enough agree (see the module
    docstring). Pure: the monitor offers each worker's answers with the live fleet size."""

    def __init__(
        self, model: str = "", quorum: int = DEFAULT_QUORUM, logprob_margin: float = DEFAULT_LOGPROB_MARGIN
    ) -> None:
        if quorum < 1:
            raise ValueError(f"canary quorum must be >= 1, got {quorum}")
        self.model = model
        self.quorum = quorum
        self.logprob_margin = logprob_margin
        self.votes: dict[int, list[CanaryOutput]] = {}  # worker -> its answers (its latest)

    def offer(self, worker_id: int, outputs: Sequence[CanaryOutput], live_workers: int) -> CanarySet | None:
        """Count ``worker_id``'s answers; the canary set once they are agreed, else None.
        ``live_workers``: how many workers the fleet has now (the quorum's cap)."""
        self.votes[worker_id] = list(outputs)
        backers = self._backers(self.votes[worker_id])
        need = max(1, min(self.quorum, live_workers))
        everyone = len(self.votes) >= max(live_workers, 1)
        if len(backers) >= need or (everyone and len(backers) >= 2 and 2 * len(backers) > len(self.votes)):
            first = min(backers)
            return record_canaries(self.votes[first], model=self.model, logprob_margin=self.logprob_margin)
        return None

    def disagreeing(self) -> int:
        """How many distinct answers the votes hold (1: all agree so far)."""
        groups: list[list[CanaryOutput]] = []
        for outputs in self.votes.values():
            if not any(agree(g, outputs, self.logprob_margin / 2) for g in groups):
                groups.append(outputs)
        return len(groups)

    def _backers(self, outputs: Sequence[CanaryOutput]) -> list[int]:
        tol = self.logprob_margin / 2
        return [w for w, other in self.votes.items() if agree(outputs, other, tol)]


def encode_canaries(canaries: CanarySet) -> bytes:
    return msgspec.json.format(msgspec.json.encode(canaries), indent=2)


def decode_canaries(data: bytes | str) -> CanarySet:
    """Parse and validate a canary file's content; raises ``ValueError`` when invalid."""
    try:
        canaries = msgspec.json.decode(data, type=CanarySet)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise ValueError(f"invalid canary set: {exc}") from exc
    if canaries.version != CANARY_FORMAT_VERSION:
        raise ValueError(f"unsupported canary set version {canaries.version}")
    return canaries


def load_canaries(path: str | os.PathLike[str]) -> CanarySet:
    return decode_canaries(Path(path).read_bytes())


def save_canaries(path: str | os.PathLike[str], canaries: CanarySet) -> None:
    Path(path).write_bytes(encode_canaries(canaries) + b"\n")
