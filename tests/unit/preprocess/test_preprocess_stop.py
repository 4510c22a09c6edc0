"""Stop strings over streamed text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.preprocess import StopMatcher


def run(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out, hit = [], False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(matcher.flush())
    return "".join(out), hit


def reference(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """A reader that looks at one more character at a time."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            longest = max(ending, key=len)
            return (text[:end] if include else text[: end - len(longest)]), True
    return text, False


def test_no_stop_strings_is_passthrough() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("hello") == ("hello", False)
    assert matcher.feed("") == ("", False)
    assert matcher.flush() == ""
    assert StopMatcher(["", ""]).feed("abc") == ("abc", False)  # empty stops are ignored


def test_stop_in_one_piece() -> None:
    assert StopMatcher(["STOP"]).feed("hello STOP world") == ("hello ", True)
    assert StopMatcher(["STOP"], include_stop=True).feed("hello STOP world") == ("hello STOP", True)


def test_stop_across_pieces() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc S") == ("abc ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("OP and more") == ("", True)
    assert matcher.matched == "STOP" and matcher.stopped
    assert matcher.feed("later") == ("", True)

    matcher = StopMatcher(["STOP"], include_stop=True)
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("OP!") == ("STOP", True)


def test_held_prefix_is_released_when_it_does_not_match() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("ART") == ("START", False)


def test_held_prefix_is_released_at_flush() -> None:
    matcher = StopMatcher(["STOP", "\n\n"])
    assert matcher.feed("the end\n") == ("the end", False)
    assert matcher.feed("ST") == ("\n", False)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_earliest_ending_stop_wins() -> None:
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("xabcd") == ("xa", True)
    assert matcher.matched == "bc"
    # at the same end, the longest stop is cut
    assert StopMatcher(["c", "abc"]).feed("xabc") == ("x", True)


@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
@settings(max_examples=500, deadline=None)
def test_any_cutting_gives_the_reference_result(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(text)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert run(StopMatcher(stops, include_stop=include), pieces) == reference(text, stops, include)


def test_the_matcher_is_linear_in_the_stops_total_size() -> None:
    """16 stop strings of 1,024 characters: at most one automaton state per character
    (the old matcher stored every prefix: 16 × 1,024²/2 characters, ~8 M)."""
    from kvmesh.preprocess.stop import StopAutomaton

    stops = [chr(0x4E00 + i) + "a" * 1023 for i in range(16)]
    auto = StopAutomaton(stops)
    assert len(auto.goto) <= sum(map(len, stops)) + 1
    m = StopMatcher(stops)
    text, hit = m.feed("a" * 5000 + stops[3][:-1])
    assert not hit and text == "a" * 5000  # the unfinished stop is held back
    text, hit = m.feed("a tail")
    assert hit and m.matched == stops[3] and text == ""
