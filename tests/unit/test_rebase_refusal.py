"""When a resent prompt's changes are recomputed instead of spliced (``kvagent.kv.rebase.refusal``): pure logic on
the span table, a table of cases."""

from __future__ import annotations

import pytest

from kvagent.kv.diff import Hunk
from kvagent.kv.rebase import refusal
from kvagent.segments import Rendered, SegmentKind, Span

# positions 0-99 policy, 100-199 a skill, 200-299 an assistant turn "call", 300-399 a user turn
SPANS = (Span("policy", SegmentKind.POLICY, 0, 99, True), Span("skill", SegmentKind.SKILL, 100, 199, True),
         Span("call", SegmentKind.TURN, 200, 299, False, label="assistant"),
         Span("user", SegmentKind.TURN, 300, 399, False, label="user"))
OLD = Rendered(tuple(range(400)), SPANS)
NEW = Rendered(tuple(range(410)), (Span("policy", SegmentKind.POLICY, 0, 49, True),
                                   Span("new skill", SegmentKind.SKILL, 50, 59, True), *(
    Span(s.segment_id, s.kind, s.first + 10, s.last + 10, s.pinned, label=s.label) for s in SPANS[1:])))


def frozen(span: Span) -> str | None:
    return "a tool call" if span.segment_id == "call" else None


CASES = [
    ("a line of the policy", [Hunk(10, 12, 10, 12)], None),
    ("a user turn", [Hunk(310, 320, 310, 318)], None),
    ("inside a skill", [Hunk(150, 151, 150, 151)], "skill"),
    ("an insertion at a skill's first token", [Hunk(100, 100, 100, 103)], "skill"),
    ("an insertion before a tool call (after a skill)", [Hunk(200, 200, 200, 203)], "a tool call"),
    ("inside a tool call", [Hunk(250, 252, 250, 252)], "a tool call"),
    ("more changed than half of what follows", [Hunk(300, 301, 300, 360)], "more than 50%"),
    ("too many regions", [Hunk(i, i + 1, i, i + 1) for i in range(0, 90, 10)], "9 changed regions"),
    ("a skill inserted", [Hunk(50, 50, 50, 60)], "transplants it"),
    # a summary in place of turns: a tool call (or a skill) removed whole keeps none of its cells
    ("a tool call removed whole", [Hunk(200, 300, 210, 210)], None),
    ("a skill and a tool call removed whole", [Hunk(100, 300, 110, 110)], None),
    ("a tool call cut short", [Hunk(250, 300, 260, 261)], "a tool call"),
]


@pytest.mark.parametrize("name,hunks,why", CASES, ids=[c[0] for c in CASES])
def test_refusal(name: str, hunks: list[Hunk], why: str | None) -> None:
    got = refusal(OLD, NEW, hunks, frozen, max_share=0.5, max_edits=8)
    assert (got is None) if why is None else (got is not None and why in got), got
