"""The token diff behind implicit edits (``kvagent.kv.diff``): a table of the edits agents make, then properties."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings, strategies as st

from kvagent.kv.diff import K, Hunk, align, align_spans, apply

BASE = list(range(100, 400))  # 300 distinct tokens: a prompt with no repeated k-gram


def _replace(seq: list[int], at: int, n_old: int, new: list[int]) -> list[int]:
    return [*seq[:at], *new, *seq[at + n_old:]]


CASES = [
    # (name, old, new, expected hunks)
    ("equal", BASE, BASE, []),
    ("one token changed (a clock's minute)", BASE, _replace(BASE, 5, 1, [7]), [Hunk(5, 6, 5, 6)]),
    ("a line grows", BASE, _replace(BASE, 40, 3, [1, 2, 3, 4, 5]), [Hunk(40, 43, 40, 45)]),
    ("a span deleted (a dropped turn)", BASE, _replace(BASE, 100, 60, []), [Hunk(100, 160, 100, 100)]),
    ("a span cleared", BASE, _replace(BASE, 100, 60, [9, 8]), [Hunk(100, 160, 100, 102)]),
    ("a span inserted", BASE, _replace(BASE, 200, 0, [1, 2, 3]), [Hunk(200, 200, 200, 203)]),
    ("messages appended", BASE[:250], BASE, [Hunk(250, 250, 250, 300)]),
    ("the cache holds more (an old reply)", BASE, BASE[:250] + [5, 6], [Hunk(250, 300, 250, 252)]),
    ("two changes and appended messages", BASE[:280],
     _replace(_replace(BASE, 150, 2, [1]), 10, 1, [2]), [Hunk(10, 11, 10, 11), Hunk(150, 152, 150, 151),
                                                          Hunk(280, 280, 279, 299)]),
    ("two changes closer than the gap merge", BASE, _replace(_replace(BASE, 14, 1, [1]), 10, 1, [2]),
     [Hunk(10, 15, 10, 15)]),
    ("everything differs", BASE, list(range(1000, 1200)), [Hunk(0, 300, 0, 200)]),
    ("empty cache", [], BASE, [Hunk(0, 0, 0, 300)]),
]


@pytest.mark.parametrize("name,old,new,expected", CASES, ids=[c[0] for c in CASES])
def test_align_finds_the_edits_agents_make(name: str, old: list[int], new: list[int], expected: list[Hunk]) -> None:
    hunks = align(old, new)
    assert hunks == expected
    assert apply(old, new, hunks) == new


def test_a_repeated_template_piece_does_not_pull_the_alignment_away() -> None:
    # turns share their header tokens: after a changed tool result the alignment resumes at the nearest header
    header = [1, 2, 3, 4, 5]
    turns = [header + list(range(1000 * t, 1000 * t + 40)) for t in range(1, 6)]
    old = [t for turn in turns for t in turn]
    cleared = [header + [7, 7, 7] if i in (1, 3) else turn for i, turn in enumerate(turns)]
    new = [t for turn in cleared for t in turn]
    hunks = align(old, new)
    assert [h.kind for h in hunks] == ["replace", "replace"]
    assert sum(h.removed for h in hunks) == 80 and sum(h.added for h in hunks) == 6


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=200), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 5),
                                                                    st.lists(st.integers(0, 30), max_size=6)),
                                                          max_size=4))
def test_applying_the_hunks_gives_the_new_prompt(old: list[int], edits: list[tuple[int, int, list[int]]]) -> None:
    new = list(old)
    for at, n, ins in edits:
        new = _replace(new, min(at, len(new)), n, ins)
    hunks = align(old, new)
    assert apply(old, new, hunks) == new
    for a, b in zip(hunks, hunks[1:]):  # ordered, apart, and equal between
        assert a.old_end <= b.old_start and a.new_end <= b.new_start
        assert b.old_start - a.old_end == b.new_start - a.new_end
        assert old[a.old_end:b.old_start] == new[a.new_end:b.new_start]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 299), st.integers(0, 20), st.lists(st.integers(1000, 1100), max_size=20))
def test_one_edit_costs_at_most_its_own_tokens(at: int, n: int, ins: list[int]) -> None:
    new = _replace(BASE, at, n, ins)
    hunks = align(BASE, new)
    # fewer than k tokens left after the edit cannot resynchronise: they join it
    assert sum(h.added for h in hunks) <= len(ins) + (K - 1 if len(BASE) - at - n < K else 0)


def test_alignment_work_is_bounded_on_a_long_prompt() -> None:
    # a 100k-character prompt is ~25k tokens; the worst case is a prompt whose k-grams repeat everywhere
    rng = random.Random(0)
    old = [rng.randrange(8) for _ in range(25_000)]
    new = [rng.randrange(8) for _ in range(25_000)]
    start = time.process_time()
    hunks = align(old, new)
    assert apply(old, new, hunks) == new
    assert time.process_time() - start < 10  # a bound on work (CPU time), not a benchmark: prefill takes minutes


def test_a_deleted_line_among_lines_alike_is_one_deletion() -> None:
    # rules share their wording: aligning rule 4 with rule 5, 5 with 6, ... would be many small replacements
    lines = [[1, 2, 3, 10 + i, 4, 5, 6, 7, 8, 20 + i, 9] for i in range(12)]
    old = [t for line in lines for t in line]
    new = [t for i, line in enumerate(lines) if i != 4 for t in line]
    (hunk,) = align(old, new)  # where the deletion starts inside the shared wording is a matter of taste
    assert hunk.kind == "delete" and hunk.removed == 11 and 43 <= hunk.old_start <= 47


def test_a_long_block_replaced_by_a_short_one_resynchronises() -> None:
    # a 400-token tool result cleared: far more skipped than the look-ahead reads, still one region
    old = list(range(2000))
    new = [*old[:300], 5000, 5001, *old[700:]]
    assert align(old, new) == [Hunk(300, 700, 300, 302)]
    grown = [*old[:300], *range(5000, 5500), *old[300:]]
    assert align(old, grown) == [Hunk(300, 300, 300, 800)]


def test_segments_are_matched_before_tokens() -> None:
    # a long tool result cleared, whose text shares a 20-token phrase with the next result: token by token the
    # phrase pulls the alignment into the wrong result; segment by segment the cleared result is one region
    phrase = list(range(7000, 7020))
    result_1 = [1, 2, *range(100, 200), *phrase, *range(200, 300), 3]
    turn = [4, 5, *range(400, 440), 6]
    result_2 = [1, 2, *phrase, *range(500, 540), 3]
    cleared = [1, 2, 9, 3]
    old_segments = [list(range(1000, 1300)), result_1, turn, result_2]
    new_segments = [list(range(1000, 1300)), cleared, turn, result_2]
    old = [t for s in old_segments for t in s]
    new = [t for s in new_segments for t in s]
    starts = lambda segments: [sum(len(s) for s in segments[:i]) for i in range(len(segments))]  # noqa: E731
    hunks = align_spans(old, starts(old_segments), new, starts(new_segments))
    assert hunks == [Hunk(302, 522, 302, 303)] and apply(old, new, hunks) == new  # the closing token kept


def test_turns_summarised_into_one_are_one_region_of_whole_segments() -> None:
    # three turns (each opening with the same header tokens) replaced by one summary turn: the headers are not
    # aligned across turns; the three go whole and the summary comes whole, so no turn is cut inside
    header = [1, 2, 3, 4, 5]
    system = list(range(1000, 1100))
    turns = [[*header, *range(100 * i, 100 * i + 40)] for i in (2, 3, 4)]
    summary = [*header, *range(9000, 9030)]
    tail = [*header, *range(600, 650)]
    old_segments, new_segments = [system, *turns, tail], [system, summary, tail]
    old = [t for s in old_segments for t in s]
    new = [t for s in new_segments for t in s]
    starts = lambda segments: [sum(len(s) for s in segments[:i]) for i in range(len(segments))]  # noqa: E731
    hunks = align_spans(old, starts(old_segments), new, starts(new_segments))
    assert hunks == [Hunk(100, 235, 100, 135)] and apply(old, new, hunks) == new
