"""Mooncake-format traces: loading, validation, and synthesis of token ids.

A trace is JSON Lines, one request per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival in milliseconds; ``hash_ids`` name the prompt's blocks of
:data:`TRACE_BLOCK_TOKENS` tokens, chained (an id stands for its block and everything
before it), so two requests share KV for their common leading run of ids.

Synthesis (:class:`TokenSynth`): each hash id maps to :data:`TRACE_BLOCK_TOKENS` token
ids that are a pure function of the id (a Mersenne Twister seeded with the id, reduced
modulo the vocabulary); a prompt is the blocks of its ids concatenated in order and cut
to ``input_length``. Equal ids give equal tokens, so the prompts share exactly the
prefixes the trace says they share, whatever block size the engine hashes with.
"""

from __future__ import annotations

import json
import math
import random
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh.protocol import PreprocessedRequest, StopConditions

__all__ = ["TRACE_BLOCK_TOKENS", "TokenSynth", "TraceError", "TraceRequest", "arrivals", "load_trace"]

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """The trace file is missing, unreadable or malformed; the message is one line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line. ``line`` is its 1-based line number in the file."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(
    path: str | Path,
    *,
    start_ms: float = 0.0,
    duration_ms: float | None = None,
    limit: int | None = None,
) -> list[TraceRequest]:
    """The requests of ``path`` arriving in ``[start_ms, start_ms + duration_ms)``, at
    most ``limit`` of them (the earliest), in arrival order. Raises :class:`TraceError`."""
    if limit is not None and limit <= 0:
        raise TraceError(f"--limit must be positive, got {limit}")
    if duration_ms is not None and duration_ms <= 0:
        raise TraceError(f"--duration-ms must be positive, got {duration_ms}")
    end = math.inf if duration_ms is None else start_ms + duration_ms
    out: list[TraceRequest] = []
    seen = 0
    for req in _read(Path(path)):
        seen += 1
        if start_ms <= req.timestamp_ms < end:
            out.append(req)
    if seen == 0:
        raise TraceError(f"trace {path} has no requests")
    if not out:
        raise TraceError(f"trace {path} has no request in the window [{start_ms:g}, {end:g}) ms")
    out.sort(key=lambda r: r.timestamp_ms)  # stable: equal times keep file order
    return out[:limit] if limit is not None else out


def _read(path: Path) -> Iterator[TraceRequest]:
    try:
        f = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    with f:
        try:
            for n, text in enumerate(f, start=1):
                if text.strip():
                    yield _parse(path, n, text)
        except UnicodeDecodeError:
            raise TraceError(f"trace {path} is not UTF-8 text") from None


def _parse(path: Path, n: int, text: str) -> TraceRequest:
    where = f"{path}:{n}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise TraceError(f"{where}: missing field {key!r}")
    ts, n_in, n_out, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
    if not _is_number(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
    if not _is_int(n_in) or n_in < 1:
        raise TraceError(f"{where}: input_length must be an integer >= 1, got {n_in!r}")
    if not _is_int(n_out) or n_out < 1:
        raise TraceError(f"{where}: output_length must be an integer >= 1, got {n_out!r}")
    if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    if len(ids) * TRACE_BLOCK_TOKENS < n_in:
        need = -(-n_in // TRACE_BLOCK_TOKENS)
        raise TraceError(f"{where}: input_length {n_in} needs {need} hash ids of {TRACE_BLOCK_TOKENS} tokens, got {len(ids)}")
    return TraceRequest(n, float(ts), n_in, n_out, tuple(ids))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class TokenSynth:
    """Token ids for hash ids (see the module docstring); keeps the last
    ``cache_blocks`` blocks it made, since shared prefixes recur."""

    def __init__(self, vocab_size: int, cache_blocks: int = 8192) -> None:
        if not 0 < vocab_size <= 1 << 32:
            raise ValueError(f"vocab_size must be in 1..2**32, got {vocab_size}")
        self.vocab_size = vocab_size
        self._cache: OrderedDict[int, array[int]] = OrderedDict()
        self._cache_blocks = cache_blocks

    def block(self, hash_id: int) -> array[int]:
        """The :data:`TRACE_BLOCK_TOKENS` token ids of ``hash_id`` (an ``array('I')``)."""
        cached = self._cache.get(hash_id)
        if cached is not None:
            self._cache.move_to_end(hash_id)
            return cached
        raw = array("I", random.Random(hash_id).randbytes(4 * TRACE_BLOCK_TOKENS))
        if sys.byteorder == "big":  # pragma: no cover - same tokens on every platform
            raw.byteswap()
        vocab = self.vocab_size
        tokens = array("I", [t % vocab for t in raw])
        self._cache[hash_id] = tokens
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return tokens

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        """The prompt: blocks of ``hash_ids`` in order, cut to ``input_length`` tokens."""
        need = -(-input_length // TRACE_BLOCK_TOKENS)
        out = array("I")
        for h in hash_ids[:need]:
            out.extend(self.block(h))
        return out[:input_length].tolist()

    def request(self, req: TraceRequest, request_id: str) -> PreprocessedRequest:
        """A request of the trace line: its prompt, ``output_length`` tokens, EOS ignored."""
        return PreprocessedRequest(
            request_id=request_id,
            model="mocker",
            token_ids=self.prompt(req.hash_ids, req.input_length),
            stop=StopConditions(max_tokens=req.output_length, ignore_eos=True),
        )


def arrivals(
    trace: Sequence[TraceRequest], synth: TokenSynth, speed: float = 1.0
) -> Iterator[tuple[float, PreprocessedRequest]]:
    """``(arrival_ms, request)`` in order, times relative to the first request and
    divided by ``speed``. Requests are made lazily: a long trace never sits in memory
    as token ids. Request ids are ``r{i}`` (0-based position in ``trace``)."""
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"--speed must be a positive number, got {speed}")
    if not trace:
        return
    t0 = trace[0].timestamp_ms
    for i, req in enumerate(trace):
        yield (req.timestamp_ms - t0) / speed, synth.request(req, f"r{i}")
