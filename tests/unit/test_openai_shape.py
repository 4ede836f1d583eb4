"""OpenAI's chat shapes in the core (kvagent.openai_shape): what both adapters read and write."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvagent.conversation import Cost
from kvagent.generation import Generation
from kvagent.messages import ChatMessage
from kvagent.openai_shape import (EngineStreamError, MessageError, ReplyStream, StreamedCalls, Used, chat_messages,
                                  cut_calls, reply_message, reply_of, response_schema, text_of, usage, used)
from kvagent.tools import ToolCall
from kvagent.tools.sets import ToolSets

CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}


@pytest.mark.parametrize(
    "raw, expected",
    [
        ([{"role": "developer", "content": "Be brief."}], [ChatMessage("system", "Be brief.")]),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         [ChatMessage("user", "ab")]),
        ([ASKED, {"role": "tool", "tool_call_id": "call_1", "content": "rain"}],
         [ChatMessage("assistant", "", tool_calls=(ToolCall("weather", {"city": "Oslo"}, "call_1"),)),
          ChatMessage("tool", "rain", "weather", tool_call_id="call_1")]),
        # the name comes from the call answered, not from what the result says
        ([ASKED, {"role": "tool", "tool_call_id": "call_1", "name": "other", "content": "rain"}],
         [ChatMessage("assistant", "", tool_calls=(ToolCall("weather", {"city": "Oslo"}, "call_1"),)),
          ChatMessage("tool", "rain", "weather", tool_call_id="call_1")]),
        ([{"role": "tool", "name": "calc", "content": "4"}], [ChatMessage("tool", "4", "calc")]),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}],
         [ChatMessage("assistant", "", tool_calls=(ToolCall("f", {"x": 1}, "call_0_0"),))]),
    ],
)
def test_messages_in(raw: list[dict[str, Any]], expected: list[ChatMessage]) -> None:
    assert chat_messages(raw) == expected


@pytest.mark.parametrize(
    "raw, param, words",
    [
        ([{"role": "robot", "content": "x"}], "messages.0.role", "use system"),
        ([{"role": "user", "content": None}], "messages.0.content", "needs text content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content",
         "text only"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages.0.tool_calls", "only assistant"),
        ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], "messages.0.tool_call_id", "answers no tool call"),
        ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}],
         "messages.0.tool_calls.0.function.arguments", "not JSON"),
        ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}],
         "messages.0.tool_calls.0.function.arguments", "JSON object"),
    ],
)
def test_messages_refused_name_the_param(raw: list[dict[str, Any]], param: str, words: str) -> None:
    with pytest.raises(MessageError, match=words) as err:
        chat_messages(raw)
    assert err.value.param == param


def test_a_lenient_reader_keeps_an_unknown_results_own_name() -> None:
    raw = [{"role": "tool", "tool_call_id": "nope", "name": "calc", "content": "4"}]
    assert chat_messages(raw, strict_ids=False) == [ChatMessage("tool", "4", "calc", tool_call_id="nope")]


@pytest.mark.parametrize(
    "fmt, expected",
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "items": {"type": "integer"}}}},
         {"type": "array", "items": {"type": "integer"}}),
    ],
)
def test_reply_schemas(fmt: dict[str, Any] | None, expected: dict[str, Any] | None) -> None:
    assert response_schema(fmt) == expected


@pytest.mark.parametrize("fmt, param", [({"type": "json_schema"}, "response_format.json_schema"),
                                        ({"type": "yaml"}, "response_format.type")])
def test_reply_schemas_refused(fmt: dict[str, Any], param: str) -> None:
    with pytest.raises(MessageError) as err:
        response_schema(fmt)
    assert err.value.param == param


def _gen(text: str, finish: str, calls: tuple[ToolCall, ...] = ()) -> Generation:
    return Generation(text, (1, 2, 3), finish, reused=10, computed=5, ttft_s=0.1, total_s=0.3, transplanted=2,
                      tool_calls=calls)


DONE = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'


@pytest.mark.parametrize(
    "text, finish, calls, expected",
    [
        ("plain text", "length", (), []),
        (DONE, "tool_calls", (ToolCall("a", {"x": 1}, "c0"),), []),
        # every call the turn began was closed, though max_tokens ended the turn: nothing was cut
        (DONE, "length", (ToolCall("a", {"x": 1}, "c0"),), []),
        (DONE + '<tool_call>{"name": "b", "arguments": {"y": ', "length", (ToolCall("a", {"x": 1}, "c0"),),
         [("b", '{"y": ')]),
        ('<tool_call>{"na', "length", (), [(None, '<tool_call>{"na')]),
    ],
)
def test_cut_calls(text: str, finish: str, calls: tuple[ToolCall, ...], expected: list[tuple[Any, str]]) -> None:
    cut = cut_calls(_gen(text, finish, calls))
    assert [(c["name"], c["arguments"]) for c in cut] == expected
    assert all("max_tokens" in c["error"] for c in cut)


def test_streamed_deltas_rebuild_the_calls() -> None:
    text = "<tool_call>" + json.dumps({"name": "a", "arguments": {"x": 1}}) + "</tool_call>"
    calls = StreamedCalls()
    deltas = [d for k in range(0, len(text), 5) for d in calls.feed(text[k:k + 5])] + calls.finish()
    items = [item for d in deltas for item in d.get("tool_calls", ())]
    assert not any("content" in d for d in deltas)
    assert {item["index"] for item in items} == {0}
    assert [item["function"]["name"] for item in items if "id" in item] == ["a"]
    assert json.loads("".join(item["function"]["arguments"] for item in items)) == {"x": 1}
    assert calls.ids == [items[0]["id"]]


def test_reply_and_usage() -> None:
    gen = _gen("hi", "eos")
    cost = Cost.of(gen, charged_computed=3)
    assert reply_message(gen) == {"role": "assistant", "content": "hi"}
    assert usage(cost) == {"prompt_tokens": 17, "completion_tokens": 3, "total_tokens": 20,
                           "prompt_tokens_details": {"cached_tokens": 9}}
    assert usage(cost, [])["kvagent_edits"] == []
    called = _gen("", "tool_calls", (ToolCall("a", {"x": 1}, "c0"),))
    assert reply_message(called)["tool_calls"] == [
        {"id": "c0", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}]


@pytest.mark.parametrize(("limit", "ops", "kept"), [
    (2, "+a +b +c", "bc"),  # the least recently used set is dropped first
    (2, "+a +b ?a +c", "ac"),  # a hit is a use
    (2, "+a +b +a +c", "bc"),  # building it again (concurrent misses) is not
    (0, "+a", ""),  # limit 0 keeps nothing
])
def test_tool_sets_keep_the_most_recently_used(limit: int, ops: str, kept: str) -> None:
    """``+k`` puts tool set ``k``, ``?k`` looks it up (no engine: nothing is built)."""
    sets = ToolSets(engine=None, limit=limit)  # type: ignore[arg-type]
    for op in ops.split():
        if op[0] == "+":
            sets.put(op[1], (None, (op[1],)))  # type: ignore[arg-type]
        else:
            assert sets.lookup(op[1]) is not None
    hits = sets.hits
    assert "".join(k for k in "abc" if sets.lookup(k) is not None) == kept
    assert sets.hits == hits + len(kept)


def test_an_engine_reply_reads_back_as_the_message_a_client_resends() -> None:
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "refusal": None,
                                                   "tool_calls": [{**CALL, "extra": 1}]}}],
              "usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}}
    assert reply_of(answer) == ASKED
    assert reply_of({"choices": []}) is None and reply_of({"error": "x"}) is None
    assert used(answer["usage"]) == Used(10, 3, 8) and used(answer["usage"]).total == 13
    assert used(None).total is None and used({"prompt_tokens": 4}).total is None


def test_a_streamed_reply_is_put_back_together_by_call_index() -> None:
    stream = ReplyStream()
    head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}
    pieces = [head, *({"index": 0, "function": {"arguments": a}} for a in ('{"city": ', '"Oslo"}'))]
    chunks = [*({"choices": [{"index": 0, "delta": {"tool_calls": [p]}}]} for p in pieces),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]
    for chunk in chunks:
        stream.add(json.dumps(chunk))
    stream.add("not json")
    assert not stream.done
    stream.add("[DONE]")
    assert stream.done and stream.finish == "tool_calls" and stream.message() == ASKED
    assert used(stream.usage).total == 7
    text = ReplyStream()
    for piece in ("Hel", "lo"):
        text.add(json.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]}))
    assert text.message() == {"role": "assistant", "content": "Hello"} and text.finish is None
    with pytest.raises(EngineStreamError):
        text.add(json.dumps({"error": {"message": "boom"}}))


@pytest.mark.parametrize("content, text", [
    (None, None), ("plain", "plain"), ([{"type": "text", "text": "a"}, "b", {"type": "text", "text": "c"}], "abc"),
])
def test_one_text_of_for_every_message(content: Any, text: str | None) -> None:
    assert text_of(content) == text
    with pytest.raises(MessageError, match="image_url"):
        text_of([{"type": "image_url"}], "messages.0.content")
