"""Chat messages to segments, and the whole-history bookkeeping every adapter shares (kvagent.messages)."""

from __future__ import annotations

import multiprocessing

import pytest

from kvagent.errors import SegmentOrderError
from kvagent.tools import ToolCall
from kvagent.messages import ChatMessage, MessageLog, is_message_segment, to_segments
from kvagent.segments import Segment, SegmentKind

SYS, USER, BOT = ChatMessage("system", "Be brief."), ChatMessage("user", "hi"), ChatMessage("assistant", "hello")


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([SYS, USER], [("policy", "system", "Be brief."), ("turn", "user", "hi")]),
        ([SYS, SYS, USER], [("policy", "system", "Be brief."), ("policy", "system", "Be brief."), ("turn", "user", "hi")]),
        ([USER, SYS], [("turn", "user", "hi"), ("memory", "system", "Be brief.")]),
        ([USER, BOT], [("turn", "user", "hi"), ("turn", "assistant", "hello")]),
        ([ChatMessage("tool", "42", name="calc")],
         [("turn", "user", '<tool_response name="calc">\n42\n</tool_response>')]),
        ([ChatMessage("tool", "42", name="calc", tool_call_id="call_1")],
         [("turn", "user", '<tool_response name="calc" id="call_1">\n42\n</tool_response>')]),
        ([ChatMessage("assistant", "", tool_calls=(ToolCall("calc", {"x": 1}, "call_1"),))],
         [("turn", "assistant", '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>')]),
    ],
)
def test_messages_map_to_segments(messages: list[ChatMessage], expected: list[tuple[str, str, str]]) -> None:
    segments = to_segments(messages)
    assert [(s.kind.value, s.role, s.text) for s in segments] == expected
    assert all(is_message_segment(s) for s in segments)


def _first_ids() -> list[str]:
    """The ids of the first segments a process makes: messages' and unnamed ones."""
    return [*(s.id for s in to_segments([SYS, USER, BOT])), Segment.user("x").id, Segment.erratum("status", 1).id]


@pytest.mark.parametrize("start", ["spawn", "fork"])  # a restarted worker; workers forked from one parent
def test_two_processes_never_give_segments_the_same_id(start: str) -> None:
    """A snapshot restored by another process keeps its segments' ids, and the segments that process adds go beside
    them: ids made in two processes (each new, or forked from one parent at the same point) never meet."""
    made = []
    for _ in range(2):
        with multiprocessing.get_context(start).Pool(1) as pool:
            made.append(pool.apply(_first_ids))
    assert not set(made[0]) & set(made[1]), made
    assert all(len(set(ids)) == len(ids) for ids in made), made


def test_unknown_role_is_refused_by_name() -> None:
    with pytest.raises(SegmentOrderError, match="unknown message role 'robot'"):
        ChatMessage("robot", "x")  # type: ignore[arg-type]


def test_resent_history_appends_only_new_messages_and_keeps_errata() -> None:
    log, fields = MessageLog(), [Segment.field("status", "open")]
    first = log.plan([], [SYS, USER], fields)
    assert [s.kind for s in first] == [SegmentKind.POLICY, SegmentKind.FIELD, SegmentKind.TURN]
    log.commit([SYS, USER, BOT])  # the reply the session generated is part of the history
    current = [*first, Segment.erratum("status", "closed"), Segment.assistant("hello")]
    second = log.plan(current, [SYS, USER, BOT, ChatMessage("user", "more")], fields)
    assert second[: len(current)] == current and [s.text for s in second[len(current):]] == ["more"]


@pytest.mark.parametrize(
    "resent",
    [[SYS, ChatMessage("user", "edited")], [ChatMessage("user", "fresh")], [SYS]],
)
def test_a_diverging_history_is_rebuilt_with_current_field_values(resent: list[ChatMessage]) -> None:
    log, fields = MessageLog(), [Segment.field("status", "open")]
    first = log.plan([], [SYS, USER], fields)
    log.commit([SYS, USER, BOT])
    current = [*first, Segment.erratum("status", "closed"), Segment.assistant("hello")]
    rebuilt = log.plan(current, resent, fields)
    assert not any(s.kind is SegmentKind.ERRATUM for s in rebuilt)
    assert [s.value for s in rebuilt if s.kind is SegmentKind.FIELD] == ["closed"]
    assert [s.text for s in rebuilt if is_message_segment(s)] == [m.content for m in resent]


def test_a_session_holding_only_adapter_segments_gets_the_messages_after_them() -> None:
    """Server sessions are created with their fields (and errata from /v1/sessions) before any message."""
    log, fields = MessageLog(), [Segment.field("status", "open")]
    current = [*fields, Segment.erratum("status", "closed")]
    planned = log.plan(current, [USER], fields)
    assert planned[:2] == current and [s.text for s in planned[2:]] == ["hi"]


def test_an_empty_session_gets_the_adapter_segments_before_the_turns() -> None:
    planned = MessageLog().plan([], [USER], [Segment.field("status", "open")])
    assert [s.kind for s in planned] == [SegmentKind.FIELD, SegmentKind.TURN]


@pytest.mark.parametrize("held, resent, expected", [
    # a model wrote one text as different tokens in two turns: each resent turn takes its own turn's tokens
    ([("A", (1, 2)), ("A", (3,))], ["A", "A"], [(1, 2), (3,)]),
    # the first of them dropped (a summary): the k-th left takes the k-th held
    ([("A", (1, 2)), ("B", (5,))], ["B"], [(5,)]),
    # a text no held turn has: the last generated tokens of that text
    ([("A", (1, 2))], ["C"], [(9, 9)]),
    # more resent turns of a text than held ones: the rest take the last generated tokens
    ([("A", (1, 2))], ["A", "A"], [(1, 2), (7,)]),
])
def test_resent_turns_take_the_tokens_of_the_held_turn_of_their_rank(held: list, resent: list, expected: list) -> None:
    from kvagent.generation import ReplyTokens

    replies = ReplyTokens()
    replies.remember("C", (9, 9))
    replies.remember("A", (7,))
    held_segments = [Segment.assistant(text, token_ids=ids) for text, ids in held]
    out = replies.resolve_all([Segment.assistant(t) for t in resent], held_segments)
    assert [s.token_ids for s in out] == expected
