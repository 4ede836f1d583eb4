"""The agents benchmark's traces (``kvagent_bench.agent_traces``): prompt sizes on SmolLM2's tokenizer, what changes
between consecutive turns, tool calls answered by their results, and the per-arm summary."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import pytest

from kvagent_bench import agent_traces as at

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


@pytest.fixture(scope="module")
def count() -> Iterator[Any]:
    """Tokens of a text on SmolLM2's vocabulary (the GGUF's, through the server's token counter)."""
    from kvagent.errors import KVAgentError
    from kvagent_server.tokens import GGUFCounter

    try:
        counter = GGUFCounter("smollm2-135m")
    except KVAgentError as exc:
        pytest.skip(f"SmolLM2's GGUF is not available: {exc}")
    yield lambda text: len(counter._backend.tokenize(text, special=True))
    counter.close()


@pytest.fixture(scope="module")
def traces() -> dict[str, at.Trace]:
    return {name: at.trace(name) for name in at.TRACES}


def non_system(turn: at.Turn) -> list[dict[str, Any]]:
    return turn.messages[1:]


def test_the_main_system_prompt_is_about_2900_tokens(count: Any) -> None:
    assert 2700 <= count(at.system_prompt(at.CLOCK_START)) <= 3100


@pytest.mark.parametrize("name", at.TRACES)
def test_every_prompt_is_2k_to_8k_tokens_and_the_system_prompt_2k_to_4k(name: str, traces: dict[str, at.Trace],
                                                                        count: Any) -> None:
    """(``fleet``'s agents each have a part of the handbook: 0.6-1.5k tokens of system prompt, 1.5k-8k in all.)"""
    tr = traces[name]
    system, whole = ((600, 1500), 1500) if name == "fleet" else ((2000, 4000), 2000)
    assert len(tr.turns) == at.TURNS
    for turn in tr.turns:
        assert turn.messages[0]["role"] == "system" and turn.messages[-1]["role"] in ("user", "tool")
        assert system[0] <= count(turn.messages[0]["content"]) <= system[1]
        assert whole <= count(at.render_chatml(turn)) <= 8000 - 2 * at.TURNS


@pytest.mark.parametrize("name", at.TRACES)
def test_tool_calls_are_answered_by_their_results_in_order(name: str, traces: dict[str, at.Trace]) -> None:
    for turn in traces[name].turns:
        calls, results = at.tool_call_ids(turn.messages)
        assert calls == results and len(set(calls)) == len(calls)
        for i, m in enumerate(turn.messages):
            if m["role"] == "tool":  # right after the call it answers (one call a message here)
                before = turn.messages[i - 1]
                assert [c["id"] for c in before.get("tool_calls") or ()] == [m["tool_call_id"]]
            for c in m.get("tool_calls") or ():
                assert isinstance(json.loads(c["function"]["arguments"]), dict)
                assert isinstance(m["content"], str) and m["content"]  # SmolLM2's template needs text
                assert c["function"]["name"] in {t["function"]["name"] for t in [*at.TOOL_SPECS, *at.MEMORY_TOOLS]}


@pytest.mark.parametrize("name", at.TRACES)
def test_traces_are_deterministic_and_truncated_by_turns(name: str) -> None:
    assert at.trace(name) == at.trace(name)
    assert at.trace(name, 3).turns == at.trace(name).turns[:3]
    a = at.trace(name)
    a.turns[0].messages[0]["content"] = "changed"
    assert at.trace(name).turns[0].messages[0]["content"] != "changed"  # fresh dicts each call


def changed_lines(a: str, b: str) -> list[tuple[str, str]]:
    """(old, new) line pairs of the lines that differ (same line count required)."""
    la, lb = a.split("\n"), b.split("\n")
    assert len(la) == len(lb)
    return [(x, y) for x, y in zip(la, lb) if x != y]


def test_clock_changes_exactly_the_second_line_and_appends_a_reply_and_a_question(traces: dict[str, at.Trace]) -> None:
    turns = traces["clock"].turns
    minutes = []
    for prev, cur in zip(turns, turns[1:]):
        diff = changed_lines(prev.messages[0]["content"], cur.messages[0]["content"])
        assert len(diff) == 1 and diff[0][1].startswith("Current time: 2026-12-06 09:")
        assert cur.messages[0]["content"].split("\n")[1] == diff[0][1]
        assert non_system(cur)[: len(non_system(prev))] == non_system(prev)
        assert [m["role"] for m in non_system(cur)[len(non_system(prev)):]] == ["assistant", "user"]
        minutes.append(diff[0][1])
    assert len(set(minutes)) == len(minutes)
    assert turns[0].messages[0]["content"].split("\n")[1] == "Current time: 2026-12-06 09:14"


def test_memory_edits_one_fact_of_the_human_block_per_turn_through_a_tool_call(traces: dict[str, at.Trace]) -> None:
    turns = traces["memory"].turns
    for prev, cur in zip(turns, turns[1:]):
        old, new = prev.messages[0]["content"], cur.messages[0]["content"]
        start = new.index('<memory_block label="human"')
        end = new.index("</memory_block>", start)
        assert old[: old.index('<memory_block label="human"')] == new[:start]  # the persona before it unchanged
        assert old[old.index("</memory_block>", start):] == new[end:]  # the handbook after it unchanged
        header, _, value = new[start:end].partition("\n")
        assert header == f'<memory_block label="human" chars={len(value.rstrip(chr(10)))}>'
        lines_old = old[old.index('<memory_block label="human"'):].split("</memory_block>")[0].split("\n")[1:-1]
        lines_new = value.rstrip("\n").split("\n")
        added = [line for line in lines_new if line not in lines_old]
        assert len(added) == 1 and len(lines_new) - len(lines_old) in (0, 1)
        tail = non_system(cur)[len(non_system(prev)) - 1:]  # the previous question, then what the turn added
        assert non_system(cur)[: len(non_system(prev))] == non_system(prev)
        assert [m["role"] for m in tail] == ["user", "assistant", "tool", "assistant", "user"]
        call = tail[1]["tool_calls"][0]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] in ("core_memory_append", "core_memory_replace") and args["label"] == "human"
        assert (args.get("content") or args.get("new_content")) == added[0]
    names = [c["function"]["name"] for m in turns[-1].messages for c in m.get("tool_calls") or ()]
    assert len(names) == at.TURNS - 1 and names.count("core_memory_append") >= 4
    assert all(t.tools == turns[0].tools for t in turns)


def test_cleared_keeps_the_latest_two_tool_results_from_turn_3(traces: dict[str, at.Trace], count: Any) -> None:
    turns = traces["cleared"].turns
    for k, turn in enumerate(turns):
        results = [m["content"] for m in turn.messages if m["role"] == "tool"]
        assert len(results) >= min(k, 5)
        cleared = [c for c in results if c == at.CLEARED]
        if k < at.CLEAR_FROM:
            assert not cleared
        else:
            assert results[: len(results) - at.KEEP_RESULTS] == [at.CLEARED] * (len(results) - at.KEEP_RESULTS)
        for content in results[-at.KEEP_RESULTS:]:
            assert 150 <= count(content) <= 400
    for prev, cur in zip(turns, turns[1:]):
        assert cur.messages[0] == prev.messages[0] and cur.tools == prev.tools and 3 <= len(cur.tools or ()) <= 10
        # the previous turn, its results cleared where this turn clears them, is a prefix of this one
        old = [dict(m) for m in prev.messages]
        for m, new in zip(old, cur.messages):
            if m["role"] == "tool" and new["content"] == at.CLEARED:
                m["content"] = at.CLEARED
        assert cur.messages[: len(old)] == old and len(cur.messages) == len(old) + 2


def test_summary_replaces_the_oldest_turns_by_one_message_once(traces: dict[str, at.Trace]) -> None:
    turns = traces["summary"].turns
    for k, (prev, cur) in enumerate(zip(turns, turns[1:]), start=1):
        if k == at.SUMMARY_TURN:
            summary = cur.messages[1]
            assert summary["role"] == "user" and summary["content"].startswith(at.SUMMARY_PREFIX)
            kept = cur.messages[2:-1]  # the last two exchanges: the previous turn's tail, then its reply
            assert len(kept) == 4 and kept[:-1] == prev.messages[-3:] and kept[-1]["role"] == "assistant"
            assert len(cur.messages) < len(prev.messages)
        else:
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
    assert sum(m["content"].startswith(at.SUMMARY_PREFIX) for m in turns[-1].messages) == 1


def test_tools_binds_a_different_three_to_five_of_ten_each_turn(traces: dict[str, at.Trace]) -> None:
    turns = traces["tools"].turns
    assert len({t["function"]["name"] for t in at.TOOL_SPECS}) == 10
    sets = [tuple(t["function"]["name"] for t in turn.tools or ()) for turn in turns]
    assert all(3 <= len(s) <= 5 for s in sets)
    assert all(a != b for a, b in zip(sets, sets[1:]))
    for prev, cur in zip(turns, turns[1:]):
        assert cur.messages[: len(prev.messages)] == prev.messages  # only the tools and the new messages change
        assert cur.messages[-1]["role"] == "user"


def test_render_chatml_is_the_templates_text_for_plain_messages() -> None:
    turn = at.Turn([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert at.render_chatml(turn) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n" \
                                     "<|im_start|>assistant\n"


def test_summary_of_rows_medians_over_changed_turns_and_ratios_to_kvagent() -> None:
    from kvagent_bench.agents import summarise

    def row(arm: str, turn: int, computed: int, ttft: float) -> dict[str, Any]:
        return {"arm": arm, "trace": "clock", "turn": turn, "changed": turn > 0, "prompt_tokens": 3000,
                "cached": 3000 - computed, "computed": computed, "ttft_s": ttft, "wall_s": ttft + 0.1}

    rows = [row("kvagent", 0, 3000, 20.0), row("kvagent", 1, 100, 1.0), row("kvagent", 2, 80, 0.5),
            row("kvagent", 3, 120, 2.0),
            row("llama-cpp-python", 0, 3000, 20.0), row("llama-cpp-python", 1, 2900, 15.0),
            row("llama-cpp-python", 2, 2950, 16.0), row("llama-cpp-python", 3, 3000, 17.0)]
    s = summarise(rows)
    assert s["kvagent"]["clock"]["computed_median"] == 100 and s["kvagent"]["clock"]["ttft_s_median"] == 1.0
    assert s["kvagent"]["clock"]["computed_per_turn"] == [3000, 100, 80, 120]
    assert s["kvagent"]["clock"]["cold_computed"] == 3000
    assert s["llama-cpp-python"]["clock"]["ttft_vs_kvagent"] == 16.0
    assert s["llama-cpp-python"]["clock"]["computed_vs_kvagent"] == 29.5
    assert s["llama-cpp-python"]["all"]["changed_turns"] == 3


def test_run_writes_rows_keeps_other_arms_rows_and_records_failures(tmp_path: Any, monkeypatch: Any) -> None:
    """The runner's bookkeeping on fake engines: a row per turn, failures recorded (the turns before kept), rows of
    arms not run again kept, skipped arms named."""
    from kvagent_bench import agents

    class Fake:
        def __init__(self, arm: agents.Arm) -> None:
            self.arm, self.prev = arm, 0

        def turn(self, key: str, turn: at.Turn, max_tokens: int = 8) -> dict[str, Any]:
            if self.arm.name == "llama-cpp-python" and len(turn.messages) > 4:
                raise RuntimeError("boom")
            n = len(at.render_chatml(turn))
            cached, self.prev = min(self.prev, n), n
            return {"prompt_tokens": n, "cached": cached, "computed": n - cached, "ttft_s": 0.1, "wall_s": 0.2}

        def close(self) -> None:
            pass

    monkeypatch.setattr(agents, "start_arm", lambda arm, model, log_dir: Fake(arm))
    monkeypatch.setattr(agents, "skip_reason", lambda arm: "not built: run `make llama-server`"
                        if arm.target == "llama-server" else None)
    path = tmp_path / "agents.json"
    logged: list[str] = []
    doc = agents.run("smollm2-135m", ["kvagent", "llama-server", "llama-cpp-python"], ["clock"], 3, path, "first",
                     log=logged.append)
    assert [(r["arm"], r["turn"]) for r in doc["rows"]] == [("kvagent", 0), ("kvagent", 1), ("kvagent", 2),
                                                            ("llama-cpp-python", 0), ("llama-cpp-python", 1)]
    assert set(doc["skipped"]) == {"llama-server", "llama-server reuse"} and any("make llama-server" in m for m in logged)
    assert "boom" in doc["errors"]["llama-cpp-python / clock"]
    assert doc["summary"]["kvagent"]["clock"]["computed_per_turn"] == [r["computed"] for r in doc["rows"][:3]]
    agents.run("smollm2-135m", ["llama-cpp-python"], ["clock"], 1, path, "second", log=logged.append)
    data = json.loads(path.read_text())
    assert [(r["arm"], r["turn"]) for r in data["rows"]] == [("kvagent", 0), ("kvagent", 1), ("kvagent", 2),
                                                             ("llama-cpp-python", 0)]
    assert data["errors"] == {} and data["commands"] == {"kvagent / clock": "first", "llama-cpp-python / clock": "second"}
    with pytest.raises(ValueError, match="unknown trace"):
        agents.run("smollm2-135m", ["kvagent"], ["nope"], 3, path, "x")


def test_conversations_are_new_each_request_with_one_system_prompt_and_eight_tools(traces: dict[str, at.Trace]) -> None:
    turns = traces["conversations"].turns
    assert [t.conversation for t in turns] == list(range(at.TURNS))
    assert len({t.messages[0]["content"] for t in turns}) == 1 and "Current time" not in turns[0].messages[0]["content"]
    assert all(t.tools == turns[0].tools for t in turns)
    assert [t["function"]["name"] for t in turns[0].tools or ()] == list(at.CONVERSATION_TOOLS)
    assert len(at.CONVERSATION_TOOLS) == 8
    assert all([m["role"] for m in t.messages] == ["system", "user"] for t in turns)
    assert len({t.messages[1]["content"] for t in turns}) == at.TURNS


def test_fleet_is_three_agents_taking_turns_each_request_a_new_conversation(traces: dict[str, at.Trace]) -> None:
    turns = traces["fleet"].turns
    systems = [t.messages[0]["content"] for t in turns]
    intros = [intro for intro, _ in at.FLEET]
    assert [intros.index(text.split("\n\n", 1)[0]) for text in systems] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert [t.conversation for t in turns] == list(range(at.TURNS))
    assert len(set(systems)) == 3
    shared = [len(os.path.commonprefix([a, b])) for a in set(systems) for b in set(systems) if a != b]
    assert max(shared) == len("You are ")  # the agents' prompts part at once: nothing but that is a common prefix
    titles = [title for _, own in at.FLEET for title in own]
    assert len(titles) == len(set(titles))  # no section in two agents' prompts
    assert all(f"## {title}\n" in at.fleet_system(k) for k, (_, own) in enumerate(at.FLEET) for title in own)
    assert all(t.tools == turns[0].tools for t in turns) and len(turns[0].tools or ()) == 8
    assert [t.messages[1]["content"] for t in turns] == list(at.CONVERSATION_QUESTIONS)


@pytest.mark.parametrize("arm, trace_name, conversation, key", [
    ("kvagent", "clock", 0, "clock-agent"),
    ("kvagent", "conversations", 0, "conversations-agent"),
    ("kvagent", "conversations", 3, "conversations-agent-3"),
    ("kvagent-keyless", "clock", 0, None),
    ("kvagent-keyless", "conversations", 3, None),
])
def test_session_key_is_one_per_conversation_and_none_when_keyless(arm: str, trace_name: str, conversation: int,
                                                                   key: str | None) -> None:
    from kvagent_bench import agents

    by_name = {a.name: a for a in agents.ARMS}
    assert agents.session_key(by_name[arm], trace_name, at.Turn([], None, conversation)) == key


def test_a_keyless_turn_sends_no_prompt_cache_key() -> None:
    from kvagent_bench import agents

    sent: list[dict[str, Any]] = []

    class Usage:
        prompt_tokens, completion_tokens = 10, 1
        prompt_tokens_details = type("D", (), {"cached_tokens": 4})()

    class Chunk:
        choices: list[Any] = []
        usage = Usage()

    class Client:
        class chat:  # noqa: N801 - the openai client's shape
            class completions:  # noqa: N801
                @staticmethod
                def create(**kwargs: Any) -> list[Chunk]:
                    sent.append(kwargs)
                    return [Chunk()]

    turn = at.Turn([{"role": "user", "content": "hi"}])
    agents.openai_turn(Client(), "m", None, turn)
    got = agents.openai_turn(Client(), "m", "k", turn)
    assert "extra_body" not in sent[0] and "user" not in sent[0]
    assert sent[1]["extra_body"] == {"prompt_cache_key": "k"}
    assert (got["prompt_tokens"], got["cached"], got["computed"]) == (10, 4, 6)


@pytest.mark.parametrize("log, kept", [
    ("", []),
    ("INFO kvagent.session: seq 2 resumed a retained conversation of 3400 tokens (seq 1): 3391 of 3500 tokens kept "
     "(the prefix index offered 3010)\nINFO other line\n"
     "INFO kvagent.session: seq 1 resumed a retained conversation of 3500 tokens (seq 2): 3480 of 3600 tokens kept "
     "(the prefix index offered 3010)\n", [3391, 3480]),
])
def test_resumes_reads_the_kept_tokens_from_the_servers_log(log: str, kept: list[int]) -> None:
    from kvagent_bench.agents import resumes

    assert resumes(log) == kept


def test_summary_hit_rate_sums_cached_over_prompt_on_the_changed_turns() -> None:
    from kvagent_bench.agents import summarise

    rows = [{"arm": "kvagent-keyless", "trace": "conversations", "turn": k, "changed": k > 0, "prompt_tokens": p,
             "cached": c, "computed": p - c, "ttft_s": 1.0, "wall_s": 1.1, "resumed": r}
            for k, (p, c, r) in enumerate([(3000, 0, 0), (3020, 3000, 0), (3040, 2980, 3000)])]
    s = summarise(rows)["kvagent-keyless"]["conversations"]
    assert s["hit_rate"] == (3000 + 2980) / (3020 + 3040)
    assert s["resumed_per_turn"] == [0, 0, 3000]


def test_run_keeps_the_keyless_arm_apart_from_the_keyed_one(tmp_path: Any, monkeypatch: Any) -> None:
    from kvagent_bench import agents

    keys: dict[str, list[str | None]] = {}

    class Fake:
        def __init__(self, arm: agents.Arm) -> None:
            self.arm = arm

        def turn(self, key: str | None, turn: at.Turn, max_tokens: int = 8) -> dict[str, Any]:
            keys.setdefault(self.arm.name, []).append(key)
            return {"prompt_tokens": 100, "cached": 90, "computed": 10, "ttft_s": 0.1, "wall_s": 0.2}

        def close(self) -> None:
            pass

    monkeypatch.setattr(agents, "start_arm", lambda arm, model, log_dir: Fake(arm))
    monkeypatch.setattr(agents, "skip_reason", lambda arm: None)
    doc = agents.run("smollm2-135m", ["kvagent", "kvagent-keyless"], ["conversations"], 3, tmp_path / "a.json", "c")
    assert keys["kvagent"] == ["conversations-warmup", "conversations-agent", "conversations-agent-1",
                               "conversations-agent-2"]
    assert keys["kvagent-keyless"] == keys["kvagent-keyless no-fa"] == [None] * 4
    assert {r["arm"] for r in doc["rows"]} == {"kvagent", "kvagent-keyless", "kvagent-keyless no-fa"}
    assert [r["conversation"] for r in doc["rows"] if r["arm"] == "kvagent"] == [0, 1, 2]
    assert doc["summary"]["kvagent-keyless"]["conversations"]["ttft_vs_kvagent"] == 1.0


@pytest.mark.parametrize(("page", "expected"), [
    ('kvagent_retained{where="pool"} 3.0\nkvagent_retained{where="ram"} 1.0\n'
     'kvagent_retained_bytes{tier="ram"} 1.2345e+06\n', {"pool": 3.0, "ram": 1.0, "ram_bytes": 1234500.0}),
    ('# HELP kvagent_retained x\nkvagent_retained{where="pool"} 0.0\nkvagent_kv_cells_used 7.0\n', {"pool": 0.0}),
    ('kvagent_tier_restores_total{tier="ram"} 2.0\nkvagent_tier_restores_created{tier="ram"} 1.7e+09\n'
     'kvagent_tier_restores_total{tier="disk"} 0.0\n', {"ram_restores": 2.0, "disk_restores": 0.0}),
    ("", {}),
])
def test_the_retained_kv_is_read_from_the_servers_metrics(page: str, expected: dict[str, float]) -> None:
    from kvagent_bench import agents

    assert agents.retained_of(page) == expected


@pytest.mark.parametrize(("retained", "expected"), [
    ([{"ram_restores": 0.0, "disk_restores": 0.0}, {"ram_restores": 1.0, "disk_restores": 0.0},
      {"ram_restores": 1.0, "disk_restores": 1.0}, {"ram_restores": 3.0, "disk_restores": 1.0}], [0, 1, 1, 2]),
    ([{"pool": 1.0}, {"pool": 2.0}], [None, None]),  # tiers off: the server reports none
    ([None, {"ram_restores": 1.0}], [None, 1]),  # an arm that is not kvagent serve
])
def test_tier_restores_per_turn_are_the_servers_count_against_the_turn_before(retained: list[Any],
                                                                              expected: list[int | None]) -> None:
    from kvagent_bench.agents import tier_restores

    assert tier_restores([{"retained": r} for r in retained]) == expected


def test_the_summary_keeps_the_turns_whose_system_prompt_came_before_apart() -> None:
    from kvagent_bench.agents import summarise

    # fleet: agents A B C A B; the last two come back to a system prompt sent before
    rows = [{"arm": "kvagent-keyless", "trace": "fleet", "turn": k, "changed": k > 0, "seen_system": k >= 3,
             "prompt_tokens": 900, "cached": 900 - c, "computed": c, "ttft_s": t, "wall_s": t + 0.1}
            for k, (c, t) in enumerate([(900, 5.0), (880, 4.8), (1400, 7.9), (30, 0.4), (20, 0.3)])]
    s = summarise(rows)["kvagent-keyless"]["fleet"]
    assert (s["seen_computed_median"], s["seen_ttft_s_median"]) == (25, 0.35)
    assert s["computed_median"] == (880 + 30) / 2  # over every changed turn: 880, 1400, 30, 20
