"""Field specs, strategy lookup and the selective ranking (pure logic)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvagent.edits import STRATEGIES, Erratum, FieldOnly, Recompute, Selective, get_strategy
from kvagent.edits.selective import OffsetRanker
from kvagent.errors import FieldValueError, KVAgentError
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


# (id, k, offsets, calibrated, expect a reason): selective says when it runs on defaults (issue 14)
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
    from kvagent.edits.calibration import Calibration, save_calibration

    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path))
    fingerprint = f"model-{calibrated}-{k}-{offsets}"
    if calibrated:
        save_calibration(fingerprint, Calibration(2, (1,), 0.9, 10))
    got = Selective(k=k, offsets=offsets).uncalibrated(SimpleNamespace(model_fingerprint=fingerprint))  # type: ignore[arg-type]
    assert (got is not None) == reason
    if reason:
        assert "kvagent edits calibrate" in got  # type: ignore[operator]
