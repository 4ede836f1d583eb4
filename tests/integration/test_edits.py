"""Field edits on the real backend, both models, each checked against a full recompute."""

from __future__ import annotations

import numpy as np
import pytest

from kvagent import Engine, KVAgentError, Segment, Session
from kvagent.edits import Erratum, Selective
from kvagent.edits.suite import TEMPLATES, make_cases, question_segments
from kvagent.errors import FieldValueError
from kvagent.fields import FieldSpec
from kvagent.skills.fidelity import cosine

# "shipped" and "cancelled" tokenize to as many tokens as "processing" on both models; "held at customs" is longer
LONGER = "held at customs"
STATUS = FieldSpec(name="order_status", allowed=("processing", "shipped", "delivered", "cancelled", LONGER),
                   initial="processing", template="Record: The order status is {value}.")
NOTES = Segment.memory("Notes: The customer prefers email. The parcel goes to a pick-up point near the station.")
POLICY = Segment.policy("Answer each question from the record above it.")


def open_session(engine: Engine, **kwargs: object) -> Session:
    kwargs.setdefault("edit_strategy", "erratum")  # the erratum's own tests; auto (the default) has its own
    s = engine.session([POLICY, STATUS.segment(), NOTES], chat=False, fields=[STATUS], share_prefix=False, **kwargs)  # type: ignore[arg-type]
    s.prefill()
    return s


def prefix_bytes(engine: Engine, session: Session, n: int) -> bytes:
    """The saved KV of the session's first ``n`` positions (shared into a scratch sequence)."""
    with engine.scratch() as scratch:
        engine.backend.seq_cp(session.seq, scratch, 0, n)
        return engine.backend.seq_save(scratch)


def cold(engine: Engine, segments: list[Segment], chat: bool = False) -> np.ndarray:
    with engine.session(segments, chat=chat, share_prefix=False) as s:
        return s.logits()


def assert_spans_cover(session: Session) -> None:
    covered = [p for sp in session.spans for p in range(sp.first, sp.last + 1)]
    assert covered == list(range(len(session.tokens)))
    assert [sp.segment_id for sp in session.spans] == [seg.id for seg in session.segments]


def test_erratum_appends_and_keeps_the_prefix_byte_identical(engine: Engine) -> None:
    with open_session(engine) as s:
        n = len(s.tokens)
        before = prefix_bytes(engine, s, n)
        report = s.set("order_status", "shipped", strategy="erratum")
        assert (report.strategy, report.reused) == ("erratum", n) and report.computed == len(s.tokens) - n > 0
        assert prefix_bytes(engine, s, n) == before
        assert s.segments[-1].kind.value == "erratum" and s.field_values["order_status"] == "shipped"
        assert_spans_cover(s)
        s.extend(*question_segments("Question: What is the order status?\nAnswer:"))
        assert cosine(s.logits(), cold(engine, list(s.segments))) >= 0.999


@pytest.mark.parametrize("value", ["shipped", LONGER])  # same and different token length as the initial
def test_splice_refreshing_everything_equals_recompute(engine: Engine, value: str) -> None:
    probe = question_segments("Question: What is the order status?\nAnswer:")
    with open_session(engine) as s:
        report = s.set("order_status", value, strategy=Selective(k=10**6))
        assert report.stale == 0 and not s.stale_positions
        assert_spans_cover(s)
        s.extend(*probe)
        spliced = s.logits()
    with open_session(engine) as s:
        s.set("order_status", value, strategy="recompute")
        s.extend(*probe)
        recomputed = s.logits()
        final = list(s.segments)
    reference = cold(engine, final)
    assert cosine(spliced, reference) >= 0.999 and cosine(recomputed, reference) >= 0.999


@pytest.mark.parametrize("value", ["shipped", LONGER])  # same and different token length
def test_field_only_keeps_downstream_stale_and_never_shares_it(engine: Engine, value: str) -> None:
    with open_session(engine) as s:
        old = s.rendered
        field_end = old.span_of("field-order_status").last
        s.set("order_status", value, strategy="field_only")
        new_end = s.rendered.span_of("field-order_status").last
        assert s.stale_positions == frozenset(range(new_end + 1, len(s.tokens)))
        assert s.tokens[new_end + 1 :] == old.tokens[field_end + 1 :]
        assert s.clean_prefix == new_end + 1
        assert_spans_cover(s)
        with engine.session(list(s.segments), chat=False) as other:  # may share only the clean prefix
            report = other.prefill()
            assert report.shared <= new_end + 1
        s.extend(*question_segments("Question: What is the order status?\nAnswer:"))
        assert s.logits().shape == (engine.backend.n_vocab,)  # decoding continues over shifted stale cells


def test_later_updates_supersede_earlier_ones(engine: Engine) -> None:
    with open_session(engine) as s:
        for value in ("shipped", "processing", "delivered"):
            s.set("order_status", value, strategy="erratum")
            assert s.field_values["order_status"] == value
        assert [seg.value for seg in s.segments if seg.kind.value == "erratum"] == ["shipped", "processing", "delivered"]


def test_compaction_rebuilds_the_recompute_state(engine: Engine) -> None:
    """Folding errata back gives exactly the prompt and KV a recompute of the same edits gives.

    Whether that keeps the errata version's *decision* is measured, not assumed: on these small models
    the erratum and the recompute disagree on 13-32% of flipped cases (BENCHMARKS.md), so a compaction
    changes those decisions too. Here it must match the recompute oracle, logit for logit.
    """
    template = TEMPLATES["multi"]
    with engine.session(chat=False, share_prefix=False) as s:
        for case in make_cases(template, 4, seed=3):
            s.replace(list(case.segments))
            s.set_many(case.changes, strategy="recompute")
            s.extend(*question_segments(case.question))
            oracle_tokens, oracle = s.tokens, s.logits()
            s.replace(list(case.segments))
            s.set_many(case.changes, strategy="erratum")  # one erratum per field
            report = s.compact()
            assert all(seg.kind.value != "erratum" for seg in s.segments) and report.computed > 0
            assert s.field_values == {**case.before, **case.changes}
            assert_spans_cover(s)
            s.extend(*question_segments(case.question))
            assert s.tokens == oracle_tokens
            assert cosine(s.logits(), oracle) >= 0.999


def test_compaction_runs_after_the_threshold(engine: Engine) -> None:
    with open_session(engine, compact_after=2) as s:
        for value in ("shipped", "delivered"):
            s.set("order_status", value)
        assert sum(seg.kind.value == "erratum" for seg in s.segments) == 2
        s.set("order_status", "cancelled")
        assert sum(seg.kind.value == "erratum" for seg in s.segments) == 0
        assert s.segments[1].text == "Record: The order status is cancelled."


@pytest.mark.parametrize(
    ("changes", "strategy", "error", "match"),
    [
        ({"order_id": "7"}, None, FieldValueError, "unknown field 'order_id': this session's fields are order_status"),
        ({"order_status": "lost"}, None, FieldValueError, "does not allow 'lost'"),
        ({"order_status": "shipped", "order_id": 1}, None, FieldValueError, "unknown field 'order_id'"),
        ({"order_status": "shipped"}, "telepathy", KVAgentError, "unknown edit strategy 'telepathy'"),
        ({}, None, FieldValueError, "no field to set"),
    ],
)
def test_bad_edits_change_nothing(engine: Engine, changes: dict[str, object], strategy: str | None, error: type, match: str) -> None:
    with open_session(engine) as s:
        tokens, segments, kv = s.tokens, s.segments, prefix_bytes(engine, s, len(s.tokens))
        with pytest.raises(error, match=match):
            s.set_many(changes, strategy=strategy)
        assert (s.tokens, s.segments) == (tokens, segments)
        assert prefix_bytes(engine, s, len(s.tokens)) == kv


def test_erratum_template_is_configurable(engine: Engine) -> None:
    with open_session(engine, edit_strategy=Erratum(template="UPDATE {name}={value}")) as s:
        s.set("order_status", "shipped")
        assert s.segments[-1].text == "UPDATE order_status=shipped"


def test_refused_session_arguments_do_not_leak_sequences(engine: Engine) -> None:
    free = engine.pool.free
    for kwargs in ({"edit_strategy": "nope"}, {"compact_after": 0}):
        with pytest.raises((KVAgentError, ValueError)):
            engine.session([POLICY], **kwargs)  # type: ignore[arg-type]
    assert engine.pool.free == free


# --- no silent fallbacks: the report names what ran and why, the log says it once ---------------
def _long_notes(engine: Engine, n_tokens: int) -> Segment:
    from kvagent.data import load_prose

    words = load_prose()["pride_and_prejudice"].split()
    text, count = [], 0
    for i in range(0, len(words), 50):
        chunk = " ".join(words[i : i + 50])
        text.append(chunk)
        count += len(engine.backend.tokenize(chunk, special=False))
        if count >= n_tokens:
            break
    return Segment.memory(" ".join(text))


@pytest.mark.arch  # Gemma-3: its sliding window downstream
def test_a_splice_that_cannot_be_exact_reports_the_recompute_and_warns_once(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """After eviction (both models) and, on Gemma-3, with more than its sliding window downstream, a
    field-only edit recomputes from the field: the report names ``recompute``, what was asked and why, and
    the second edit does not warn again. A splice that can be exact reports itself with no reason."""
    from kvagent import Eviction

    with open_session(engine) as s:
        report = s.set("order_status", "shipped", strategy="field_only")
        assert (report.strategy, report.requested, report.reason) == ("field_only", "field_only", None)
    long_notes = _long_notes(engine, 700)
    cases = [("evicted", {"eviction": Eviction("window", budget=400, chunk=64)})]
    if engine.backend.n_swa and not engine.backend.capabilities.swa_keeps_all:  # an unpatched llama.cpp
        cases.append(("sliding window", {}))
    for why, kwargs in cases:
        caplog.clear()
        with engine.session([POLICY, STATUS.segment(), long_notes], chat=False, fields=[STATUS], share_prefix=False,
                            **kwargs) as s:  # type: ignore[arg-type]
            s.prefill()
            first = s.set("order_status", "shipped", strategy="field_only")
            second = s.set("order_status", "delivered", strategy="field_only")
        assert (first.strategy, first.requested) == ("recompute", "field_only")
        assert first.reason is not None and why in first.reason and second.reason == first.reason
        warnings = [r for r in caplog.records if r.levelname == "WARNING" and "cannot be spliced" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]


# --- splices behind Gemma-3's sliding window (native/patches/llama.cpp-swa-full.patch) ----
def past_the_window(engine: Engine) -> int:
    """Tokens of notes that put more than the sliding window (Gemma-3: 512) downstream of the field: 900. A model
    without one (SmolLM2) has no window to be behind: it runs the same edits over 200 tokens of notes, checked
    against a cold run alike (63 s on SmolLM2 with 900 tokens for the three tests below)."""
    return 900 if engine.backend.n_swa else 200


@pytest.mark.arch
def test_the_build_keeps_every_sliding_window_cell(engine: Engine) -> None:
    """kvagent's set-up builds llama.cpp with its patch: a full-size sliding-window cache keeps every cell, so
    splices behind the window are exact. An unpatched llama-cpp-python fails here (and edits behind the
    window then recompute, as their reports say)."""
    from kvagent.backends.llama_cpp import swa_patched

    assert swa_patched(), "llama-cpp-python was not built by `make setup` (scripts/build_llama_wheel.sh)"
    assert engine.backend.capabilities.swa_keeps_all


@pytest.mark.arch
# same and different token length (the longer one in the full tier: the fast tier's budget)
@pytest.mark.parametrize("value", ["shipped", pytest.param(LONGER, marks=pytest.mark.full)])
def test_a_splice_behind_the_sliding_window_is_exact_after_the_session_grew(engine: Engine, value: str) -> None:
    """More than the sliding window (Gemma-3: 512) downstream of the field: a field-only edit, then a turn
    appended (unpatched, llama.cpp reuses the cells behind the window here and drops every earlier position
    of the sequence's SWA cache), then a splice refreshing every downstream position: it runs as a splice
    (no recompute), the sequence still holds position 0, and the logits equal a cold run (>= 0.999)."""
    probe = question_segments("Question: What is the order status?\nAnswer:")
    notes = _long_notes(engine, past_the_window(engine))
    with engine.session([POLICY, STATUS.segment(), notes], chat=False, fields=[STATUS], share_prefix=False) as s:
        s.prefill()
        first = s.set("order_status", "delivered", strategy="field_only")
        s.extend(Segment.memory("Note: the customer called twice about the parcel."))
        second = s.set("order_status", value, strategy=Selective(k=10**6))
        assert (first.strategy, second.strategy, second.reason) == ("field_only", "selective", None)
        assert engine.backend.seq_pos_range(s.seq)[0] == 0
        s.extend(*probe)
        got, segments = s.logits(), list(s.segments)
    assert cosine(got, cold(engine, segments)) >= 0.999


@pytest.mark.arch
def test_a_save_behind_the_sliding_window_restores_and_splices_exactly(engine: Engine) -> None:
    """A saved long session keeps its sliding-window cells behind the window: after a restore a full-refresh
    splice runs as a splice and equals a cold run (unpatched, the save keeps only the window and the edit
    recomputes from 0)."""
    notes = _long_notes(engine, past_the_window(engine))
    with engine.session([POLICY, STATUS.segment(), notes], chat=False, fields=[STATUS], share_prefix=False) as s:
        s.prefill()
        segments, blob = list(s.segments), s.save()
        s.set("order_status", "cancelled", strategy="recompute")
        s.restore(blob, segments)
        report = s.set("order_status", "shipped", strategy=Selective(k=10**6))
        assert (report.strategy, report.reason) == ("selective", None)
        s.extend(*question_segments("Question: What is the order status?\nAnswer:"))
        got, final = s.logits(), list(s.segments)
    assert cosine(got, cold(engine, final)) >= 0.999


# --- fields anywhere: after few-shot turns, as a tool result; every strategy -----------------------
SHOTS = [Segment.user("Record: The order status is processing. What should I tell the customer?"),
         Segment.assistant("That the order is being prepared.")]


def late_field_session(engine: Engine, role: str) -> Session:
    """Policy, two few-shot turns, then the field (a later system message, a tool result in a user turn, or
    inside a user turn's text: ``inline``), then notes: the field stands after turns."""
    if role == "inline":
        field = Segment.message("user", "The tracking lookup says:", STATUS.segment(), " What should I tell them?")
    else:
        field = (STATUS.segment(role=role),)
    segs = [POLICY, *SHOTS, *field, NOTES]
    s = engine.session(segs, chat=True, fields=[STATUS], share_prefix=False)
    s.prefill()
    return s


@pytest.mark.parametrize("role", ["system", "user", "inline"])
@pytest.mark.parametrize("strategy", ["erratum", "recompute", "field_only", "selective", "all"])
def test_a_field_after_turns_is_edited_by_every_strategy(engine: Engine, strategy: str, role: str) -> None:
    """The prompt after the edit is the one the strategy says it holds: recompute and a splice refreshing
    every downstream position equal a cold run of it (>= 0.999); the erratum appends and keeps the prefix;
    field-only and selective keep the downstream as they say (stale)."""
    probe = question_segments("Question: What is the order status?\nAnswer:")
    with late_field_session(engine, role) as s:
        n = len(s.tokens)
        chosen = Selective(k=10**6) if strategy == "all" else strategy
        report = s.set("order_status", "shipped", strategy=chosen)
        assert s.field_values["order_status"] == "shipped"
        assert report.reason is None or (strategy == "selective" and "not calibrated" in report.reason)
        assert_spans_cover(s)
        if strategy == "erratum":
            assert report.reused == n and s.segments[-1].kind.value == "erratum"
        elif strategy in ("field_only", "selective"):
            field = s.rendered.span_of("field-order_status")
            assert s.stale_positions and min(s.stale_positions) > field.last
        s.extend(*probe)
        got = s.logits()
        segments = list(s.segments)
    if strategy in ("erratum", "recompute", "all"):
        assert cosine(got, cold(engine, segments, chat=True)) >= 0.999
    else:
        assert np.isfinite(got).all()


# --- combined edit: the field rewritten in place and the erratum appended -----------------------
@pytest.mark.parametrize("splice", ["field_only", "all"])
def test_combined_rewrites_the_field_and_appends_the_erratum(engine: Engine, splice: str) -> None:
    """The prompt holds the new value in the field and in an erratum at the end; with a splice that refreshes
    every downstream position (``Selective(k=10**6)``) nothing is stale and the logits equal a cold run of the
    same segments; with the field-only splice the downstream stays stale and decoding continues over it."""
    from kvagent.edits import Combined

    probe = question_segments("Question: What is the order status?\nAnswer:")
    strategy = Combined(splice=Selective(k=10**6)) if splice == "all" else "combined"
    with open_session(engine) as s:
        n = len(s.tokens)
        report = s.set("order_status", "cancelled", strategy=strategy)
        assert (report.strategy, report.requested, report.reason) == ("combined", "combined", None)
        field, last = s.segments[1], s.segments[-1]
        assert (field.kind.value, field.value, field.text) == ("field", "cancelled", "Record: The order status is cancelled.")
        assert (last.kind.value, last.value) == ("erratum", "cancelled") and s.field_values["order_status"] == "cancelled"
        assert report.computed >= s.rendered.span_of(last.id).length and report.reused <= n
        assert_spans_cover(s)
        if splice == "all":
            assert not s.stale_positions
        else:
            erratum = s.rendered.span_of(last.id)
            assert s.stale_positions and max(s.stale_positions) < erratum.first
        s.extend(*probe)
        got = s.logits()
        segments = list(s.segments)
    assert np.isfinite(got).all()
    if splice == "all":
        assert cosine(got, cold(engine, segments)) >= 0.999


# --- erratum renderings: each one edits and decodes ------------------------------------------------
@pytest.mark.parametrize("rendering", ["system", "user", "record", "correction", "tagged"])
def test_each_erratum_rendering_edits_and_decodes(engine: Engine, rendering: str) -> None:
    """On SmolLM2 (chat template, the field a later system message): the erratum is appended with its
    rendering's text and role, the prefix is kept, and the next turn's logits equal a cold run."""
    if engine.model.name != "smollm2-135m":  # type: ignore[attr-defined]
        pytest.skip("one model is enough for the renderings' plumbing")
    expected = {
        "system": ("system", "[STATE UPDATE] order_status -> shipped; overrides any previous value"),
        "user": ("user", "[STATE UPDATE] order_status -> shipped; overrides any previous value"),
        "record": ("system", "Record: The order status is shipped."),
        "correction": ("system", "Correction: order_status is now shipped."),
        "tagged": ("system", "<update>order_status=shipped</update>"),
    }[rendering]
    with late_field_session(engine, "system") as s:
        n = len(s.tokens)
        report = s.set("order_status", "shipped", strategy=Erratum(rendering=rendering))
        assert report.reused == n and (s.segments[-1].role, s.segments[-1].text) == expected
        assert_spans_cover(s)
        s.extend(*question_segments("Question: What is the order status?\nAnswer:"))
        got = s.logits()
        segments = list(s.segments)
    assert cosine(got, cold(engine, segments, chat=True)) >= 0.999


# --- auto: the table's choice per format and situation, and the reason ------------------------------
def test_auto_picks_the_exact_splice_or_the_erratum_by_situation(engine: Engine, tmp_path: object) -> None:
    """With a table that says field_only where the splice can be exact and the ``correction`` erratum where it
    cannot: a short prompt is spliced, one whose downstream was evicted gets the erratum; ``splice_refusal``
    and ``prompt_format`` say what auto reads. The format keys the table: a chat session finds no entry."""
    import json
    from pathlib import Path

    from kvagent import Eviction
    from kvagent.edits import Auto

    table = Path(str(tmp_path)) / "auto.json"
    entry = {"exact": "field_only", "inexact": "erratum", "rendering": "correction", "measured": {}}
    table.write_text(json.dumps({"models": {"m": {"fingerprint": engine.fingerprint, "formats": {"plain": entry}}}}))
    with open_session(engine) as s:
        assert s.prompt_format == "plain" and s.splice_refusal("order_status", "shipped") is None
        report = s.set("order_status", "shipped", strategy=Auto(table=table))
        assert (report.strategy, report.requested) == ("field_only", "auto") and "splice can be exact" in str(report.reason)
        assert s.stale_positions and s.segments[-1].kind.value == "memory"
    with engine.session([POLICY, STATUS.segment(), _long_notes(engine, 700)], chat=False, fields=[STATUS],
                        share_prefix=False, eviction=Eviction("window", budget=400, chunk=64)) as s:
        s.prefill()
        assert "evicted" in str(s.splice_refusal("order_status", "shipped"))
        report = s.set("order_status", "shipped", strategy=Auto(table=table))
        assert (report.strategy, report.requested) == ("erratum", "auto") and "cannot be exact" in str(report.reason)
        assert s.segments[-1].text == "Correction: order_status is now shipped."
        s.extend(*question_segments("Question: What is the order status?\nAnswer:"))
        assert np.isfinite(s.logits()).all()
    with late_field_session(engine, "system") as s:
        assert s.prompt_format == "chat"
        report = s.set("order_status", "shipped", strategy=Auto(table=table))
        assert report.strategy == "recompute" and "no edit calibration" in str(report.reason)


def test_auto_with_the_shipped_table_runs_and_says_why(engine: Engine) -> None:
    with open_session(engine) as s:
        report = s.set("order_status", "shipped", strategy="auto")
        assert report.requested == "auto" and str(report.reason).startswith("auto: ")
        assert s.field_values["order_status"] == "shipped"
        assert_spans_cover(s)
