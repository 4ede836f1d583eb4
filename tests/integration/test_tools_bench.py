"""``kvagent bench tools --quick`` on SmolLM2-135M through the CLI: the JSON, the plot and what its rows must say
whatever the speeds (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvagent.cli import app

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # about 70 s on 2 shared cores


def test_quick_tools_bench_writes_rows_the_grammar_and_the_baselines_explain(tmp_path: Path) -> None:
    out = tmp_path / "tools.json"
    result = CliRunner().invoke(app, ["bench", "tools", "--quick", "--model", "smollm2-135m", "--requests", "3",
                                      "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert out.with_suffix(".png").stat().st_size > 10_000
    doc = json.loads(out.read_text())
    rows, records = doc["rows"], doc["requests"]
    assert {r["task"] for r in rows} == {"validity", "selection", "ttft", "decode"}

    # validity: every complete call decoded under the grammar validates with jsonschema (an implementation of its
    # own); a grammar turn is invalid only where max_tokens cut its call
    grammar = [r for r in records if r["mode"] == "grammar"]
    assert len(grammar) == 3 and [r["intended"] for r in grammar] == ["lookup_order", "get_weather", "convert_currency"]
    for r in grammar:
        assert r["valid"] or r["finish_reason"] == "length", r
    # the tool descriptions were transplanted once, into the first turn; every later turn reused them from the cache
    assert records[0]["transplanted"] > 0 and all(r["transplanted"] == 0 for r in records[1:])
    for r in rows:
        if r["task"] in ("validity", "selection"):
            assert r["n"] == 3 and 0 <= r["ci_low"] <= r["share"] <= r["ci_high"] <= 1

    # TTFT: kvagent transplanted the tool descriptions; llama-cpp-python's create_chat_completion(tools=...) never
    # writes them into SmolLM2's prompt (its prompt does not grow with the tools), the variant with the
    # descriptions in its system message prefills all of them
    ttft = {(r["system"], r["tools"]): r for r in rows if r["task"] == "ttft"}
    assert {n for _, n in ttft} == {2, 4}
    for n in (2, 4):
        ours, plain, prompted = (ttft[("kvagent", n)], ttft[("llama-cpp-python", n)],
                                 ttft[("llama-cpp-python, tools in prompt", n)])
        assert ours["transplanted"] > ours["computed"] and ours["transplanted"] <= ours["tool_tokens"]
        assert plain["prompt_tokens"] < 100 and prompted["prompt_tokens"] >= 0.95 * ours["tool_tokens"]
    assert ttft[("llama-cpp-python", 2)]["prompt_tokens"] == ttft[("llama-cpp-python", 4)]["prompt_tokens"]

    # decode cost: the mask is timed only where a grammar runs
    decode = {r["mode"]: r for r in rows if r["task"] == "decode"}
    assert set(decode) == {"free", "json_schema", "required_call"}
    assert decode["free"]["mask_ms_per_token"] == 0 and decode["free"]["added_share"] == 0
    assert all(decode[m]["mask_ms_per_token"] > 0 and decode[m]["tokens"] > 1 for m in ("json_schema", "required_call"))


def test_quick_interleaved_task_on_the_tool_trained_model(tmp_path: Path) -> None:
    """``--tasks interleaved`` on Qwen2.5-Coder (4 tools, one round after the first; what a count changes is the
    prefix's length, which the benchmark's own runs cover): what each system computed
    follows from what it can reuse, whatever the speeds. kvagent's fresh conversation computes only its own messages
    (the system-and-tools prefix comes from the other conversation of its agent) and its later turn only the turn's
    new messages; llama-cpp-python as it is recomputes the whole prompt each time (the other agent ran between), its
    RAM cache loads the longest kept state back."""
    from kvagent.errors import ModelNotFoundError
    from kvagent.models import resolve_model

    try:
        resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (make setup installs it)")
    out = tmp_path / "tools.json"
    result = CliRunner().invoke(app, ["bench", "tools", "--quick", "--model", "qwen2.5-coder-0.5b", "--tasks",
                                      "interleaved", "--counts", "4", "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert out.with_name("tools-interleaved.png").stat().st_size > 10_000
    rows = {(r["system"], r["kind"], r["tools"]): r for r in json.loads(out.read_text())["rows"]}
    assert {k for _, k, _ in rows} == {"first", "fresh", "later"} and {n for _, _, n in rows} == {4}
    for n in (4,):
        first, fresh, later = (rows[("kvagent", k, n)] for k in ("first", "fresh", "later"))
        plain = {k: rows[("llama-cpp-python", k, n)] for k in ("first", "fresh", "later")}
        cached = {k: rows[("llama-cpp-python, RAM cache", k, n)] for k in ("fresh", "later")}
        assert fresh["computed"] < 32 and fresh["reused"] >= 0.9 * first["computed"]
        assert later["computed"] < 64 and later["reused"] > fresh["reused"]
        assert plain["fresh"]["computed"] >= 0.9 * plain["first"]["computed"]  # nothing of the other agent's prompt
        assert plain["later"]["computed"] > plain["fresh"]["computed"]
        assert cached["fresh"]["computed"] == fresh["computed"] and cached["later"]["computed"] == later["computed"]
