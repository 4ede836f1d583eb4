"""The held-out eviction cases (pure logic, a word counter for tokens): deterministic splits that share no case,
facts stated exactly once, asked facts inside their bands, the families and lengths cycled, replies scored by
string match."""

from __future__ import annotations

import re

import pytest

from kvagent.segments import SegmentKind
from kvagent_bench.evict_heldout import (
    BANDS,
    FACTS_PER_CASE,
    FAMILIES,
    LENGTHS,
    SPLITS,
    build_case,
    make_cases,
    make_dialogues,
    question_segment,
    reply_segment,
    score_reply,
)

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def words(text: str) -> int:
    return int(len(text.split()) * 1.3) + 1


CASES = {split: make_cases(split, 12, words) for split in SPLITS}


def context(case) -> str:  # type: ignore[no-untyped-def]
    return "\n".join(s.text for s in case.segments)


def test_cases_are_deterministic_and_the_splits_share_none() -> None:
    for split in SPLITS:
        assert make_cases(split, 12, words) == CASES[split]
        assert make_cases(split, 3, words, start=4) == CASES[split][4:7]
    texts = {split: {context(c) for c in CASES[split]} for split in SPLITS}
    assert len(texts["test"]) == len(texts["calibration"]) == 12
    assert not texts["test"] & texts["calibration"]


@pytest.mark.parametrize("split", SPLITS)
def test_families_and_lengths_cycle_and_contexts_reach_their_target(split: str) -> None:
    cases = CASES[split]
    assert {(c.family, c.target) for c in cases} == {(f, n) for f in FAMILIES for n in LENGTHS}
    for c in cases:
        assert c.target <= c.tokens <= 1.6 * c.target, c.id
        assert c.segments[0].kind is SegmentKind.POLICY and c.segments[0].pinned


@pytest.mark.parametrize("split", SPLITS)
def test_every_fact_is_stated_once_and_asked_facts_sit_in_their_band(split: str) -> None:
    for c in CASES[split]:
        text = context(c)
        assert len(c.facts) == FACTS_PER_CASE and len({f.kind for f in c.facts}) == FACTS_PER_CASE
        for fact in c.facts:  # as a whole word or number (a code may also be part of an identifier)
            assert len(re.findall(rf"(?<![\w-]){re.escape(fact.answer)}(?![\w-])", text)) == 1, (c.id, fact)
        assert [q.band for q in c.questions] == list(BANDS)
        for q in c.questions:
            low, high = BANDS[q.band]
            assert low - 0.05 <= q.depth <= high + 0.05, (c.id, q)
            assert q.answer not in q.text and q.answer not in question_segment(q).text


def test_every_question_has_a_lead_that_does_not_give_the_answer() -> None:
    for c in CASES["test"]:
        for q in c.questions:
            assert q.lead and q.answer not in q.lead and q.lead[0].isupper()
            assert reply_segment(q).role == "assistant" and not reply_segment(q).complete


def test_dialogues_are_long_and_ask_about_the_early_sessions() -> None:
    dialogues = make_dialogues("test", 2, words)
    assert dialogues == make_dialogues("test", 2, words)
    for d in dialogues:
        assert d.family == "sessions" and d.tokens >= 4096
        assert [q.band for q in d.questions].count("early") == 3
        assert sum(s.text.startswith("Session ") for s in d.segments) >= 4


@pytest.mark.parametrize(("bad", "match"), [
    ({"split": "train"}, "split"), ({"family": "poems"}, "family"), ({"bands": ()}, "bands"),
    ({"bands": ("first",)}, "bands"), ({"facts": 2}, "facts"),
])
def test_bad_arguments_name_the_choices(bad: dict, match: str) -> None:
    args = {"split": "test", "index": 0, "count_tokens": words, **bad}
    with pytest.raises(ValueError, match=match):
        build_case(**args)


@pytest.mark.parametrize(("reply", "answer", "ok"), [
    ("Your bike lock code is 4817.", "4817", True),
    ("4,817", "4817", True),
    ("48170", "4817", False),
    ("The code is 481 7", "4817", False),
    ("It's Dr. Aldous Fenwick.", "Aldous Fenwick", True),
    ("Aldous", "Aldous Fenwick", False),
    ("On 14 June.", "14 June", True),
    ("It is on June 14th.", "14 June", True),
    ("the 14th of June", "14 June", True),
    ("On 15 June.", "14 June", False),
    ("You said lapsang souchong!", "lapsang souchong", True),
    ("16 September.私は", "16 September", True),  # the first sentence only: what follows it is not read
    ("It was 1,250.00 euros", "1250", False),
    ("It was 1,250 euros.", "1250", True),
    ("Not sure. It is 4817.", "4817", False),
    ("", "4817", False),
    ("anything", "", False),
    (" ".join(["word"] * 30) + " 4817", "4817", False),  # past the first 24 words
])
def test_replies_are_scored_by_string_match(reply: str, answer: str, ok: bool) -> None:
    assert score_reply(reply, answer) is ok


# --- the suite's summary (kvagent_bench.evict_agent.summarize) -------------------------------------------
def _records(policy: str, budget: float | None, oks: dict[str, list[bool]]) -> list[dict]:
    bands = ("early", "middle", "late")
    return [{"model": "m", "task": "heldout", "policy": policy, "budget": budget, "case": case, "ok": ok,
             "band": bands[i % 3], "family": case.split("-")[-1], "answer_kept": None if budget is None else 0.5,
             "score_ms": None if budget is None else 10.0 + i}
            for case, answers in oks.items() for i, ok in enumerate(answers)]


def test_summary_rows_give_accuracy_ratio_to_the_full_cache_and_breakdowns() -> None:
    from kvagent_bench.evict_agent import summarize

    full = {"c0-tools": [True, True, True], "c1-documents": [True, False, True]}
    half = {"c0-tools": [True, False, True], "c1-documents": [False, False, True]}
    rows = {r["policy"]: r for r in summarize(_records("full", None, full) + _records("window", 0.25, half))}
    assert rows["full"]["score"] == pytest.approx(5 / 6) and rows["full"]["ratio"] == pytest.approx(1.0)
    assert rows["full"]["ratio_low"] is None
    w = rows["window"]
    assert w["score"] == pytest.approx(3 / 6) and w["ratio"] == pytest.approx(3 / 5)
    assert w["ratio_low"] <= 3 / 5 <= w["ratio_high"] and w["cases"] == 2 and w["n"] == 6
    assert w["ci_low"] <= 0.5 <= w["ci_high"]
    assert w["by_band"] == {"early": [1, 2], "middle": [0, 2], "late": [2, 2]}
    assert w["by_family"] == {"tools": [2, 3], "documents": [1, 3]}
    assert w["answer_kept"] == pytest.approx(0.5) and w["cycle_ms"] == pytest.approx(11.0)


def _chain(policy: object) -> list[object]:
    """A policy and its wrappers' inner policies, outermost first."""
    out = []
    while policy is not None:
        out.append(policy)
        policy = getattr(policy, "inner", None)
    return out


def _memos(policy: object) -> list[object]:
    """The shared passes (``Memo``) down a policy's wrappers."""
    from kvagent_bench.evict_agent import Memo

    return [p for p in _chain(policy) if isinstance(p, Memo)]


@pytest.mark.parametrize(("name", "head"), [
    ("surprise-token", "auto"), ("surprise", "auto"), ("hybrid", "auto"),
    ("surprise-token-f32", "float32"), ("surprise-f32", "float32"), ("hybrid-f32", "float32"),
])
def test_the_surprise_variants_share_one_pass_per_head(monkeypatch: pytest.MonkeyPatch, name: str, head: str) -> None:
    """In the ``once`` setting every surprise variant of one vocabulary head scores through one shared pass; the
    ``-f32`` variants through a second one with the float32 head (the default "auto" is "mixed" on a bf16 CPU)."""
    import kvagent.policies.last_layer as last_layer
    from kvagent_bench.evict_agent import calibration_variants

    monkeypatch.setattr(last_layer, "fast_bf16", lambda: True)
    variants = calibration_variants()
    memos = _memos(variants[name]())
    twin = _memos(variants["surprise-token" if head == "auto" else "surprise-token-f32"]())
    other = _memos(variants["surprise-token-f32" if head == "auto" else "surprise-token"]())
    assert len(memos) == 1 and memos[0] is twin[0] and memos[0] is not other[0]
    assert memos[0].inner.head == ("mixed" if head == "auto" else "float32")


@pytest.mark.parametrize(("name", "source"), [
    # the registry's names stay the registry's policies (the books suite's rows are the shipped policies')
    ("contrast", "registry"), ("surprise", "registry"), ("hybrid", "registry"), ("window", "registry"),
    # a calibration candidate, with its own pass (no Memo shared across sessions)
    ("hybrid-contrast-max@0.5", "variant"), ("hybrid-contrast@1", "variant"), ("contrast@0.5", "variant"),
    ("hybrid-selfinfo", "variant"),
])
def test_the_books_suite_takes_registry_names_and_calibration_candidates(name: str, source: str) -> None:
    from kvagent.policies import get_policy
    from kvagent_bench.evict_agent import bench_policy_names, calibration_variants, registry_or_variant

    made = registry_or_variant(name)
    expected = get_policy(name) if source == "registry" else calibration_variants(shared=False)[name]()
    types = [type(p).__name__ for p in _chain(made)]
    assert types == [type(p).__name__ for p in _chain(expected)] and "Memo" not in types
    assert made.name == expected.name and name in bench_policy_names()


def test_the_books_suite_names_the_policies_it_takes() -> None:
    from typer.testing import CliRunner

    from kvagent.cli import app

    result = CliRunner().invoke(app, ["bench", "evict", "--tasks", "retention", "--policies", "contrast,nope"])
    assert result.exit_code == 2
    assert "nope" in result.output and "hybrid-contrast-max@0.5" in result.output
