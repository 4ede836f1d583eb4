"""Field specs, strategy lookup and the selective ranking (pure logic)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvagent.edits import STRATEGIES, Erratum, FieldOnly, Recompute, Selective, get_strategy
from kvagent.edits.selective import OffsetRanker
from kvagent.errors import FieldValueError, KVAgentError
from kvagent.kv.work import drive
from kvagent.fields import FieldSpec
from kvagent.segments import Rendered, SegmentKind, Span

STATUS = FieldSpec(name="status", allowed=("processing", "shipped"), initial="processing")
COUNT = FieldSpec(name="count", type="int", initial=3)


@pytest.mark.parametrize(
    ("spec", "value", "expected"),
    [(STATUS, "shipped", "shipped"), (COUNT, "7", 7), (COUNT, 4, 4),
     (FieldSpec(name="vip", type="bool", initial=False), True, True),
     (FieldSpec(name="ratio", type="float", initial=0.5), 2, 2.0)],
)
def test_check_coerces(spec: FieldSpec, value: object, expected: object) -> None:
    assert spec.check(value) == expected


@pytest.mark.parametrize(
    ("spec", "value", "match"),
    [(STATUS, "lost", "does not allow 'lost': use one of 'processing', 'shipped'"),
     (COUNT, "seven", "takes a int"), (COUNT, True, "takes a int")],
)
def test_check_refuses(spec: FieldSpec, value: object, match: str) -> None:
    with pytest.raises(FieldValueError, match=match):
        spec.check(value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"name": "status", "allowed": ("a",), "initial": "b"}, "does not allow"),
     ({"name": "bad name", "initial": 1}, "name"), ({"name": "x", "initial": 1, "colour": "red"}, "colour")],
)
def test_spec_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises((ValidationError, FieldValueError), match=match):
        FieldSpec(**kwargs)  # type: ignore[arg-type]


def test_spec_segment_renders_with_template() -> None:
    spec = FieldSpec(name="status", initial="processing", template="The order is {value}.")
    seg = spec.segment()
    assert (seg.kind, seg.text, seg.value, seg.id) == (SegmentKind.FIELD, "The order is processing.", "processing", "field-status")
    assert seg.with_value("shipped").text == "The order is shipped." and seg.with_value("shipped").id == seg.id


@pytest.mark.parametrize(("name", "cls"), [("erratum", Erratum), ("recompute", Recompute), ("field_only", FieldOnly), ("selective", Selective)])
def test_get_strategy(name: str, cls: type) -> None:
    assert isinstance(get_strategy(name), cls) and get_strategy(get_strategy(name)).name == name


def test_unknown_strategy_lists_valid_ones() -> None:
    with pytest.raises(KVAgentError, match="unknown edit strategy 'magic': use one of " + ", ".join(STRATEGIES)):
        get_strategy("magic")


@pytest.mark.parametrize(
    ("offsets", "expected"),
    [((), [5, 6, 7, 8, 9]), ((3, 1), [7, 5, 6, 8, 9]), ((99, 2), [6, 5, 7, 8, 9])],
)
def test_offset_ranker(offsets: tuple[int, ...], expected: list[int]) -> None:
    rendered = Rendered(tuple(range(10)), (Span("a", SegmentKind.POLICY, 0, 3, True), Span("f", SegmentKind.FIELD, 4, 4, True),
                                           Span("m", SegmentKind.MEMORY, 5, 9, False)))
    assert OffsetRanker(offsets).rank(rendered, rendered.spans[1]) == expected


# (id, k, offsets, calibrated, expect a reason): selective says when it runs on defaults
UNCALIBRATED_CASES = [
    ("defaults-uncalibrated", None, None, False, True),
    ("defaults-calibrated", None, None, True, False),
    ("explicit-k-and-offsets", 3, (1, 2), False, False),
    ("explicit-k-only", 3, None, False, False),
    ("explicit-offsets-only", None, (1, 2), False, True),
]


@pytest.mark.parametrize(("k", "offsets", "calibrated", "reason"), [c[1:] for c in UNCALIBRATED_CASES],
                         ids=[c[0] for c in UNCALIBRATED_CASES])
def test_selective_names_an_uncalibrated_run(monkeypatch: pytest.MonkeyPatch, tmp_path: object, k: int | None,
                                             offsets: tuple[int, ...] | None, calibrated: bool, reason: bool) -> None:
    from types import SimpleNamespace

    from kvagent.edits import Selective
    from kvagent.edits.selective_calibration import Calibration, save_calibration

    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path))
    fingerprint = f"model-{calibrated}-{k}-{offsets}"
    if calibrated:
        save_calibration(fingerprint, Calibration(2, (1,), 0.9, 10))
    got = Selective(k=k, offsets=offsets).uncalibrated(SimpleNamespace(model_fingerprint=fingerprint))  # type: ignore[arg-type]
    assert (got is not None) == reason
    if reason:
        assert "kvagent edits calibrate" in got  # type: ignore[operator]


class FakeTarget:
    """An EditTarget that records the calls; ``splice_because`` makes every splice report a recompute."""

    model_fingerprint = "fake"

    def __init__(self, splice_because: str | None = None) -> None:
        from kvagent.segments import Segment

        self.calls: list[str] = []
        self._segments = [Segment.policy("p", id="p"), Segment.field("status", "a", id="f", template="S: {value}")]
        self.splice_because = splice_because

    segments = property(lambda self: tuple(self._segments))
    stale_positions = property(lambda self: frozenset({5, 6}))

    def _report(self, computed: int, because: str | None = None):  # type: ignore[no-untyped-def]
        from kvagent.kv.sync import PrefillReport

        return PrefillReport(reused=10, computed=computed, seconds=0.01, recomputed_because=because)

    # units of work, as the session's (kvagent.kv.work): they pause once, so a strategy must ``yield from`` them
    def extend_work(self, segments):  # type: ignore[no-untyped-def]
        yield
        self.calls.append("extend")
        self._segments += segments
        return self._report(len(segments) * 7)

    def replace_work(self, segments):  # type: ignore[no-untyped-def]
        yield
        self.calls.append("replace")
        self._segments = list(segments)
        return self._report(20)

    def splice_field_work(self, name, value, refresh=None):  # type: ignore[no-untyped-def]
        yield
        self.calls.append(f"splice {name}={value}")
        return self._report(3, self.splice_because)

    prompt_format = "plain"
    refusal: str | None = None  # what splice_refusal answers

    def splice_refusal_work(self, name, value):  # type: ignore[no-untyped-def]
        yield
        self.calls.append(f"refusal {name}")
        return self.refusal


@pytest.mark.parametrize(("because", "ran"), [(None, "combined"), ("the downstream KV was partly evicted", "recompute+erratum")])
def test_combined_splices_then_appends_and_names_a_fallback(because: str | None, ran: str) -> None:
    from kvagent.edits import Combined

    target = FakeTarget(because)
    report = drive(get_strategy("combined").apply(target, {"status": "b"}))  # type: ignore[arg-type]
    assert isinstance(get_strategy("combined"), Combined)
    assert target.calls == ["splice status=b", "extend"] and target.segments[-1].kind is SegmentKind.ERRATUM
    assert (report.strategy, report.requested, report.computed) == (ran, "combined", 3 + 7)
    assert report.reason == (None if because is None else f"status: {because}")


def _rendered_erratum(target: FakeTarget) -> str:
    """The last segment as the fake chat format renders it (``<role>text</role>``, one char a token)."""
    from kvagent.segments import Renderer
    from tests.unit.test_segments import FMT, CharTokenizer

    rendered = Renderer(CharTokenizer(), FMT).render(list(target.segments))
    span = rendered.spans[-1]
    return "".join(chr(abs(t)) for t in rendered.tokens[span.first : span.last + 1])


@pytest.mark.parametrize(
    ("rendering", "field_role", "expected"),
    [
        ("system", "system", "<system>[STATE UPDATE] status -> b; overrides any previous value</system>"),
        ("user", "system", "<user>[STATE UPDATE] status -> b; overrides any previous value</user>"),
        ("record", "system", "<system>S: b</system>"),
        ("record", "user", "<user>S: b</user>"),  # the field's own line, in the field's role
        ("correction", "system", "<system>Correction: status is now b.</system>"),
        ("tagged", "system", "<system><update>status=b</update></system>"),
    ],
)
def test_erratum_renderings(rendering: str, field_role: str, expected: str) -> None:
    import dataclasses

    target = FakeTarget()
    target._segments[1] = dataclasses.replace(target._segments[1], role=field_role)
    report = drive(Erratum(rendering=rendering).apply(target, {"status": "b"}))  # type: ignore[arg-type]
    last = target.segments[-1]
    assert report.strategy == "erratum" and (last.kind, last.name, last.value) == (SegmentKind.ERRATUM, "status", "b")
    assert _rendered_erratum(target) == expected


def test_erratum_default_is_the_system_state_update_and_templates_override_the_line() -> None:
    target = FakeTarget()
    drive(Erratum().apply(target, {"status": "b"}))  # type: ignore[arg-type]
    assert _rendered_erratum(target) == "<system>[STATE UPDATE] status -> b; overrides any previous value</system>"
    drive(Erratum(template="U {name}={value}", rendering="user").apply(target, {"status": "c"}))  # type: ignore[arg-type]
    assert _rendered_erratum(target) == "<user>U status=c</user>"
    drive(Erratum(per_field={"status": "now {value}"}, rendering="tagged").apply(target, {"status": "d"}))  # type: ignore[arg-type]
    assert _rendered_erratum(target) == "<system>now d</system>"
    with pytest.raises(KVAgentError, match="unknown erratum rendering 'shout': use one of system, user, record"):
        Erratum(rendering="shout")


# --- auto: the choice table decides per model, format and situation ---------------------------
def _m(recovery: float | None, accuracy: float, n_flips: int = 20) -> dict[str, object]:
    return {"recovery": recovery, "accuracy": accuracy, "n_flips": n_flips, "n_cases": 36}


@pytest.mark.parametrize(
    ("measured", "expected"),
    [
        # field_only holds: it is the cheapest; the best rendering holds too
        ({"field_only": _m(1.0, 0.9), "combined": _m(1.0, 0.9), "erratum:system": _m(0.5, 0.6),
          "erratum:record": _m(0.97, 0.9)}, {"exact": "field_only", "inexact": "erratum", "rendering": "record"}),
        # field_only misses, combined holds; no rendering holds: recompute where the splice cannot be exact
        ({"field_only": _m(0.8, 0.9), "combined": _m(0.96, 0.89), "erratum:system": _m(0.5, 0.6),
          "erratum:tagged": _m(0.7, 0.6)}, {"exact": "combined", "inexact": "recompute", "rendering": "tagged"}),
        # recovery enough but accuracy more than 0.02 below the oracle's (0.9): does not hold
        ({"field_only": _m(0.96, 0.85), "erratum:user": _m(1.0, 0.88)},
         {"exact": "erratum", "inexact": "erratum", "rendering": "user"}),
        # an after-question placement is measured only, never chosen (set() appends before the question)
        ({"field_only": _m(0.8, 0.9), "erratum:system": _m(0.5, 0.6), "erratum:system@after": _m(1.0, 0.9)},
         {"exact": "recompute", "inexact": "recompute", "rendering": "system"}),
        # too few flips to count: nothing holds
        ({"field_only": _m(1.0, 0.9, n_flips=3), "erratum:system": _m(1.0, 0.9, n_flips=3)},
         {"exact": "recompute", "inexact": "recompute", "rendering": "system"}),
    ],
)
def test_choose_auto(measured: dict[str, dict[str, object]], expected: dict[str, str]) -> None:
    from kvagent.edits.calibrate import choose_auto

    assert choose_auto(measured, oracle_accuracy=0.9) == expected  # type: ignore[arg-type]


def _entry(exact: str, n_flips: int, **extra: object) -> dict[str, object]:
    return {"exact": exact, "inexact": "recompute", "measured": {"field_only": _m(None if n_flips == 0 else 1.0, 0.5, n_flips)},
            **extra}


@pytest.mark.parametrize(
    ("formats", "expected"),
    [
        # chat gave no flips: it takes plain's splice, and says where from
        ({"plain": _entry("field_only", 30), "chat": _entry("recompute", 0)},
         {"plain": ("field_only", None), "chat": ("field_only", "plain")}),
        # selective is borrowed with its K and offsets
        ({"plain": _entry("selective", 30, selective={"k": 6, "offsets": [1]}), "chat": _entry("recompute", 2)},
         {"plain": ("selective", None), "chat": ("selective", "plain")}),
        # enough flips and recompute chosen: measured, so kept
        ({"plain": _entry("field_only", 30), "chat": _entry("recompute", 12)},
         {"plain": ("field_only", None), "chat": ("recompute", None)}),
        # the donor's choice is an erratum: never borrowed (its effect is the wording's)
        ({"plain": _entry("erratum", 30), "chat": _entry("recompute", 0)},
         {"plain": ("erratum", None), "chat": ("recompute", None)}),
        # nothing measured anywhere
        ({"plain": _entry("recompute", 1), "chat": _entry("recompute", 0)},
         {"plain": ("recompute", None), "chat": ("recompute", None)}),
    ],
)
def test_a_format_without_flips_borrows_a_splice(formats: dict[str, dict[str, object]],
                                                 expected: dict[str, tuple[str, str | None]]) -> None:
    from kvagent.edits.calibrate import borrow_exact

    out = borrow_exact(formats)
    assert {f: (e["exact"], e.get("borrowed_from")) for f, e in out.items()} == expected
    if out["chat"].get("borrowed_from") and out["chat"]["exact"] == "selective":
        assert out["chat"]["selective"] == {"k": 6, "offsets": [1]}
    assert formats["chat"]["exact"] == _entry("recompute", 0)["exact"]  # the input is left as it was


def test_a_borrowed_choice_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvagent.edits import Auto

    target = FakeTarget()
    target.refusal, target.prompt_format = None, "plain"
    report = drive(Auto(table=_table(tmp_path, _entry("field_only", 0, borrowed_from="chat"))).apply(target, {"status": "b"}))  # type: ignore[arg-type]
    assert report.strategy == "field_only" and report.reason is not None
    assert "held on the calibration for tiny (chat; the plain format gave too few flips" in report.reason


def _table(tmp_path, entry: dict[str, object]) -> str:  # type: ignore[no-untyped-def]
    import json

    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"models": {"tiny": {"fingerprint": "fake", "formats": {"plain": entry}}}}))
    return str(path)


ENTRY = {"exact": "field_only", "inexact": "erratum", "rendering": "correction",
         "measured": {"field_only": _m(1.0, 0.9, 24), "erratum:correction": _m(0.96, 0.9, 24)}}


@pytest.mark.parametrize(
    ("entry", "refusal", "fmt", "ran", "why"),
    [
        (ENTRY, None, "plain", "field_only", "the splice can be exact; field_only held on the calibration for tiny (plain): "
                                             "recovery 1.00 on 24 flips"),
        (ENTRY, "the downstream KV was partly evicted", "plain", "erratum",
         "the splice cannot be exact (status: the downstream KV was partly evicted); the erratum rendered as 'correction' held"),
        ({**ENTRY, "inexact": "recompute"}, "past the sliding window", "plain", "recompute",
         "no erratum rendering held on the calibration for tiny (plain"),
        ({**ENTRY, "exact": "recompute"}, None, "plain", "recompute", "no cheaper strategy held"),
        (ENTRY, None, "chat", "recompute", "no edit calibration for this model in the chat format"),
    ],
)
def test_auto_chooses_from_the_table_and_says_why(tmp_path, entry, refusal, fmt, ran, why) -> None:  # type: ignore[no-untyped-def]
    from kvagent.edits import Auto

    target = FakeTarget()
    target.refusal, target.prompt_format = refusal, fmt
    report = drive(Auto(table=_table(tmp_path, entry)).apply(target, {"status": "b"}))  # type: ignore[arg-type]
    assert (report.strategy, report.requested) == (ran, "auto")
    assert report.reason is not None and report.reason.startswith("auto: ") and why in report.reason, report.reason
    if ran == "erratum":
        assert target.segments[-1].text == "Correction: status is now b."


def test_the_choice_table_is_parsed_once_per_file_version(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import json
    import os

    from kvagent.edits import auto

    path = _table(tmp_path, ENTRY)
    reads: list[str] = []
    real = auto.load_table
    monkeypatch.setattr(auto, "load_table", lambda p=None: reads.append(str(p)) or real(p))
    first = auto.current_table(path)
    assert auto.current_table(path) is first and len(reads) == 1
    table = json.loads(open(path).read())
    table["models"]["tiny"]["formats"]["plain"]["exact"] = "recompute"
    with open(path, "w") as f:
        f.write(json.dumps(table))
    os.utime(path, ns=(1, 1))  # a new version even where the clock is coarse
    assert auto.current_table(path)["models"]["tiny"]["formats"]["plain"]["exact"] == "recompute" and len(reads) == 2
    assert auto.current_table(tmp_path / "missing.json") == {"models": {}}


def test_auto_is_registered_and_the_shipped_table_loads() -> None:
    from kvagent.edits import Auto
    from kvagent.edits.auto import load_table, shipped_table_path

    assert isinstance(get_strategy("auto"), Auto) and shipped_table_path().name == "auto.json"
    table = load_table()
    for name, model in table["models"].items():
        assert model["fingerprint"] and model["formats"], name
        for entry in model["formats"].values():
            assert entry["exact"] in ("field_only", "selective", "combined", "erratum", "recompute")
            assert entry["inexact"] in ("erratum", "recompute")
