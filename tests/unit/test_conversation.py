"""The core turn's bookkeeping (kvagent.conversation): the logged reply and what each turn cost."""

from __future__ import annotations

import pytest

from kvagent.conversation import Conversation, Cost, Plan
from kvagent.generation import Generation
from kvagent.messages import ChatMessage
from kvagent.tools import ToolCall

ASK = (ChatMessage("user", "weather?"),)


def _gen(text: str = "sunny", calls: tuple[ToolCall, ...] = ()) -> Generation:
    return Generation(text, (7, 8), "tool_calls" if calls else "eos", reused=20, computed=4, ttft_s=0.05,
                      total_s=0.25, transplanted=6, tool_calls=calls)


@pytest.mark.parametrize(
    "charges, expected",
    [
        ([], (30, 20, 4, 6)),
        ([(3, 0)], (30, 17, 7, 6)),
        ([(3, 0), (2, 5)], (30, 10, 9, 11)),
        ([(100, 0)], (30, 0, 30, 0)),  # never more than the prompt
    ],
)
def test_a_turn_costs_what_was_charged_since_the_last(charges: list[tuple[int, int]],
                                                      expected: tuple[int, int, int, int]) -> None:
    conversation = Conversation()
    for computed, transplanted in charges:
        conversation.charge(computed, transplanted)
    cost = conversation.commit(Plan(ASK, (), 30, 64, 100), _gen())
    assert (cost.input_tokens, cost.reused, cost.computed, cost.transplanted) == expected
    assert cost.reused + cost.computed + cost.transplanted == cost.input_tokens
    again = conversation.commit(Plan(ASK, (), 30, 64, 100), _gen())
    assert (again.reused, again.computed) == (20, 4)  # the charge went to one turn only
    assert conversation.costs == [cost, again]


def test_a_call_turn_is_logged_as_the_calls_with_the_ids_the_client_saw() -> None:
    conversation = Conversation()
    conversation.commit(Plan(ASK, (), 30, 64, 100), _gen("", (ToolCall("weather", {}, "internal"),)), ["call_9"])
    assert conversation.messages == [*ASK, ChatMessage("assistant", "", tool_calls=(ToolCall("weather", {}, "call_9"),))]


def test_forget_keeps_the_costs_and_drops_the_log() -> None:
    conversation = Conversation()
    conversation.commit(Plan(ASK, (), 30, 64, 100), _gen())
    conversation.charge(5)
    conversation.forget()
    assert (conversation.messages, conversation.charged, len(conversation.costs)) == ([], (0, 0), 1)


def test_cost_speed() -> None:
    cost = Cost.of(_gen())
    assert cost.cache_read == 26 and cost.tokens_per_s == pytest.approx(1 / 0.2)
