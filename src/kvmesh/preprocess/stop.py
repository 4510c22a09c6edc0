"""Stop strings over streamed text.

The text arrives in pieces (one per detokenizer step) and a stop string may span
several pieces, so the matcher holds back any tail that could be the start of a
stop string until the next piece decides it.

Which stop wins does not depend on how the text was cut into pieces: it is the stop
string whose first occurrence *ends* earliest in the stream (that is the one a
character-by-character reader meets first); among stops ending at the same place,
the longest.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopMatcher"]


class StopMatcher:
    """Per-request stop-string matcher. Not shared between requests.

    Lifecycle: ``feed(text)`` for each piece of generated text; it returns the text
    that is safe to send now and whether a stop string was hit. After a hit the
    request is finished: later feeds return ``("", True)``. At the end of a stream
    that did not hit, ``flush()`` returns the held-back tail.

    Empty stop strings are ignored. With no stop strings ``feed`` returns its input.
    """

    __slots__ = ("_stops", "_prefixes", "_firsts", "_max_hold", "_include", "_held", "stopped", "matched")

    def __init__(self, stop_strings: Iterable[str] = (), include_stop: bool = False) -> None:
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        # Every proper prefix of every stop string: a tail in this set must be held.
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._firsts = tuple(dict.fromkeys(s[0] for s in self._stops if len(s) > 1))
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._include = include_stop
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        if self.stopped:
            return "", True
        buf = self._held + text if self._held else text
        hit = self._first_match(buf)
        if hit is not None:
            start, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[: start + len(stop)] if self._include else buf[:start], True
        keep = self._hold_length(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return (buf[: len(buf) - keep] if keep else buf), False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best[0] or (end == best[0] and start < best[1]):
                best = (end, start, stop)
        return None if best is None else (best[1], best[2])

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        n = len(buf)
        low = n - self._max_hold if n > self._max_hold else 0
        start = n
        # Candidate starts are where a stop's first character occurs; str.find keeps
        # the common case (no such character near the end) in C.
        for first in self._firsts:
            i = buf.find(first, low)
            while 0 <= i < start:
                if buf[i:] in self._prefixes:
                    start = i
                    break
                i = buf.find(first, i + 1)
        return n - start
