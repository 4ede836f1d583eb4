"""The decision benchmark against llama-server (``kvagent_bench.server.peer_decisions``): the changed prompts of
each layout, reading a decision from llama-server's top log-probabilities, flips and recoveries, the verdict per
template; and, where ``make llama-server`` built the server, one real case through every arm."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvagent.edits.suite import Decider
from kvagent.segments import SegmentKind
from kvagent_bench.edit_heldout import HELDOUT, make_heldout_cases
from kvagent_bench.server import peer_decisions as pd

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


def fields_of(segments: list[Any]) -> list[tuple[int, str, object]]:
    return [(i, str(s.name), s.value) for i, s in enumerate(segments) if s.kind is SegmentKind.FIELD]


@pytest.mark.parametrize("template", ["tool", "room"])
def test_in_place_changes_values_where_they_stand_and_moved_declares_them_after_the_notes(template: str) -> None:
    case = make_heldout_cases(template, 1, format="chat")[0]
    after = {**case.before, **case.changes}
    before_fields = fields_of(list(case.segments))
    in_place = pd.changed_segments(case, "in place")
    moved = pd.changed_segments(case, "moved")
    assert [(i, n) for i, n, _ in fields_of(in_place)] == [(i, n) for i, n, _ in before_fields]
    assert all(v == after[n] for _, n, v in fields_of(in_place))
    n = len(moved)
    assert [i for i, _, _ in fields_of(moved)] == list(range(n - len(before_fields), n))  # the fields close the prompt
    assert all(v == after[name] for _, name, v in fields_of(moved))
    assert [s.id for s in moved if s.kind is not SegmentKind.FIELD] == \
        [s.id for s in case.segments if s.kind is not SegmentKind.FIELD]
    with pytest.raises(ValueError, match="use in place, moved"):
        pd.changed_segments(case, "sideways")


class FakeServer:
    """Answers ``/completion`` with the given top log-probabilities (pure parsing, no model)."""

    def __init__(self, top: dict[int, float], prompt_n: int) -> None:
        self.top, self.prompt_n, self.bodies = top, prompt_n, []  # type: ignore[var-annotated]

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append((path, body))
        return {"completion_probabilities": [{"top_logprobs": [{"id": t, "logprob": v} for t, v in self.top.items()]}],
                "timings": {"prompt_n": self.prompt_n}}


DECIDE = Decider({"yes": 1, "no": 2, "maybe": 3})


@pytest.mark.parametrize(("top", "decision", "margin"), [
    ({9: -0.1, 2: -1.0, 1: -2.5}, "no", 1.5),  # ranked among the listed candidates
    ({9: -0.1, 3: -0.7, 8: -4.0}, "maybe", 3.3),  # one candidate listed: it leads the unlisted ones by >= 3.3
    ({9: -0.1, 8: -4.0}, pd.UNDECIDED, 0.0),  # none listed
])
def test_a_decision_is_read_from_the_listed_candidates(top: dict[int, float], decision: str, margin: float) -> None:
    server = FakeServer(top, prompt_n=7)
    got = pd.peer_decide(server, [5] * 10, DECIDE, slot=2, cache_reuse=32)  # type: ignore[arg-type]
    assert (got.decision, got.computed, got.cached) == (decision, 7, 3)
    assert got.margin == pytest.approx(margin)
    body = server.bodies[0][1]
    assert (body["id_slot"], body["n_cache_reuse"], body["cache_prompt"], body["n_predict"]) == (2, 32, True, 1)
    assert body["n_probs"] == pd.N_PROBS and body["post_sampling_probs"] is False


def peer_result(before: str, oracle: dict[str, str], decisions: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": {"in place": 100, "moved": 100}}
    for layout in pd.LAYOUTS:
        out[f"oracle {layout}"], out[f"oracle {layout} margin"] = oracle[layout], 2.0
    for arm in pd.ARMS:
        out[arm.name] = {"before": before, "before_margin": 2.0, "decision": decisions.get(arm.name, oracle[arm.layout]),
                         "margin": 1.0, "computed": 10, "shifted": 40 if arm.cache_reuse == 32 else 0}
    return out


def kv_result(before: str, oracle: str, auto: str) -> Any:
    return SimpleNamespace(before=before, oracle=oracle, decisions={"auto": auto}, ran={"auto": "field_only"},
                           clear=True, before_margin=2.0, oracle_margin=2.0, cold=oracle, context_tokens=100)


def rows_of(kv: Any, peer: dict[str, Any], template: str = "tool", case: int = 0) -> list[dict[str, Any]]:
    return pd.case_rows("m", "plain", "short", template, case, kv, peer, truth="no")


def test_flips_and_recoveries_per_arm() -> None:
    stale = "llama-server moved reuse 32"
    rows = rows_of(kv_result("yes", "no", "no"),
                   peer_result("yes", {"in place": "no", "moved": "no"}, {stale: "yes"}))
    by_arm = {r["arm"]: r for r in rows}
    assert set(by_arm) == {pd.KVAGENT, *(a.name for a in pd.ARMS)}
    assert all(r["flipped"] for r in rows)
    assert [a for a, r in by_arm.items() if not r["recovered"]] == [stale]
    assert by_arm[stale]["shifted"] == 40 and by_arm["llama-server"]["shifted"] == 0
    # no flip: the oracle agrees with the unedited prompt; an undecided oracle is no evidence either
    same = rows_of(kv_result("yes", "yes", "no"), peer_result("yes", {"in place": "yes", "moved": pd.UNDECIDED}, {}))
    assert not any(r["flipped"] or r["recovered"] for r in same)


def test_summary_and_verdicts_count_flips_per_template() -> None:
    flip = peer_result("yes", {"in place": "no", "moved": "no"}, {})
    rows = [
        *rows_of(kv_result("yes", "no", "no"), flip, "tool", 0),
        *rows_of(kv_result("yes", "no", "yes"), flip, "tool", 1),  # auto misses one of two flips
        *rows_of(kv_result("yes", "yes", "yes"), peer_result("yes", {"in place": "yes", "moved": "yes"}, {}), "tool", 2),
        *rows_of(kv_result("yes", "no", "no"), peer_result("yes", {"in place": "no", "moved": "no"},
                                                           {a.name: "yes" for a in pd.ARMS}), "room", 0),
    ]
    summary = pd.summarise(rows)
    tool = {r["arm"]: r for r in summary if r["template"] == "tool"}
    assert (tool[pd.KVAGENT]["cases"], tool[pd.KVAGENT]["flips"], tool[pd.KVAGENT]["recovered"]) == (3, 2, 1)
    assert tool["llama-server"]["recovery"] == 1.0 and tool["llama-server moved reuse 32"]["shifted_mean"] == 40
    overall = {r["arm"]: r for r in summary if r["template"] == "all"}
    assert overall[pd.KVAGENT]["flips"] == 3 and overall[pd.KVAGENT]["recovered"] == 2
    verdicts = {v["template"]: v for v in pd.verdicts(summary)}
    assert verdicts["tool"]["kvagent"] == [1, 2] and verdicts["tool"]["best_peer"] == [2, 2]
    assert verdicts["tool"]["met"] is False and verdicts["room"]["met"] is True  # every peer arm missed room's flip
    assert "carrier" not in verdicts  # no case of it ran


def test_unknown_names_are_refused_before_anything_runs(tmp_path: Path) -> None:
    for kwargs, match in [({"models": ["gpt-9"]}, "unknown model 'gpt-9'"), ({"formats": ["yaml"]}, "unknown format"),
                          ({"downstreams": ["mid"]}, "unknown downstream"), ({"cases": 0}, "cases must be"),
                          ({"downstreams": ["short", "long"]}, "--long-cases N")]:
        args = {"models": ["smollm2-135m"], "formats": ["plain"], "downstreams": ["short"], "cases": 1, **kwargs}
        with pytest.raises(ValueError, match=match):
            pd.run(args["models"], args["formats"], args["downstreams"], args["cases"], 0, tmp_path / "x.json", "cmd")
    assert not (tmp_path / "x.json").exists()


# -- one real case through llama-server --------------------------------------------------------------
@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from kvagent.engine import Engine
    from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig, missing_reason

    if (reason := missing_reason()) is not None:
        pytest.skip(reason)
    slots = len(pd.ARMS) + 1
    config = LlamaServerConfig("smollm2-135m", n_ctx=2048 * slots, slots=slots, cache_reuse=pd.REUSE, cache_ram_mib=0)
    with Engine.load("smollm2-135m", n_ctx=4096) as engine, \
            LlamaServer(config, tmp_path_factory.mktemp("peer_decisions")) as server:
        yield engine, server


@pytest.mark.engines
def test_one_case_through_every_arm_on_llama_server(real: Any) -> None:
    """In place, llama-server's reuse matcher shifts nothing behind a changed value (every arm recomputes from the
    change and decides as the cold prompt); moved, a chunk of 32 keeps the notes' cached KV. The cold oracle's
    ranking of the candidates matches kvagent's cold logits on the same ids."""
    from kvagent.edits.suite import question_segments

    engine, server = real
    template = HELDOUT["tool"]
    decide = Decider.build(engine, template.answers)
    case = make_heldout_cases("tool", 1, format="plain")[0]
    render = engine.renderer(False).render
    got = pd.run_peer_case(server, lambda segs: render(segs).tokens, case, decide)
    question = question_segments(case.question)
    for layout in pd.LAYOUTS:
        segments = [*pd.changed_segments(case, layout), *question]
        with engine.session(segments, share_prefix=False, chat=False) as cold:
            ours, margin = decide(cold.logits())
        if margin >= 1.0:  # near ties may rank otherwise between two batchings of the same ids
            assert got[f"oracle {layout}"] == ours, layout
    for arm in pd.ARMS:
        row = got[arm.name]
        if arm.layout == "in place":
            assert row["shifted"] == 0, arm.name
            assert row["decision"] == got["oracle in place"] or got["oracle in place margin"] < 1.0
        elif arm.cache_reuse == 32:
            assert row["shifted"] >= 32, row  # the notes came from the cache, behind the removed state line
        else:
            assert row["shifted"] == 0, arm.name  # short notes are under the 256-token chunk
