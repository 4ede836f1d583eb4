"""The eviction benchmark's case generator: shipped prose, planted facts, depths, lengths, scoring."""

from __future__ import annotations

import random
import re
from collections import Counter
from importlib import resources

import pytest

from kvagent.data import PROSE_PACKAGE
from kvagent_bench import evict_suite as es

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def words(text: str) -> int:
    """A simple whitespace token counter."""
    return len(text.split())


# (n, target_tokens, facts_per_case (None: the 1-2-4 cycle), seed)
RETENTION = [
    (3, 150, 1, 0),
    (4, 400, 4, 1),
    (3, 1500, 4, 7),
    (2, 4000, 6, 11),
    (2, 9000, 3, 5),
    (1, 25000, 4, 3),  # longer than one book: the passage continues into the next
    (6, 300, None, 2),
    (9, 2000, None, 13),
]
# (n, target_tokens, seed)
STREAM = [(3, 100, 0), (2, 3000, 4), (1, 20000, 9)]


@pytest.fixture(scope="module", params=RETENTION, ids=lambda p: f"n{p[0]}-t{p[1]}-f{p[2] or 'cycle'}-s{p[3]}")
def retention(request: pytest.FixtureRequest) -> tuple[tuple[int, int, int, int], list[es.RetentionCase]]:
    n, target, k, seed = request.param
    return request.param, es.make_retention_cases(n, target, words, seed, facts_per_case=k)


# --- shipped prose ---------------------------------------------------------------------------------------------


def test_prose_is_shipped_and_sized() -> None:
    prose = es.load_prose()
    assert len(prose) >= 5
    sizes = {slug: len(text.encode("utf-8")) for slug, text in prose.items()}
    assert all(40_000 <= s <= 130_000 for s in sizes.values()), sizes
    assert sum(sizes.values()) <= 500_000


@pytest.mark.parametrize("marker", ["START OF THE PROJECT GUTENBERG", "END OF THE PROJECT GUTENBERG", "*** END",
                                    "*** START", "GUTENBERG", "www.", "http"])
def test_prose_has_no_license_boilerplate(marker: str) -> None:
    for slug, text in es.load_prose().items():
        assert marker.lower() not in text.lower(), slug


def test_prose_is_plain_paragraphs() -> None:
    for slug, text in es.load_prose().items():
        assert text.endswith("\n") and not text.endswith("\n\n"), slug
        assert "\r" not in text and "\t" not in text and "\n\n\n" not in text, slug
        paragraphs = es.split_paragraphs(text)
        assert len(paragraphs) > 50, slug
        assert all("\n" not in p and "  " not in p for p in paragraphs), slug


def test_sources_lists_every_shipped_file() -> None:
    root = resources.files(PROSE_PACKAGE)
    sources = root.joinpath("SOURCES.md").read_text(encoding="utf-8")
    shipped = sorted(e.name for e in root.iterdir() if e.name.endswith(".txt"))
    assert shipped == sorted(f"{slug}.txt" for slug in es.load_prose())
    for name in shipped:
        row = next((line for line in sources.splitlines() if f"`{name}`" in line), None)
        assert row is not None, name
        assert re.search(r"#\d+", row), name  # the Project Gutenberg ebook number
        assert re.search(r"`[\w.-]+/[\w.-]+`", row), name  # the GitHub repository
    assert "public domain" in sources.lower()


def test_load_prose_returns_a_fresh_dict() -> None:
    first = es.load_prose()
    first.clear()
    assert es.load_prose()


# --- sentence boundaries -----------------------------------------------------------------------------------------

SENTENCES = [
    # (paragraph, the sentences that must start where a note could go)
    ("One. Two! Three? Four.", ["One.", "Two!", "Three?", "Four."]),
    ("Mr. Bennet came. Mrs. Long left.", ["Mr. Bennet came.", "Mrs. Long left."]),
    ("He wrote to R. Walton at St. Petersburgh. Then he slept.", ["He wrote", "Then he slept."]),
    ('"Go now. Run." She went. "Fine," said he. "Good."', ['"Go now.', "She went.", '"Fine,"', '"Good."']),
    ("“Go now. Run.” She went.", ["“Go now.", "She went."]),
    ("'Oh dear!' said Alice. 'I shall be late!'", ["'Oh dear!'", "'I shall be late!'"]),
    ("no capital. after this", ["no capital. after this"]),
]


@pytest.mark.parametrize(("paragraph", "heads"), SENTENCES)
def test_sentence_starts(paragraph: str, heads: list[str]) -> None:
    starts = es.sentence_starts(paragraph)
    assert starts[0] == 0 and starts == sorted(set(starts))
    assert [paragraph[s:].split(" ")[0] for s in starts] == [h.split(" ")[0] for h in heads]


# --- facts -------------------------------------------------------------------------------------------------------


def test_there_are_at_least_six_templates_and_all_get_used() -> None:
    assert len(es.FACT_TEMPLATES) >= 6
    rng = random.Random(0)
    kinds = {f.kind for _ in range(20) for f in es.make_facts(rng, 4)}
    assert kinds == set(es.FACT_TEMPLATES)


@pytest.mark.parametrize("kind", sorted(es.FACT_TEMPLATES))
@pytest.mark.parametrize("k", [1, 3, 12])
def test_the_first_fact_has_the_kind_asked_for(kind: str, k: int) -> None:
    facts = es.make_facts(random.Random(f"{kind}{k}"), k, first_kind=kind)
    assert facts[0].kind == kind
    assert len({f.kind for f in facts}) == min(k, len(es.FACT_TEMPLATES))  # still no repeat before all are used


def test_an_unknown_first_kind_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="code"):
        es.make_facts(random.Random(0), 2, first_kind="birthday")


def test_dates_are_day_month_year() -> None:
    rng = random.Random(5)
    for _ in range(50):
        key, value, stated = es.FACT_TEMPLATES["date"](rng)
        day, month, year = value.split()
        assert key.startswith("the date of the ") and " at " in key and stated == value
        assert 1 <= int(day) <= 28 and month in es.MONTHS and 1800 <= int(year) <= 1899
        assert es.score_answer(f" {value}.", value) and not es.score_answer(f"{month} {day}, {year}", value)


@pytest.mark.parametrize("k", [1, 4, 8, 12])
def test_facts_are_distinct_short_and_stated(k: int) -> None:
    facts = es.make_facts(random.Random(k), k)
    assert len(facts) == k
    assert len({f.key for f in facts}) == k
    assert len({f.value.lower() for f in facts}) == k
    assert len({f.kind for f in facts}) == min(k, len(es.FACT_TEMPLATES))
    for f in facts:
        assert 1 <= len(f.value.split()) <= 3
        assert f.sentence.startswith(f"Note: {f.key} is ") and f.sentence.endswith(f"{f.value}.")


def test_fact_values_do_not_come_from_the_prose() -> None:
    """Invented keys: a fact's key never occurs in the shipped prose, so its value cannot be read from it."""
    corpus = "\n".join(es.load_prose().values()).lower()
    rng = random.Random(1)
    for _ in range(25):
        for f in es.make_facts(rng, 4):
            assert f.key.lower() not in corpus
            assert f.sentence.lower() not in corpus


# --- what the cases hold -------------------------------------------------------------------------------------

# (facts_per_case, cases) -> (facts per case, band, asked kind) of the first cases
PLANS = [
    (None, [(1, "early", "code"), (2, "middle", "name"), (4, "late", "count"), (1, "middle", "date"),
            (2, "late", es.ASKED_GROUPS[-1][0]), (4, "early", "code"), (1, "late", "name"), (2, "early", "locker")]),
    (3, [(3, "early", "code"), (3, "middle", "name"), (3, "late", "count"), (3, "middle", "date")]),
]


@pytest.mark.parametrize(("fixed", "expected"), PLANS)
def test_case_plan_cycles(fixed: int | None, expected: list[tuple[int, str, str]]) -> None:
    assert [es.case_plan(i, fixed) for i in range(len(expected))] == expected


def test_thirty_cases_are_balanced() -> None:
    """Over 30 cases: 10 of each fact count and band, 6 of each asked group, and every (count, band) pair."""
    plans = [es.case_plan(i) for i in range(30)]
    assert sorted(Counter(f for f, _, _ in plans).values()) == [10, 10, 10]
    assert Counter(b for _, b, _ in plans) == {band: 10 for band in es.BANDS}
    group = {kind: g for g in es.ASKED_GROUPS for kind in g}
    assert Counter(group[k] for _, _, k in plans) == {g: 6 for g in es.ASKED_GROUPS}
    assert {(f, b) for f, b, _ in plans[:9]} == {(f, b) for f in es.FACTS_CYCLE for b in es.BANDS}


def test_asked_groups_cover_every_template_once() -> None:
    kinds = [k for g in es.ASKED_GROUPS for k in g]
    assert sorted(kinds) == sorted(es.FACT_TEMPLATES)
    assert {"code", "name", "date"} <= set(kinds)


def test_cases_follow_their_plan(retention) -> None:
    (_, target, k, _), cases = retention
    for i, case in enumerate(cases):
        facts, band, kind = es.case_plan(i, k)
        assert (len(case.facts), case.band, case.asked_kind) == (facts, band, kind)
        low, high = es.BANDS[band]
        head = len(es.INSTRUCTION) + 2  # the band is a share of the passage, the depth one of the prompt
        within = (case.asked_depth * len(case.prompt) - head) / (len(case.prompt) - head)
        if target >= 1500:  # long prompts: the snap to a sentence start barely moves the drawn depth
            assert low - 0.02 <= within <= high + 0.02, (band, within)


# --- retention cases ---------------------------------------------------------------------------------------------


def test_retention_is_deterministic(retention) -> None:
    (n, target, k, seed), cases = retention
    assert es.make_retention_cases(n, target, words, seed, facts_per_case=k) == cases
    other = es.make_retention_cases(n, target, words, seed + 1000, facts_per_case=k)
    assert [c.prompt for c in other] != [c.prompt for c in cases]


def test_retention_prefix_property() -> None:
    """Case i depends only on (seed, i): the first cases of a longer run are the cases of a shorter one."""
    assert es.make_retention_cases(4, 300, words, 2)[:2] == es.make_retention_cases(2, 300, words, 2)


def test_retention_cases_differ_within_a_run() -> None:
    cases = es.make_retention_cases(6, 300, words, 4)
    assert len({c.prompt for c in cases}) == 6


def test_every_fact_sentence_occurs_once(retention) -> None:
    (n, _, k, _), cases = retention
    assert len(cases) == n
    for i, case in enumerate(cases):
        facts = k if k is not None else es.FACTS_CYCLE[i % len(es.FACTS_CYCLE)]
        assert len(case.facts) == facts
        for fact in case.facts:
            assert case.prompt.count(fact.sentence) == 1
            assert case.prompt.count(f"Note: {fact.key} is") == 1
        assert case.prompt.count("Note: ") == facts  # the prose itself has no "Note: " that could confuse


def test_the_asked_fact_is_among_the_facts(retention) -> None:
    _, cases = retention
    for case in cases:
        assert 0 <= case.asked < len(case.facts)
        fact = case.asked_fact
        assert fact in case.facts
        assert case.answer == fact.value
        assert case.question == f"Question: What is {fact.key}?\nAnswer:"
        assert case.question not in case.prompt
        assert case.text == case.prompt + es.QUESTION_SEPARATOR + case.question
        assert es.score_answer(" " + fact.value + ".", case.answer)


def test_depths_are_in_range_and_where_the_sentences_are(retention) -> None:
    (_, target, _, _), cases = retention
    for case in cases:
        assert len(case.depths) == len(case.facts)
        for fact, depth in zip(case.facts, case.depths, strict=True):
            pos = case.prompt.index(fact.sentence)
            assert depth == pytest.approx(pos / len(case.prompt), abs=1e-12)
            assert 0.0 < depth < 1.0
            if target >= 1500:  # long prompts: the snap to a sentence start barely moves the drawn depth
                assert 0.04 <= depth <= 0.96
        assert case.asked_depth == case.depths[case.asked]


def test_facts_sit_at_sentence_boundaries(retention) -> None:
    _, cases = retention
    for case in cases:
        assert case.prompt.startswith(es.INSTRUCTION + "\n\n")
        for fact in case.facts:
            pos = case.prompt.index(fact.sentence)
            before = case.prompt[:pos]
            after = case.prompt[pos + len(fact.sentence):]
            assert after.startswith(" ")
            if not before.endswith("\n\n"):  # not at a paragraph start: right after a sentence's end
                assert re.search(r"[.!?][\"”’')\]]*\s$", before), before[-40:]
                assert re.match(r" [\"“‘']?[A-Z]", after), after[:40]


def test_target_length_is_reached(retention) -> None:
    (_, target, _, _), cases = retention
    for case in cases:
        assert case.target_tokens == target
        assert words(case.prompt) >= target
        assert words(case.prompt) <= target + 1200  # grown paragraph by paragraph, no runaway


def test_prose_between_the_notes_is_contiguous(retention) -> None:
    """Remove the instruction and the notes: what remains is consecutive paragraphs of the corpus."""
    _, cases = retention
    flat = [p for slug in sorted(es.load_prose()) for p in es.split_paragraphs(es.load_prose()[slug])]
    for case in cases:
        passage = case.prompt[len(es.INSTRUCTION) + 2:]
        for fact in case.facts:
            passage = passage.replace(fact.sentence + " ", "")
        assert_contiguous(flat, passage.split("\n\n"))
        assert case.source in es.load_prose()


def assert_contiguous(flat: list[str], paragraphs: list[str]) -> None:
    starts = [i for i, p in enumerate(flat) if p == paragraphs[0]]
    assert starts, paragraphs[0][:60]
    assert any(
        all(flat[(i + j) % len(flat)] == p for j, p in enumerate(paragraphs)) for i in starts
    ), "paragraphs are not consecutive in the corpus"


@pytest.mark.parametrize(("n", "target", "k"), [(-1, 100, 4), (1, 0, 4), (1, 100, 0), (1, 100, -2)])
def test_retention_rejects_bad_arguments(n: int, target: int, k: int) -> None:
    with pytest.raises(ValueError):
        es.make_retention_cases(n, target, words, 0, facts_per_case=k)


def test_zero_cases() -> None:
    assert es.make_retention_cases(0, 100, words, 0) == []
    assert es.make_stream_texts(0, 100, words, 0) == []


def test_too_long_a_target_is_refused() -> None:
    total = sum(words(t) for t in es.load_prose().values())
    with pytest.raises(ValueError):
        es.make_retention_cases(1, total + 1000, words, 0)
    with pytest.raises(ValueError):
        es.make_stream_texts(1, total + 1000, words, 0)


def test_a_costlier_counter_is_called_sparingly() -> None:
    """Paragraph counts are cached per book; the full prompt is counted only a few times per case."""
    calls = []

    def counting(text: str) -> int:
        calls.append(len(text))
        return words(text)

    es.make_retention_cases(3, 2000, counting, 0)
    long_calls = [c for c in calls if c > 5000]
    assert len(long_calls) <= 3 * 3


# --- stream texts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "target", "seed"), STREAM)
def test_stream_texts(n: int, target: int, seed: int) -> None:
    texts = es.make_stream_texts(n, target, words, seed)
    assert texts == es.make_stream_texts(n, target, words, seed)
    assert texts != es.make_stream_texts(n, target, words, seed + 1)
    assert len(texts) == n
    flat = [p for slug in sorted(es.load_prose()) for p in es.split_paragraphs(es.load_prose()[slug])]
    for text in texts:
        assert words(text) >= target
        paragraphs = text.split("\n\n")
        assert words("\n\n".join(paragraphs[:-1])) < target  # not one paragraph more than needed
        assert "Note:" not in text
        assert_contiguous(flat, paragraphs)


# --- scoring -----------------------------------------------------------------------------------------------------

SCORES = [
    # (generated, answer, right)
    ("4817", "4817", True),
    (" 4817.", "4817", True),
    ("4817\nQuestion: What", "4817", True),
    ("4817 is the code", "4817", True),
    ("4,817", "4817", True),
    ("48170", "4817", False),
    ("481", "4817", False),
    ("4871", "4817", False),
    ("The code is 4817", "4817", False),
    ("Aldous Fenwick", "Aldous Fenwick", True),
    ("  aldous FENWICK, the cook", "Aldous Fenwick", True),
    ("Aldous", "Aldous Fenwick", False),
    ("Aldous Fenwick-Smith", "Aldous Fenwick", False),
    ("“Crimson,” she said", "crimson", True),
    ("**Crimson**", "crimson", True),
    ("crimsons", "crimson", False),
    ("a brass compass", "brass compass", True),
    ("The brass compass.", "brass compass", True),
    ("brass", "brass compass", False),
    ("", "4817", False),
    ("   ", "4817", False),
    ("4817", "", False),
    ("...", "...", False),
]


@pytest.mark.parametrize(("generated", "answer", "right"), SCORES)
def test_score_answer(generated: str, answer: str, right: bool) -> None:
    assert es.score_answer(generated, answer) is right


@pytest.mark.parametrize(("text", "normal"), [
    ("Hello, World!", ["hello", "world"]),
    ("The end", ["end"]),
    ("the", ["the"]),
    ("Ça va", ["ça", "va"]),
    ("  a\tb\nc ", ["b", "c"]),
])
def test_normalize_answer(text: str, normal: list[str]) -> None:
    assert es.normalize_answer(text) == normal
