"""The held-out (test) split of the decision suite: deterministic cases, counts, both formats and downstream
lengths, and no worked example about errata (pure logic: a character-level fake tokenizer renders them)."""

from __future__ import annotations

import itertools
import random

import pytest

from kvagent.chat_format import ChatFormat
from kvagent.edits.suite import TEMPLATES, question_segments
from kvagent.segments import Renderer, SegmentKind
from kvagent_bench.edit_heldout import (
    DOWNSTREAMS,
    FORMATS,
    HELDOUT,
    SHORT_SENTENCES,
    make_heldout_cases,
    split_cases,
    split_templates,
)
from tests.unit.test_segments import FMT, CharTokenizer

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

GRID = list(itertools.product(HELDOUT, FORMATS, DOWNSTREAMS))


def texts(case) -> list[str]:  # type: ignore[no-untyped-def]
    return [seg.text for seg in case.segments] + [case.question]


def test_at_least_three_templates_none_shared_with_the_calibration_split() -> None:
    assert len(HELDOUT) >= 3 and not set(HELDOUT) & set(TEMPLATES)
    calibration_lines = {line for t in TEMPLATES.values() for f in t.fields.values() for line in (f.template, f.erratum)}
    assert not {f.template for t in HELDOUT.values() for f in t.fields.values()} & calibration_lines
    assert not {t.question for t in HELDOUT.values()} & {t.question for t in TEMPLATES.values()}


@pytest.mark.parametrize(("name", "format", "downstream"), GRID)
def test_cases_are_deterministic_and_forty_per_template(name: str, format: str, downstream: str) -> None:
    cases = make_heldout_cases(name, 40, seed=5, format=format, downstream=downstream)
    assert cases == make_heldout_cases(HELDOUT[name], 40, seed=5, format=format, downstream=downstream)
    assert len(cases) == 40 and cases != make_heldout_cases(name, 40, seed=6, format=format, downstream=downstream)
    template = HELDOUT[name]
    for case in cases:
        assert (case.split, case.format, case.downstream, case.template) == ("test", format, downstream, name)
        assert set(case.changes) == set(template.edited) and case.erratum_templates == {}
        assert all(case.changes[f] != case.before[f] and case.changes[f] in template.fields[f].pool for f in template.edited)
        after = {**case.before, **case.changes}
        assert template.answer(case.before) in template.answers and template.answer(after) in template.answers
        fields = [s for s in case.segments if s.kind is SegmentKind.FIELD]
        assert [(s.name, s.value) for s in fields] == list(case.before.items())
        assert all(s.role == (template.field_role if format == "chat" else "system") for s in fields)


@pytest.mark.parametrize(("name", "format", "downstream"), GRID)
def test_no_worked_example_or_instruction_about_errata(name: str, format: str, downstream: str) -> None:
    for case in make_heldout_cases(name, 40, seed=0, format=format, downstream=downstream):
        for text in texts(case):
            lowered = text.lower()
            assert "[state update]" not in lowered and "overrides" not in lowered and "erratum" not in lowered
            assert "latest" not in lowered and "repeated" not in lowered  # the calibration split's instruction
    # ... while the calibration split's prompts do carry them (what the held-out split is kept apart from)
    assert "the latest line counts" in TEMPLATES["lookup"].policy(random.Random(0))


@pytest.mark.parametrize("name", HELDOUT)
def test_formats_render_the_examples_as_text_or_as_turns(name: str) -> None:
    template = HELDOUT[name]
    plain = make_heldout_cases(name, 1, format="plain")[0]
    chat = make_heldout_cases(name, 1, format="chat")[0]
    assert plain.segments[0].kind is SegmentKind.POLICY and plain.segments[0].text.count(template.cue) == template.shots
    assert plain.question == f"{template.question}\n{template.cue}"
    turns = [s for s in chat.segments if s.kind is SegmentKind.TURN]
    assert [s.role for s in turns] == ["user", "assistant"] * template.shots
    assert chat.segments[0].text == template.instructions and chat.question.startswith(template.question)
    for case, fmt in ((plain, ChatFormat.plain()), (chat, FMT)):  # valid prompts in both renderings
        rendered = Renderer(CharTokenizer(), fmt).render([*case.segments, *question_segments(case.question)])
        assert rendered.spans[-1].kind is SegmentKind.TURN


def test_short_and_long_downstream() -> None:
    short = make_heldout_cases("tool", 3, downstream="short")
    long = make_heldout_cases("tool", 3, downstream="long")
    assert all(c.segments[-1].text.count(".") == SHORT_SENTENCES for c in short)
    # about 2,000 tokens (~4 characters a token); every case its own log
    assert all(7_000 < len(c.segments[-1].text) < 10_000 for c in long)
    assert len({c.segments[-1].text for c in long}) == 3


def test_the_prefix_is_shared_by_every_case_of_a_template_and_format() -> None:
    for format in FORMATS:
        cases = make_heldout_cases("room", 10, format=format)
        n = len(HELDOUT["room"].prefix(format))
        assert len({c.segments[:n] for c in cases}) == 1


def test_splits() -> None:
    assert split_templates("calibration") is TEMPLATES and split_templates("test") is HELDOUT
    assert all(c.split == "calibration" and c.format == "chat" for c in split_cases("calibration", "lookup", 3, format="chat"))
    assert split_cases("test", "tool", 4, seed=2) == make_heldout_cases("tool", 4, seed=2)
    for bad in ({"format": "html"}, {"downstream": "medium"}):
        with pytest.raises(ValueError, match="unknown"):
            make_heldout_cases("tool", 1, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown split"):
        split_templates("train")
