"""Causal probes of "Models Take Notes at Prefill" (arXiv:2606.17107) on the torch reference
(kvagent_bench.probes), both models.

Small real cases: edit-suite prompts (about 250 tokens, 40-55 downstream positions) rendered as an
edit session renders them. Each probe costs one question-length forward (~0.1 s on one core).
"""

from __future__ import annotations

import json
import random
from typing import Iterator

import pytest

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from kvagent.errors import KVAgentError, ProbeInputError  # noqa: E402
from kvagent_bench.probes import MODES, NotesProbe, ProbeCase  # noqa: E402

_PROBES: dict[tuple[str, str], NotesProbe] = {}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread: steadier than two spinning threads on a shared two-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def notes_probe(engine, reference, template: str) -> NotesProbe:
    """The first edit-suite case of ``template`` with an equal-length new value (memoised per model)."""
    from kvagent.edits.suite import TEMPLATES, Decider, make_cases
    from kvagent_bench.probe_notes import SEED, split_case

    key = (engine.model.name, template)
    if key not in _PROBES:
        t = TEMPLATES[template]
        decide = Decider.build(engine, t.answers)
        for i, case in enumerate(make_cases(t, 8, seed=SEED)):
            split = split_case(engine, case, t, decide, random.Random(i))
            if split is not None:
                break
        else:
            pytest.fail(f"no equal-length value for any {template} case")
        text = lambda tok: engine.backend.token_bytes(tok).decode("utf-8", "replace")  # noqa: E731
        _PROBES[key] = NotesProbe(reference, split[0], token_text=text)
    return _PROBES[key]


@pytest.mark.parametrize("template", ["lookup", "derived", "multi"])
def test_patching_everything_restores_all_and_nothing_restores_nothing(engine, reference, template) -> None:
    probe = notes_probe(engine, reference, template)
    c = probe.case
    assert probe.restored([]) == 0.0
    # the prefix's K/V are the same in both caches (causality): patching it changes nothing
    assert probe.restored(range(len(c.prefix))) == pytest.approx(0.0, abs=1e-6)
    assert probe.restored([*c.field_positions, *c.downstream_positions]) == pytest.approx(1.0, abs=1e-4)
    assert probe.restored(range(probe.n_prompt)) == pytest.approx(1.0, abs=1e-4)


def test_question_against_the_cache_equals_one_forward_and_leaves_caches_alone(engine, reference) -> None:
    probe = notes_probe(engine, reference, "lookup")
    c = probe.case
    sizes = (len(probe.old), len(probe.new))
    for new, expected in ((False, probe.score_old), (True, probe.score_new)):
        logits = reference(torch.tensor([*c.prompt(new), *c.question]), logits="last").logits[0]
        assert float(logits[c.new_answer] - logits[c.old_answer]) == pytest.approx(expected, abs=2e-3)
    probe.restored(c.field_positions)
    probe.margin_lost(c.field_positions)
    assert (len(probe.old), len(probe.new)) == sizes == (probe.n_prompt, probe.n_prompt)


@pytest.mark.parametrize("mode", MODES)
def test_locality_ranking_is_sorted_and_covers_every_downstream_offset(engine, reference, mode) -> None:
    probe = notes_probe(engine, reference, "lookup")
    c = probe.case
    share, ranked = probe.locality(mode)
    restored = [e.restored for e in ranked]
    assert restored == sorted(restored, reverse=True)
    assert sorted(e.offset for e in ranked) == list(range(1, len(c.downstream) + 1))
    assert all(e.offset == e.position - c.field_last and c.downstream[e.offset - 1] == e.token for e in ranked)
    base = share if mode == "field+position" else 0.0
    assert all(e.effect == pytest.approx(e.restored - base) for e in ranked)
    assert share == pytest.approx(probe.restored(c.field_positions))


@pytest.mark.parametrize("template", ["lookup", "derived"])
def test_knocking_out_field_and_downstream_moves_the_decision_more_than_nothing(engine, reference, template) -> None:
    probe = notes_probe(engine, reference, template)
    c = probe.case
    _, nothing = probe.margin_lost([])
    _, everything = probe.margin_lost([*c.field_positions, *c.downstream_positions])
    assert nothing == pytest.approx(0.0, abs=1e-5)
    assert abs(everything) > abs(nothing) + 0.1
    assert probe.score(probe.old, []) == pytest.approx(probe.score_old, abs=1e-5)


def test_run_reports_every_probe_and_serialises(engine, reference) -> None:
    probe = notes_probe(engine, reference, "lookup")
    report = probe.run(ks=(1, 4, 1000), n_random=1, seed=3)
    D = len(probe.case.downstream)
    assert sorted(report.top_k) == sorted(report.last_k) == [1, 4, D]  # k clipped to the downstream length
    assert report.full_restored == pytest.approx(1.0, abs=1e-4)
    assert report.top_k[D] == pytest.approx(1.0, abs=1e-4) and report.last_k[D] == pytest.approx(1.0, abs=1e-4)
    assert report.near_count == max(1, -(-D // 10)) and 0.0 <= report.near_share <= 1.0
    assert [row.k for row in report.knockout] == [1, 4, D]
    doc = json.loads(json.dumps(report.as_dict()))
    assert doc["mode"] == "field+position" and len(doc["positions"]) == D


_OK = {"prefix": (1, 2), "field_old": (5, 6), "field_new": (7, 8), "downstream": (9, 10), "question": (11,),
       "old_answer": 20, "new_answer": 21}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"field_new": (7, 8, 9)}, "same token length"),
        ({"field_new": (7,)}, "same token length"),
        ({"field_old": (), "field_new": ()}, "field is empty"),
        ({"field_new": (5, 6)}, "same tokens"),
        ({"downstream": ()}, "downstream span is empty"),
        ({"question": ()}, "question is empty"),
        ({"new_answer": 20}, "share their first token"),
    ],
)
def test_bad_input_raises_a_clear_error(change: dict, message: str) -> None:
    with pytest.raises(ProbeInputError, match=message) as info:
        ProbeCase(**{**_OK, **change})
    assert isinstance(info.value, KVAgentError)


def test_unknown_mode_is_refused(engine, reference) -> None:
    with pytest.raises(ProbeInputError, match="unknown patching mode"):
        notes_probe(engine, reference, "lookup").locality("neighbours")


@pytest.mark.slow
def test_cli_probe_notes_writes_json_and_calibration(engine, tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from kvagent.cli import app
    from kvagent.edits.selective_calibration import load_calibration

    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "probe.json"
    result = CliRunner().invoke(app, ["probe", "notes", "--model", engine.model.name, "--template", "lookup",
                                      "--cases", "1", "--json", str(out), "--save-calibration"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 1 and doc["summary"]["lookup"]["n_cases"] == 1
    cal = load_calibration(engine.fingerprint)
    assert cal is not None and cal.source == "reference-probes" and all(o > 0 for o in cal.offsets)


def test_positions_outside_the_prompt_are_refused(engine, reference) -> None:
    probe = notes_probe(engine, reference, "lookup")
    with pytest.raises(ProbeInputError, match="positions must lie in the prompt"):
        probe.restored([probe.n_prompt])
    with pytest.raises(ProbeInputError, match="positions must lie in the prompt"):
        probe.margin_lost([-1])
