"""The tool benchmark's pure parts: the request set, the tools made to size, scoring calls with jsonschema, rows,
per-token times, merging JSON rows, the baseline's messages (no model)."""

from __future__ import annotations

import math

import pytest

from kvagent.tools import ToolSet
from kvagent.tools.format import INSTRUCTIONS, describe
from kvagent_bench import tools as tb
from kvagent_bench.tool_cases import AGENT_TOOLS, MAX_SYNTHETIC, REQUESTS, pick_requests, synthetic_tools

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

AGENT = ToolSet(AGENT_TOOLS)


def test_request_set_has_fifty_or_more_distinct_requests_for_bound_tools() -> None:
    assert len(REQUESTS) >= 50
    assert len({r for r, _ in REQUESTS}) == len(REQUESTS)
    assert 4 <= len(AGENT) <= 8
    per_tool = {name: sum(t == name for _, t in REQUESTS) for name in AGENT.names}
    assert {t for _, t in REQUESTS} == set(AGENT.names)
    assert min(per_tool.values()) >= 5


@pytest.mark.parametrize("k, first", [
    (1, [("Where is my order B-2291?", "lookup_order")]),
    (6, None),  # one of each tool
    (12, None),  # two of each
])
def test_pick_requests_spreads_over_the_tools(k: int, first: list | None) -> None:
    picked = pick_requests(k)
    assert len(picked) == k and len(set(picked)) == k
    if first is not None:
        assert picked == first
    counts = {name: sum(t == name for _, t in picked) for name in AGENT.names}
    assert max(counts.values()) - min(counts.values()) <= 1


def test_pick_requests_all_keeps_the_order_and_refuses_out_of_range() -> None:
    assert pick_requests(len(REQUESTS)) == REQUESTS
    for bad in (0, len(REQUESTS) + 1, 2.5):
        with pytest.raises(ValueError, match="from 1 to"):
            pick_requests(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 4, 16, 64, MAX_SYNTHETIC])
def test_synthetic_tools_are_distinct_bindable_and_nested(n: int) -> None:
    made = synthetic_tools(n)
    toolset = ToolSet(made)  # names and schemas checked as at bind time
    assert len(toolset) == n
    assert synthetic_tools(n) == made  # deterministic
    assert synthetic_tools(min(n + 1, MAX_SYNTHETIC))[:n] == made or n == MAX_SYNTHETIC
    lengths = [len(describe(t)) for t in toolset]
    assert 300 <= min(lengths) and max(lengths) <= 500  # ~100 tokens each (measured: 104-115 on both models)


@pytest.mark.parametrize("n", [0, -1, MAX_SYNTHETIC + 1, "4"])
def test_synthetic_tools_refuse_bad_counts(n: object) -> None:
    with pytest.raises(ValueError, match=f"from 1 to {MAX_SYNTHETIC}"):
        synthetic_tools(n)  # type: ignore[arg-type]


CALLS = [  # (calls, intended, valid, selected, reason fragment)
    ([("lookup_order", {"order_number": "A-1042"})], "lookup_order", True, True, ""),
    ([("lookup_order", {"order_number": "A-1042"})], "get_weather", True, False, ""),
    ([("lookup_order", {"order_number": "1042"})], "lookup_order", False, True, "does not match"),
    ([("lookup_order", {})], "lookup_order", False, True, "'order_number' is a required property"),
    ([("get_weather", {"city": "Oslo", "unit": "kelvin"})], "get_weather", False, True, "unit"),
    ([("convert_currency", {"amount": 0, "from_currency": "EUR", "to_currency": "USD"})], "convert_currency",
     False, True, "amount"),
    ([("create_event", {"title": "x", "date": "2026-02-30"})], "create_event", False, True, "date"),  # format checked
    ([("create_event", {"title": "x", "date": "2026-02-28", "duration_minutes": 4})], "create_event", False, True,
     "duration_minutes"),
    ([("read_file", {"path": "a.txt", "max_lines": 5})], "read_file", True, True, ""),
    ([("send_email", {"to": "x"})], "lookup_order", False, False, "not a bound tool"),
    ([("calculate", {"expression": "1+1"}), ("calculate", {"expression": 2})], "calculate", False, True, "expression"),
    ([], "calculate", False, False, "no call"),
]


@pytest.mark.parametrize("calls, intended, valid, selected, reason", CALLS)
def test_score_calls_validates_every_call_with_jsonschema(calls: list, intended: str, valid: bool, selected: bool,
                                                          reason: str) -> None:
    score = tb.score_calls(calls, AGENT, intended)
    assert (score.valid, score.selected) == (valid, selected)
    assert reason in score.reason
    assert score.called == (calls[0][0] if calls else None)


TEXTS = [  # (text, complete, valid, called, reason fragment)
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>', True, True, "calculate", ""),
    ('Sure! <tool_call>{"name":"calculate","arguments":{"expression":"2*3"}}</tool_call> done', True, True,
     "calculate", ""),
    ("The answer is 6.", True, False, None, "no call"),
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"</tool_call>', True, False, None,
     "does not parse"),
    ('<tool_call>{"name": "calculate", "description": "Evaluate"}</tool_call>', True, False, "calculate", "expression"),
    ('<tool_call>{"name": "calculate", "arguments": {"expr', False, False, None, "cut by max_tokens"),
    ('<tool_call>{"type": "object", "properties": {}}</tool_call>', True, False, None, "needs a name"),
]


@pytest.mark.parametrize("text, complete, valid, called, reason", TEXTS)
def test_score_text_reads_free_text_for_calls(text: str, complete: bool, valid: bool, called: str | None,
                                              reason: str) -> None:
    score = tb.score_text(text, AGENT, "calculate", complete=complete)
    assert (score.valid, score.called) == (valid, called)
    assert reason in score.reason


def test_share_row_carries_the_wilson_interval() -> None:
    row = tb.share_row("m", "validity", "grammar", 60, 60)
    assert row["share"] == 1.0 and row["ci_high"] == pytest.approx(1.0) and 0.93 < row["ci_low"] < 0.95
    row = tb.share_row("m", "validity", "free", 0, 60, attempted=3)
    assert row["share"] == 0.0 and row["ci_low"] == 0.0 and 0.05 < row["ci_high"] < 0.07 and row["attempted"] == 3
    with pytest.raises(ValueError):
        tb.share_row("m", "validity", "free", 1, 0)


@pytest.mark.parametrize("stamps, tokens, ms", [
    ([0.0, 0.02, 0.04, 0.06], 64, 20.0),
    ([0.0, 0.01, 0.03, 0.5], 3, 15.0),  # only the first `tokens` steps (a reply closing past max_tokens is cut)
    ([0.0, 0.02, 0.04, 0.5, 0.52], 64, 20.0),  # the median step: a preempted one does not move it
    ([1.0], 64, math.nan),
    ([], 64, math.nan),
])
def test_per_token_ms_is_the_median_step_interval(stamps: list[float], tokens: int, ms: float) -> None:
    got = tb.per_token_ms(stamps, tokens)
    assert (math.isnan(got) and math.isnan(ms)) or got == pytest.approx(ms)


def test_merge_rows_replaces_only_the_tasks_and_models_run() -> None:
    old = [{"task": "ttft", "model": "a", "v": 1}, {"task": "decode", "model": "a", "v": 2},
           {"task": "ttft", "model": "b", "v": 3}]
    new = [{"task": "ttft", "model": "a", "v": 9}]
    assert tb.merge_rows(old, new, ["ttft"], ["a"]) == [old[1], old[2], new[0]]
    assert tb.merge_rows(old, [], ["ttft", "decode"], ["a", "b"]) == []


def test_baseline_messages_hold_kvagents_tool_descriptions_in_one_system_message() -> None:
    plain = tb.baseline_messages("Be brief.", None, "hi")
    assert plain == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tools = ToolSet(synthetic_tools(3))
    system, user = tb.baseline_messages("Be brief.", tools, "hi")
    assert user == {"role": "user", "content": "hi"}
    assert system["content"].split("\n") == ["Be brief.", INSTRUCTIONS, *(describe(t) for t in tools)]


@pytest.mark.parametrize("quick, reps, requests, error", [
    (False, 0, None, "reps must be >= 1"),
    (False, None, 0, "requests must be from 1 to"),
    (True, None, len(REQUESTS) + 1, "requests must be from 1 to"),
])
def test_plan_refuses_bad_options(quick: bool, reps: int | None, requests: int | None, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tb.Plan.for_run(quick, reps=reps, requests=requests)


@pytest.mark.parametrize("counts, error", [([], "tool counts"), ([0, 4], "tool counts"), ([MAX_SYNTHETIC + 1], "tool counts")])
def test_plan_refuses_bad_tool_counts(counts: list[int], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tb.Plan.for_run(False, counts=counts)


@pytest.mark.parametrize("quick, counts, expected", [(False, [16], (16,)), (True, None, (2, 4)), (False, None, (4, 16, 64))])
def test_plan_takes_tool_counts(quick: bool, counts: list[int] | None, expected: tuple[int, ...]) -> None:
    assert tb.Plan.for_run(quick, counts=counts).counts == expected


def test_interleaved_turns_alternate_two_agents_as_a_server_sees_them() -> None:
    """Per round a fresh conversation of each agent, then a later turn of each; round 0's fresh ones are first."""
    turns = tb._interleaved_turns(2)
    assert turns[:4] == [("first", 0, 0), ("first", 0, 1), ("later", 0, 0), ("later", 0, 1)]
    assert turns[4:8] == [("fresh", 1, 0), ("fresh", 1, 1), ("later", 1, 0), ("later", 1, 1)]
    assert len(turns) == 12 and sum(kind == "fresh" for kind, _, _ in turns) == 4
    # every turn before a later one of the same conversation is the other agent's: no peer reuses its own prompt
    for i, (kind, r, a) in enumerate(turns):
        if kind == "later":
            assert turns[i - 1][2] != a
    later = tb._interleaved_messages("later", 1, 0)
    assert later[:2] == tb._interleaved_messages("fresh", 1, 0) and [m["role"] for m in later[2:]] == ["assistant", "user"]
    assert tb._interleaved_messages("fresh", 1, 0)[0] != tb._interleaved_messages("fresh", 1, 1)[0]


def test_plan_full_run_meets_the_brief() -> None:
    plan = tb.Plan.for_run(False)
    assert plan.requests == len(REQUESTS) >= 50 and plan.counts == (4, 16, 64) and plan.reps >= 3
    assert plan.decode_tokens == 64 and plan.n_ctx() >= 64 * 115 + 512


def test_run_refuses_unknown_tasks(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        tb.run(["smollm2-135m"], tb.Plan.for_run(True), tmp_path / "t.json", "kvagent bench tools", ["speed"])


def test_the_agent_set_has_six_requests_per_tool_with_arguments_and_sixteen_without() -> None:
    from kvagent_bench.agent_tool_cases import REQUESTS as ASKED
    from kvagent_bench.agent_tool_cases import SMALL_TALK, TOOLS

    tools = ToolSet(TOOLS)
    assert len(tools) == 8 and len(ASKED) >= 48 and len(SMALL_TALK) >= 16
    assert {r.tool for r in ASKED} == set(tools.names)
    assert all(sum(r.tool == n for r in ASKED) == 6 for n in tools.names)
    assert all(r.arguments and set(r.arguments) <= set(tools[r.tool].parameters["properties"]) for r in ASKED)
    assert len({r.text for r in [*ASKED, *SMALL_TALK]}) == len(ASKED) + len(SMALL_TALK)
    assert {r.tool for r in SMALL_TALK} == {None}


@pytest.mark.parametrize("arguments, expected, right", [
    ({"city": " Paris "}, {"city": "paris"}, True),
    ({"people": 4.0, "time": "19:30"}, {"people": 4}, True),
    ({"people": "4"}, {"people": 4}, True),
    ({"people": "four"}, {"people": 4}, False),
    ({}, {"ticker": "AAPL"}, False),
    ({"ticker": "AAPL."}, {"ticker": "AAPL"}, False),
])
def test_arguments_right(arguments: dict, expected: dict, right: bool) -> None:
    from kvagent_bench.agent_tool_cases import arguments_right

    assert arguments_right(arguments, expected) is right


def test_agent_rows_count_calls_selection_arguments_and_small_talk() -> None:
    from kvagent_bench.agent_tool_cases import Request, TOOLS

    tools = ToolSet(TOOLS)
    weather = Request("Play jazz", "play_music", {"query": "jazz"})
    talk = Request("Hi", None)
    records = [
        tb.agent_record("kvagent auto", "returned", weather, [("play_music", {"query": "Jazz"})], tools, "", 0.1),
        tb.agent_record("kvagent auto", "returned", weather, [("play_music", {"query": "rock"})], tools, "", 0.1),
        tb.agent_record("kvagent auto", "returned", weather, [("search_recipes", {"query": "jazz"})], tools, "", 0.1),
        tb.agent_record("kvagent auto", "returned", weather, [], tools, "jazz!", 0.1),
        tb.agent_record("kvagent auto", "returned", talk, [], tools, "Hello", 0.1),
        tb.agent_record("kvagent auto", "returned", talk, [("play_music", {"query": 3})], tools, "", 0.1),
    ]
    rows = {r["mode"]: (r["successes"], r["n"]) for r in tb.agent_rows("m", records)}
    assert rows == {"called": (3, 4), "selected": (2, 4), "arguments": (1, 4), "valid": (3, 4),
                    "no_call_on_small_talk": (1, 2)}
