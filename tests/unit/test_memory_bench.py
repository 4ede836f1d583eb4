"""The memory benchmark's pure parts: the persona generator (facts stated once, updates in the last session,
questions about current and earlier values), answer checking, and the summary of paired answers."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest

from kvagent_bench.memory import Answer, WayRun, clip_answer, rescore, score, summarise
from kvagent_bench.memory_data import ATTRIBUTES, STATE, UPDATE, correct, make_persona

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def words(turns: Sequence[tuple[str, str]]) -> int:
    """A stand-in token count: words."""
    return sum(len(t.split()) for _, t in turns)


@pytest.mark.parametrize("seed", [0, 1, 7, 23])
def test_a_persona_states_each_fact_once_and_updates_six_in_the_last_session(seed: int) -> None:
    p = make_persona(seed, words, target_tokens=1200)
    user = [t for s in p.sessions for role, t in s if role == "user"]
    for a in ATTRIBUTES:
        stated = STATE[a].format(v=p.initial[a], kind=p.pet_kind)
        assert user.count(stated) == 1, a
    assert len(p.updated) == 6 and all(p.updated[a] != p.initial[a] for a in p.updated)
    last = [t for role, t in p.sessions[-1] if role == "user"]
    for a, v in p.updated.items():
        assert UPDATE[a].format(v=v, old=p.initial[a], kind=p.pet_kind) in last
    earlier_sessions = [t for s in p.sessions[:-1] for role, t in s if role == "user"]
    assert not any(UPDATE[a].split("{")[0] in t for a in p.updated for t in earlier_sessions if UPDATE[a].split("{")[0])
    assert 1200 <= words(p.turns) < 1200 + 60  # small talk drawn until the target, one turn pair over at most
    kinds = [(q.attribute, q.kind) for q in p.questions]
    assert len(p.questions) == 14 and len(set(kinds)) == 14
    assert {a for a, k in kinds if k == "earlier"} == set(p.updated)
    for q in p.questions:
        if q.attribute == "pet_kind":
            assert q.answer == p.pet_kind
        else:
            assert q.answer == ({**p.initial, **p.updated}[q.attribute] if q.kind == "current" else p.initial[q.attribute])


def test_personas_are_deterministic_in_their_seed_and_differ_across_seeds() -> None:
    assert make_persona(3, words, 800) == make_persona(3, words, 800)
    assert make_persona(3, words, 800).initial != make_persona(4, words, 800).initial


def test_memory_edits_rewrite_the_blocks_lines_to_the_final_value() -> None:
    p = make_persona(5, words, 600)
    value = p.memory_value()
    for _, old, new in p.memory_edits():
        assert value.count(old) == 1
        value = value.replace(old, new)
    assert value == p.memory_value({**p.initial, **p.updated})


@pytest.mark.parametrize(("answer", "expected", "right"), [
    ("Porto.", "Porto", True),
    ("You live in porto now", "Porto", True),
    ("Portonovo", "Porto", False),   # a word, not a substring
    ("Lisbon, not Porto", "Porto", True),
    ("", "Porto", False),
])
def test_an_answer_is_right_when_it_holds_the_value_as_a_word(answer: str, expected: str, right: bool) -> None:
    assert correct(answer, expected) is right


def answer(text: str, top: float) -> Answer:
    logits = np.zeros(4, np.float32)
    logits[0], logits[1] = top, 0.5
    return Answer(text, 0, logits)


def test_the_summary_counts_discordant_pairs_ties_and_ratios() -> None:
    p = make_persona(0, words, 400)
    qs = p.questions
    # this way right on the first 4 questions; the oracle right on questions 2..5 (so b = 2, c = 2 discordant)
    ours = [answer(q.answer if i < 4 else "no", 3.0) for i, q in enumerate(qs)]
    oracle = [answer(q.answer if 2 <= i < 6 else "no", 3.0 if i else 0.7) for i, q in enumerate(qs)]
    run = WayRun("head", edit_tokens=[50, 60], edit_to_token_s=[0.1, 0.3], strategies=["a", "a"], answers=ours,
                 oracle=oracle, prompt_tokens=2000)
    base = WayRun("recompiled", edit_tokens=[2000, 2000], edit_to_token_s=[4.0, 4.0], answers=oracle, oracle=oracle)
    row = summarise("m", "head", [run], [p], [1900], [base])
    assert row["n_questions"] == 14 and row["accuracy"] == 4 / 14 and row["oracle_accuracy"] == 4 / 14
    assert (row["discordant_right_wrong"], row["discordant_wrong_right"]) == (2, 2) and row["mcnemar_p"] == 1.0
    assert row["agreement"] == 10 / 14  # questions 0, 1, 4, 5 differ
    assert row["near_ties"] == 1 and row["disagreements_on_near_ties"] == 1 and row["disagreements_clear"] == 3
    assert row["edit_tokens"] == 55 and row["tokens_ratio_vs_recompiled"] == pytest.approx(2000 / 55)
    assert row["ttft_speedup_vs_recompiled"] == pytest.approx(4.0 / 0.2)
    assert row["accuracy_ci"][0] < row["accuracy"] < row["accuracy_ci"][1]


@pytest.mark.parametrize(("text", "clipped"), [
    ("Otis. pembelian", "Otis."),              # Gemma-3's tokens past its end of turn are cut
    (" a nurse.", "a nurse."),
    ("Lisbon, Zurich, or Zurich? x", "Lisbon, Zurich, or Zurich?"),
    ("paella\nand more", "paella"),
    ("no end at all", "no end at all"),
    ("", ""),
])
def test_answers_are_clipped_at_their_first_sentence_end(text: str, clipped: str) -> None:
    assert clip_answer(text) == clipped


def test_score_counts_on_clipped_answers_and_refuses_unpaired_lists() -> None:
    got = score(["Porto. Lisbon", "Oslo.", "x"], ["Porto. Oslo", "Porto.", "Oslo"], ["Porto", "Oslo", "Oslo"],
                ["current", "earlier", "current"])
    assert got["accuracy"] == 2 / 3 and got["oracle_accuracy"] == 2 / 3  # "Lisbon" after the stop is not read
    assert got["agreement"] == 1 / 3 and (got["discordant_right_wrong"], got["discordant_wrong_right"]) == (1, 1)
    assert got["by_kind"]["earlier"] == {"n": 1, "accuracy": 1.0, "oracle_accuracy": 0.0}
    with pytest.raises(ValueError):
        score(["a"], [], ["a"], ["current"])


def test_rescoring_the_stored_answers_gives_the_runs_own_rows() -> None:
    p = make_persona(2, words, 400)
    ours = [answer(q.answer + ". noise" if i % 3 else "no", 3.0) for i, q in enumerate(p.questions)]
    oracle = [answer(q.answer + ". other" if i % 4 else "no", 3.0 if i % 2 else 0.2) for i, q in enumerate(p.questions)]
    run = WayRun("tail", edit_tokens=[20], edit_to_token_s=[0.2], answers=ours, oracle=oracle)
    row = summarise("m", "tail", [run], [p], [400])
    answers = [{"model": "m", "expected": q.answer, "kind": q.kind, "tail": a.text, "tail_oracle": o.text,
                "tail_oracle_margin": float(o.logits[0] - o.logits[1])} for q, a, o in zip(p.questions, ours, oracle)]
    again = rescore({"rows": [dict(row, accuracy=-1.0, agreement=-1.0)], "answers": answers})["rows"][0]
    assert again == row
    without = rescore({"rows": [row], "answers": [{k: v for k, v in a.items() if "margin" not in k} for a in answers]})
    assert "disagreements_clear" not in without["rows"][0] and without["rows"][0]["accuracy"] == row["accuracy"]
