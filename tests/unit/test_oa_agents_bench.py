"""``kvagent bench agents --framework openai-agents``: the pure parts (the cache header, the session-key check, the
summary); the run itself needs a model and the SDK."""

from __future__ import annotations

from typing import Any

import pytest

from kvagent_bench import oa_agents

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


@pytest.mark.parametrize("value, want", [
    (None, {"how": None, "reused": None, "computed": None}),
    ("", {"how": None, "reused": None, "computed": None}),
    ("prefix; reused=3012; computed=40", {"how": "prefix", "reused": 3012, "computed": 40}),
    ("resumed; reused=3390; computed=12", {"how": "resumed", "reused": 3390, "computed": 12}),
    ("none; reused=0; computed=3100", {"how": "none", "reused": 0, "computed": 3100}),
])
def test_parse_cache_header(value: str | None, want: dict[str, Any]) -> None:
    assert oa_agents.parse_cache_header(value) == want


@pytest.mark.parametrize("body, headers, want", [
    ({"messages": []}, {}, False),
    ({"messages": [], "prompt_cache_key": "k"}, {}, True),
    ({"messages": [], "user": "u"}, {}, True),
    ({"messages": []}, {"x-kvagent-session": "s"}, True),
])
def test_keyed_names_every_way_a_request_carries_a_session(body: dict[str, Any], headers: dict[str, str],
                                                           want: bool) -> None:
    assert oa_agents.keyed(body, headers) is want


def test_summary_leaves_the_cold_request_out() -> None:
    def call(task: int, prompt: int, cached: int, how: str, resumed: int = 0) -> dict[str, Any]:
        return {"task": task, "prompt_tokens": prompt, "cached": cached, "computed": prompt - cached, "how": how,
                "resumed": resumed, "wall_s": 1.0, "keyed": False}

    calls = [call(0, 3000, 0, "none"), call(0, 3100, 3000, "prefix"), call(1, 3050, 3000, "prefix"),
             call(1, 3150, 3140, "resumed", 3100)]
    tasks = [{"wall_s": 5.0, "ended": "final"}, {"wall_s": 3.0, "ended": "max_turns"}]
    s = oa_agents.summarise(calls, tasks)
    assert s["cold_computed"] == 3000 and s["computed_per_request"] == [3000, 100, 50, 10]
    assert s["computed_median"] == 50 and s["hit_rate"] == (3000 + 3000 + 3140) / (3100 + 3050 + 3150)
    assert s["how"] == {"prefix": 2, "resumed": 1} and s["resumed_requests"] == 1
    assert s["task_wall_s_median"] == 4.0 and s["any_keyed"] is False and s["ended"] == ["final", "max_turns"]


def test_the_cli_prints_a_run_and_refuses_an_unknown_framework(tmp_path: Any, monkeypatch: Any) -> None:
    import importlib.util

    import typer

    from kvagent_bench import cli

    calls = [{"task": 0, "call": 0, "messages": 2, "prompt_tokens": 3265, "cached": 0, "computed": 3265, "how": "none",
              "resumed": 0, "wall_s": 9.1, "keyed": False},
             {"task": 0, "call": 1, "messages": 4, "prompt_tokens": 3368, "cached": 3265, "computed": 103,
              "how": "prefix", "resumed": None, "wall_s": 1.2, "keyed": False}]
    doc = {"rows": calls, "summary": oa_agents.summarise(calls, [{"wall_s": 10.3, "ended": "final"}])}
    monkeypatch.setattr(oa_agents, "run", lambda *a, **k: doc)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    cli._bench_framework_agents("qwen2.5-coder-0.5b", "openai-agents", 1, tmp_path / "x.json")
    with pytest.raises(typer.Exit):
        cli._bench_framework_agents("qwen2.5-coder-0.5b", "crewai", 1, tmp_path / "x.json")
