"""``kvagent bench edit``'s rows: split and format keys, what auto ran (pure logic, no model)."""

from __future__ import annotations

import pytest

from kvagent.edits import Combined, Erratum
from kvagent.edits.suite import TEMPLATES, make_cases
from kvagent_bench.edit import STRATEGIES, CaseResult, _strategy, summarise
from kvagent_bench.edit_heldout import make_heldout_cases

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def result(before: str, oracle: str, auto: str, ran: str) -> CaseResult:
    r = CaseResult(before, 2.0, oracle, 2.0, oracle, 1.0, truth=oracle)
    for s in STRATEGIES:
        r.decisions[s], r.seconds[s], r.ran[s] = oracle, 0.1, s
    r.decisions["auto"], r.ran["auto"] = auto, ran
    return r


def test_rows_carry_split_format_and_what_auto_ran() -> None:
    results = [result("a", "b", "b", "field_only"), result("a", "b", "a", "erratum"), result("b", "b", "b", "field_only")]
    rows = summarise("m", "tool", results, STRATEGIES, split="test", format="chat", downstream="long")
    assert [r["strategy"] for r in rows] == list(STRATEGIES)
    auto = next(r for r in rows if r["strategy"] == "auto")
    assert (auto["split"], auto["format"], auto["downstream"], auto["n_flips"], auto["recovery"]) == ("test", "chat", "long", 2, 0.5)
    assert auto["ran"] == {"field_only": 2, "erratum": 1}
    assert summarise("m", "lookup", results, STRATEGIES)[0]["split"] == "calibration"


def test_erratum_templates_apply_on_the_calibration_split_only() -> None:
    calibration = make_cases(TEMPLATES["lookup"], 1)[0]
    test = make_heldout_cases("tool", 1)[0]
    erratum, combined = _strategy(calibration, "erratum"), _strategy(calibration, "combined")
    assert isinstance(erratum, Erratum) and erratum.per_field == calibration.erratum_templates != {}
    assert isinstance(combined, Combined) and combined.erratum.per_field == calibration.erratum_templates
    assert _strategy(test, "erratum") == Erratum() and _strategy(test, "auto") == "auto"


def test_the_calibration_split_has_no_long_downstream_and_bad_options_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvagent_bench.edit import run
    from kvagent_bench.edit_heldout import split_cases

    assert {c.downstream for c in split_cases("test", "tool", 2, downstream="long")} == {"long"}
    with pytest.raises(ValueError, match="short-downstream cases only"):
        split_cases("calibration", "lookup", 2, downstream="long")
    for kwargs, match in (({"downstreams": ["medium"]}, "unknown medium"), ({"splits": ["dev"]}, "unknown dev")):
        with pytest.raises(ValueError, match=match):
            run([], 1, 0, 1, tmp_path / "x.json", "test", **kwargs)  # type: ignore[arg-type]
