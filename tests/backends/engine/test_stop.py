"""StopMatcher: the client never sees stop text, and nothing before the stop is lost, for any split."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from backends.engine.stop import StopMatcher


def run(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    return run_matching(chunks, stops)[:2]  # type: ignore[return-value]


def run_matching(chunks: list[str], stops: list[str]) -> tuple[str, bool, str | None]:
    """(text let through, whether a stop matched, the stop string that matched)."""
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        text, matched = matcher.push(chunk)
        out.append(text)
        if matched:
            return "".join(out), True, matcher.matched
    out.append(matcher.flush())
    return "".join(out), False, matcher.matched


def expected(text: str, stops: list[str]) -> tuple[str, bool, str | None]:
    """The text before the stop string that is completed first (earliest end, then earliest start), and that
    stop string."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, False, None
    return text[: min(hits)[1]], True, min(hits)[2]


def test_stop_string_split_across_chunks_is_removed_and_ends_the_stream() -> None:
    assert run(["Hello wo", "rld! And", " more"], ["world"]) == ("Hello ", True)


def test_partial_match_is_held_back_then_released_when_it_does_not_complete() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc ", False)
    assert matcher.push("ART") == ("START", False)
    assert matcher.flush() == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    assert run_matching(["x", "yz-ab-cd"], ["cd", "ab"]) == ("xyz-", True, "ab")


def test_the_stop_string_completed_first_wins_whatever_the_split() -> None:
    assert run([" a", "a"], ["a", " aa"]) == (" ", True)
    assert run([" aa"], ["a", " aa"]) == (" ", True)


def test_held_text_is_flushed_at_end_of_sequence() -> None:
    assert run(["the end is ne"], ["near!"]) == ("the end is ne", False)


def test_no_stop_strings_passes_text_through() -> None:
    assert StopMatcher([]).push("anything") == ("anything", False)


alphabet = st.sampled_from("ab\u00e9 \n\U0001f600")


@given(
    text=st.text(alphabet, max_size=40),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_split_gives_the_text_before_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert run_matching(chunks, stops) == expected(text, stops)
