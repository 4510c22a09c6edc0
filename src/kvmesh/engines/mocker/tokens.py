"""Deterministic output tokens: what the mocker "samples" at each position.

Everything here is a pure function of ``(key, position)``:

* ``key`` is ``sampling.seed`` when the request sets one, else the xxh3-64 of the
  prompt's token ids (little-endian u32);
* ``position`` is the absolute index in the sequence: ``len(prompt) + i`` for the
  i-th generated token.

One 64-bit hash per position feeds both decisions: the low 32 bits pick the token
from the drawable vocabulary, the high 32 bits decide a natural EOS (under
``eos_rate``). Because nothing depends on the path taken to reach a position, the same
request gives the same tokens on any worker, across preemption and restarts, and a
request re-issued as ``prompt + first k tokens`` with the same seed continues the
identical stream (request migration relies on this).

Log-probabilities are drawn the same way (:func:`logprob_at`): the chosen token's
log-probability at a position is a function of ``(key, position)`` alone, from a second
hash, in ``[TOP_LOGPROB_MIN, TOP_LOGPROB_MAX]`` (a confident model's range), and the
alternatives (:func:`top_alternatives`) follow it, each lower than the one before. So a
canary can record and check the top log-probability of a mocker worker for real, and a
``corrupt`` fault can shift it (:mod:`.faults`) without touching the token.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from functools import lru_cache

import xxhash

from kvmesh.protocol import PreprocessedRequest

__all__ = [
    "TOKEN_SEED",
    "request_key",
    "position_hash",
    "drawable_vocab",
    "excluded_ids",
    "token_at",
    "eos_threshold",
    "is_eos",
    "TOP_LOGPROB_MIN",
    "TOP_LOGPROB_MAX",
    "logprob_at",
    "top_alternatives",
]

TOKEN_SEED = 0x6D6F636B  # "mock"; any fixed value, distinct from the block-hash seed
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_PAIR = struct.Struct("<QQ").pack
_xxh3 = xxhash.xxh3_64_intdigest
LOGPROB_SEED = 0x6C6F6770  # "logp": the log-probability hash, independent of the token's
TOP_LOGPROB_MIN = -1.5
TOP_LOGPROB_MAX = -0.05


def request_key(request: PreprocessedRequest) -> int:
    """The stream key: the request's seed if set, else a hash of its (original) prompt,
    so a request re-issued after a migration continues the same stream; mixed with the
    LoRA adapter's name when the request names one."""
    seed = request.sampling.seed
    if seed is not None:
        key = seed & _MASK64
    else:
        prompt = request.token_ids
        if request.original_prompt_len is not None:
            prompt = prompt[: request.original_prompt_len]
        arr = array("I", prompt)
        if sys.byteorder == "big":  # pragma: no cover
            arr.byteswap()
        key = _xxh3(arr.tobytes(), TOKEN_SEED)
    if request.adapter is not None:  # a LoRA adapter is another model: another stream
        key = _xxh3(_PAIR(key, _xxh3(request.adapter.encode(), TOKEN_SEED)), TOKEN_SEED)
    return key


def position_hash(key: int, position: int) -> int:
    """The 64-bit hash every decision at ``position`` is drawn from."""
    return _xxh3(_PAIR(key, position), TOKEN_SEED)


# position_hash's and token_at's parts, for the one loop that inlines them (the mocker's
# step draws a token per running request): xxh3(PAIR(key, position), TOKEN_SEED), & MASK32
PAIR = _PAIR
XXH3 = _xxh3
MASK32 = _MASK32


@lru_cache(maxsize=64)
def drawable_vocab(vocab_size: int, excluded: frozenset[int]) -> tuple[int, ...]:
    """Token ids in ``[0, vocab_size)`` minus ``excluded``, ascending."""
    vocab = tuple(t for t in range(vocab_size) if t not in excluded)
    if not vocab:
        raise ValueError("every token of the vocabulary is excluded")
    return vocab


def token_at(h: int, vocab: Sequence[int]) -> int:
    """The token a position hash ``h`` picks from ``vocab``."""
    return vocab[(h & _MASK32) % len(vocab)]


def eos_threshold(eos_rate: float) -> int:
    """``is_eos(h, eos_threshold(r))`` holds for a fraction ``r`` of hashes."""
    return min(1 << 32, int(eos_rate * (1 << 32)))


def is_eos(h: int, threshold: int) -> bool:
    return (h >> 32) < threshold


def excluded_ids(*groups: Iterable[int]) -> frozenset[int]:
    """Union of id groups (EOS ids, special ids) that may never be drawn."""
    out: set[int] = set()
    for group in groups:
        out.update(group)
    return frozenset(out)


def logprob_at(key: int, position: int) -> float:
    """The chosen token's log-probability at ``position`` of stream ``key``, in
    ``[TOP_LOGPROB_MIN, TOP_LOGPROB_MAX]``; the same on every worker."""
    u = _xxh3(_PAIR(key, position), LOGPROB_SEED) / float(_MASK64)
    return TOP_LOGPROB_MIN + (TOP_LOGPROB_MAX - TOP_LOGPROB_MIN) * u


def top_alternatives(token: int, logprob: float, n: int, vocab_size: int) -> list[tuple[int, float]]:
    """``n`` alternatives, the chosen token first: ``token`` with ``logprob``, then the
    next ids (mod ``vocab_size``), each one nat less likely than the one before."""
    return [((token + i) % max(vocab_size, 1), logprob - i) for i in range(max(n, 1))]
