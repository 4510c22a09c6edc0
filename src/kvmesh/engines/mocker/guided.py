"""Structured outputs in the mocker: the deterministic token oracle, kept inside the
request's grammar (pure).

At each position the oracle's own token is kept when the grammar allows it; otherwise
the same position hash picks among the allowed tokens. EOS comes when the grammar
allows it and the oracle's EOS draw says so, or when the grammar allows nothing else;
near ``max_tokens`` the guide's closing path takes over (:class:`~kvmesh.preprocess.guided.Guide`).
A migrated request's guide has consumed the tokens already streamed, so the stream
goes on where it stopped and still ends inside the grammar.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.preprocess.guided import Guide

__all__ = ["guided_token"]

_MASK32 = (1 << 32) - 1


def guided_token(guide: Guide, h: int, vocab: Sequence[int], remaining: int, eos_drawn: bool) -> int | None:
    """The token at a position with hash ``h`` (None: EOS), consumed by ``guide``.

    ``vocab``: the oracle's drawable ids; ``remaining``: tokens of budget left;
    ``eos_drawn``: the oracle would end the stream here."""
    mask = guide.allowed(remaining)
    eos = guide.eos
    others = int(mask.sum()) - int(mask[eos])
    if mask[eos] and (eos_drawn or others == 0):
        guide.consume(eos)
        return None
    token = vocab[(h & _MASK32) % len(vocab)]
    if token == eos or not mask[token]:
        allowed = np.flatnonzero(mask)
        allowed = allowed[allowed != eos]
        token = int(allowed[(h & _MASK32) % len(allowed)])
    token = guide.settle(token, remaining)
    if token == eos:
        guide.consume(eos)
        return None
    guide.consume(token)
    return token
