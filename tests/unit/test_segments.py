"""Segment ordering rules and span bookkeeping (pure logic: a character-level fake tokenizer)."""

from __future__ import annotations

import pytest

from kvagent.chat_format import ChatFormat
from kvagent.errors import SegmentOrderError
from kvagent.segments import Renderer, Segment, SegmentKind, common_prefix


class CharTokenizer:
    """One token per character; special text gets negative ids so it is told apart."""

    bos_ids = [0]

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return [-ord(c) if special else ord(c) for c in text]


FMT = ChatFormat.from_template(
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

P, F = Segment.policy("be nice", id="p"), Segment.field("status", "open", id="f")
U, A = Segment.user("hi", id="u"), Segment.assistant("hello", id="a")

ORDER_CASES = [
    # (segments, error substring or None)
    ([P, F, U, A], None),
    ([P, Segment.skill("faq", "q&a", id="s"), F, U, Segment.erratum("status", "closed", id="e")], None),
    ([U, A, Segment.memory("likes tea", id="m")], None),
    ([F, P], "policies must come before"),
    ([P, F, U, Segment.field("status", "open", id="f2")], "declared twice"),
    # fields anywhere: after few-shot turns, as a later system message or a tool result (user role)
    ([P, U, A, F, Segment.user("and now?", id="u2")], None),
    ([P, U, A, Segment.field("tool", "42", id="t", role="user"), Segment.erratum("tool", "43", id="e")], None),
    ([P, F, Segment.field("status", "x", id="f2")], "declared twice"),
    ([P, Segment.erratum("status", "closed", id="e")], "not declared before it"),
    ([P, P], "id is used twice"),
    ([P, Segment(SegmentKind.TURN, "", role="assistant", complete=False, id="x"), U], "must be the last"),
    # a field inside a message's text: Segment.message builds the parts
    ([P, *Segment.message("user", "lookup: ", F, " ok"), A], None),
    ([P, *Segment.message("user", F), A], None),
    ([P, *Segment.message("user", "lookup: ", F)], None),
    ([P, *Segment.message("user", "lookup: ", F, " ok")[:2]], "ends inside a user message"),
    ([P, Segment.message("user", "lookup: ", F)[0], U], "is not closed"),
    ([P, Segment.message("user", "a", "b")[1]], "none is open"),
    ([P, *Segment.message("user", "a", F)[:1], Segment.message("system", "a", F)[1]], "is not closed"),
]


def test_a_message_made_of_parts_renders_as_one_message() -> None:
    """Open tag, each part's tokens, one closing tag; the field's span holds exactly its own text, and the
    parts take the message's role."""
    parts = Segment.message("user", "lookup: ", F, " ok")
    rendered = Renderer(CharTokenizer(), FMT).render([P, *parts])
    first = rendered.span_of(parts[0].id).first
    text = "".join(chr(-t) if t < 0 else chr(t) for t in rendered.tokens[first:])
    assert text == "<user>lookup: status: open ok</user>"
    span = rendered.span_of("f")
    assert "".join(chr(t) for t in rendered.tokens[span.first : span.last + 1]) == "status: open"
    assert [p.role for p in parts] == ["user"] * 3 and parts[1].kind is SegmentKind.FIELD and parts[1].id == "f"
    with pytest.raises(SegmentOrderError, match="cannot be part of a message"):
        Segment.message("user", P)


@pytest.mark.parametrize("seg", [P, F, *Segment.message("user", "lookup: ", F, " ok"),
                                 Segment.erratum("status", "closed", id="e"), Segment.memory("m", priority=-2, pinned=True),
                                 Segment.assistant("x", token_ids=[1, 2])])
def test_segments_round_trip_through_dicts(seg: Segment) -> None:
    import json

    from kvagent.segments import segment_from_dict, segment_to_dict

    assert segment_from_dict(json.loads(json.dumps(segment_to_dict(seg)))) == seg


@pytest.mark.parametrize(("segments", "error"), ORDER_CASES)
def test_order_rules(segments: list[Segment], error: str | None) -> None:
    renderer = Renderer(CharTokenizer(), FMT)
    if error is None:
        renderer.render(segments)
    else:
        with pytest.raises(SegmentOrderError, match=error):
            renderer.render(segments)


@pytest.mark.parametrize(
    "segments",
    [[P], [P, F, U, A], [U], [P, F, U, A, Segment.erratum("status", "closed", id="e"), Segment.user("again", id="u2")]],
)
def test_spans_cover_every_position_once(segments: list[Segment]) -> None:
    rendered = Renderer(CharTokenizer(), FMT).render(segments)
    covered = [p for s in rendered.spans for p in range(s.first, s.last + 1)]
    assert covered == list(range(len(rendered.tokens)))
    assert [s.segment_id for s in rendered.spans] == [s.id for s in segments]
    assert rendered.spans[0].first == 0 and rendered.tokens[0] == 0  # BOS opens the first span


def test_segment_text_is_wrapped_by_role() -> None:
    rendered = Renderer(CharTokenizer(), FMT).render([P, U])
    span = rendered.span_of("u")
    body = rendered.tokens[span.first : span.last + 1]
    assert body == (*(-ord(c) for c in "<user>"), *(ord(c) for c in "hi"), *(-ord(c) for c in "</user>"))
    assert rendered.segment_at(span.first).segment_id == "u"


def test_token_ids_override_and_unfinished_turn() -> None:
    renderer = Renderer(CharTokenizer(), FMT)
    done = renderer.render([U, Segment.assistant("ignored", id="a", token_ids=[7, 8])])
    pending = renderer.render([U, Segment(SegmentKind.TURN, "", role="assistant", complete=False, id="a")])
    gen = tuple(-ord(c) for c in "<assistant>")
    assert done.tokens[done.span_of("a").first :] == (*gen, 7, 8, *(-ord(c) for c in "</assistant>"))
    assert pending.tokens[pending.span_of("a").first :] == gen


@pytest.mark.parametrize(
    ("kind_factory", "pinned"),
    [(lambda: Segment.policy("x"), True), (lambda: Segment.field("a", 1), True), (lambda: Segment.user("x"), False),
     (lambda: Segment.skill("s", "x"), False), (lambda: Segment.skill("s", "x", pinned=True), True),
     (lambda: Segment.erratum("a", 2), True), (lambda: Segment.memory("x"), False)],
)
def test_default_pinning(kind_factory, pinned: bool) -> None:  # type: ignore[no-untyped-def]
    assert kind_factory().pinned is pinned


@pytest.mark.parametrize(
    ("bad", "match"),
    [(lambda: Segment(SegmentKind.TURN, "x", role="robot"), "unknown role"),
     (lambda: Segment(SegmentKind.FIELD, "x"), "needs the field's name"),
     (lambda: Renderer(CharTokenizer(), FMT).render([]), "at least one segment")],
)
def test_bad_segments_are_refused(bad, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SegmentOrderError, match=match):
        bad()


@pytest.mark.parametrize(("a", "b", "n"), [((), (1,), 0), ((1, 2, 3), (1, 2, 4), 2), ((1, 2), (1, 2), 2), ((5,), (6,), 0)])
def test_common_prefix(a: tuple[int, ...], b: tuple[int, ...], n: int) -> None:
    assert common_prefix(a, b) == n


def test_segment_priority_and_pinning_reach_the_span_table() -> None:
    """Any segment may be pinned or carry an eviction priority; the span table carries both."""
    segs = [Segment.user("abc", priority=-1), Segment.user("de", pinned=True), Segment.memory("fgh", priority=2),
            Segment.assistant("ij", priority=1)]
    spans = Renderer(CharTokenizer(), FMT).render(segs).spans
    assert [(sp.pinned, sp.priority) for sp in spans] == [(False, -1), (True, 0), (False, 2), (False, 1)]
