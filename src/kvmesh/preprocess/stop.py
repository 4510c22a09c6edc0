"""Stop strings over streamed text.

The text arrives in pieces (one per detokenizer step) and a stop string may span
several pieces, so the matcher holds back any tail that could be the start of a
stop string until the next piece decides it.

Which stop wins does not depend on how the text was cut into pieces: it is the stop
string whose first occurrence *ends* earliest in the stream (that is the one a
character-by-character reader meets first); among stops ending at the same place,
the longest.

The matcher is an Aho-Corasick automaton over the stop strings: its size (states,
transitions) is linear in their total length, each character of text costs amortised
O(1), and the state's depth is exactly the held-back tail (the longest tail of the
text that is a proper prefix of a stop string).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["StopMatcher", "StopAutomaton"]


class StopAutomaton:
    """Aho-Corasick over a set of strings (read-only after construction).

    ``goto[s]``: the character transitions of state ``s`` (the trie's edges only);
    ``fail[s]``: the state of the longest proper suffix of ``s`` that is in the trie;
    ``depth[s]``: the length of the string ``s`` spells; ``out[s]``: the length of the
    longest stop string ending at ``s`` (0: none).
    """

    __slots__ = ("goto", "fail", "depth", "out")

    def __init__(self, stops: Iterable[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    terminal.append(False)
                state = nxt
            terminal[state] = True
        fail = [0] * len(goto)
        out = [0] * len(goto)
        queue = deque(goto[0].values())
        for s in queue:
            out[s] = depth[s] if terminal[s] else 0
        while queue:  # breadth first: a state's fail link is shallower, so already done
            state = queue.popleft()
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                link = goto[f].get(ch, 0)
                fail[nxt] = link if link != nxt else 0
                out[nxt] = depth[nxt] if terminal[nxt] else out[fail[nxt]]
                queue.append(nxt)
        self.goto, self.fail, self.depth, self.out = goto, fail, depth, out

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


class StopMatcher:
    """Per-request stop-string matcher. Not shared between requests.

    Lifecycle: ``feed(text)`` for each piece of generated text; it returns the text
    that is safe to send now and whether a stop string was hit. After a hit the
    request is finished: later feeds return ``("", True)``. At the end of a stream
    that did not hit, ``flush()`` returns the held-back tail.

    Empty stop strings are ignored. With no stop strings ``feed`` returns its input.
    """

    __slots__ = ("_auto", "_firsts", "_state", "_include", "_held", "stopped", "matched")

    def __init__(self, stop_strings: Iterable[str] = (), include_stop: bool = False) -> None:
        stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._auto = StopAutomaton(stops) if stops else None
        # characters that start a stop: text without any of them (at state 0) skips the automaton
        self._firsts = frozenset(s[0] for s in stops)
        self._state = 0
        self._include = include_stop
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        auto = self._auto
        if auto is None:
            return text, False
        if self.stopped:
            return "", True
        buf = self._held + text if self._held else text
        offset = len(buf) - len(text)
        state = self._state
        if state == 0 and self._firsts.isdisjoint(text):
            return buf, False
        out, step = auto.out, auto.step
        for i, ch in enumerate(text):
            state = step(state, ch)
            length = out[state]
            if length:
                end = offset + i + 1
                start = end - length
                self.stopped, self.matched, self._held, self._state = True, buf[start:end], "", 0
                return buf[:end] if self._include else buf[:start], True
        self._state = state
        keep = auto.depth[state]
        self._held = buf[len(buf) - keep :] if keep else ""
        return (buf[: len(buf) - keep] if keep else buf), False

    def flush(self) -> str:
        held, self._held = self._held, ""
        self._state = 0
        return held
