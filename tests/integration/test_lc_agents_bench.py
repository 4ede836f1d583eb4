"""``kvagent bench agents --langchain`` (``kvagent_bench.lc_agents``): the per-arm summary, the handbook's size, and
one short trace on kvagent's arms, each making the scripted calls."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

lc = pytest.importorskip("kvagent_bench.lc_agents")


def _run(answers: list[str], walls: float, computed: list[int]) -> dict:
    return {"calls": [{"prompt_tokens": 3000, "computed": c, "ttft_s": 0.1, "wall_s": 0.2} for c in computed],
            "wall_s": walls, "answers": answers}


def test_the_summary_compares_arms_on_the_same_trace() -> None:
    runs = {"middleware/dynamic": _run(["a", "b"], 2.0, [3000, 40, 60]),
            "llama-server/dynamic": _run(["a", "c"], 20.0, [3000, 3000, 3000]),
            "recompute/dynamic": _run(["a", "b"], 30.0, [3000, 3000, 3000])}
    got = lc.summarise(runs)
    mw = got["middleware/dynamic"]
    assert (mw["computed_median"], mw["computed_max"], mw["answers_equal_recompute"]) == (50, 60, 1.0)
    assert mw["wall_x_vs_llama-server"] == 10.0 and got["llama-server/dynamic"]["answers_equal_recompute"] == 0.5
    assert "wall_x_vs_chat-model" not in mw


def test_the_handbook_is_about_3k_tokens() -> None:
    assert 10_000 <= len(lc.handbook()) <= 16_000  # ~4 characters a token


def test_one_question_runs_on_kvagents_arms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lc, "QUESTIONS", 1)
    base = lc.handbook()[:1500]
    second = {}
    for arm in ("middleware", "recompute"):
        model = lc._kv_model("smollm2-135m")
        calls = lc.run_trace(arm, "tools", model, base, f"bench-{arm}")["calls"]
        assert [c["tool_calls"] > 0 for c in calls] == [True, False]  # the script: a call, then the answer
        second[arm] = calls[1]
        for key in model.session_ids():  # the next arm starts from nothing this one left
            model.close_session(key, retain=False)
    # the middleware computes the result and the new turn; the recompute arm everything after the shared prefix
    # (the tool subset changed with the question: the selected tools' specs and all after them)
    assert second["middleware"]["computed"] < second["middleware"]["prompt_tokens"] / 4
    assert second["recompute"]["computed"] > 2 * second["middleware"]["computed"]
