"""Which calls a turn may make: ``ToolChoice`` spellings, spent tools (the ``once`` decoding of ``auto``) and the
tools left to call. Pure logic; the grammars themselves are checked against a real tokenizer in
``tests/integration/test_native_tools.py``."""

from __future__ import annotations

from typing import Any

import pytest

from kvagent.errors import ToolChoiceError
from kvagent.messages import ChatMessage
from kvagent.tools import ToolCall, ToolSet
from kvagent.tools.choice import ToolChoice, callable_tools, spent_tools


def function(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                             "parameters": {"type": "object", "properties": {}}}}


TOOLS = ToolSet([function("lookup_order"), function("get_eta"), function("refund")])


def call(name: str) -> ToolCall:
    return ToolCall(name, {}, f"call_{name}")


@pytest.mark.parametrize("messages, spent", [
    ([ChatMessage("user", "Where is A-1?")], set()),
    ([ChatMessage("user", "Where is A-1?"), ChatMessage("assistant", "", tool_calls=(call("lookup_order"),)),
      ChatMessage("tool", "shipped", tool_call_id="call_lookup_order")], {"lookup_order"}),
    ([ChatMessage("user", "Where is A-1?"), ChatMessage("assistant", "", tool_calls=(call("lookup_order"),)),
      ChatMessage("tool", "shipped", tool_call_id="call_lookup_order"),
      ChatMessage("assistant", "", tool_calls=(call("get_eta"), call("refund")))], {"lookup_order", "get_eta", "refund"}),
    ([ChatMessage("user", "Where is A-1?"), ChatMessage("assistant", "", tool_calls=(call("lookup_order"),)),
      ChatMessage("tool", "shipped", tool_call_id="call_lookup_order"), ChatMessage("assistant", "It shipped."),
      ChatMessage("user", "And A-2?")], set()),  # a new user message: every tool may be called again
    ([ChatMessage("system", "Be brief."), ChatMessage("assistant", "", tool_calls=(call("refund"),))], {"refund"}),
    ([ChatMessage("user", "Cancel A-1"), ChatMessage("assistant", "", tool_calls=(call("cancel"),)),
      ChatMessage("tool", "done", tool_call_id="call_cancel")], set()),  # a tool no longer bound is not spent
])
def test_spent_tools_are_those_called_since_the_last_user_message(messages: list[ChatMessage], spent: set[str]) -> None:
    assert spent_tools(messages, TOOLS) == spent


@pytest.mark.parametrize("choice, left", [
    (ToolChoice("auto"), ["lookup_order", "get_eta", "refund"]),
    (ToolChoice("auto", spent=frozenset({"lookup_order"})), ["get_eta", "refund"]),
    (ToolChoice("auto", spent=frozenset(TOOLS.names)), []),  # auto with nothing left: text only
    (ToolChoice("required", spent=frozenset({"refund"})), ["lookup_order", "get_eta"]),
    (ToolChoice("tool", "refund", spent=frozenset({"refund"})), ["refund"]),  # a named tool is called as asked
    (ToolChoice("none"), []),
])
def test_callable_tools(choice: ToolChoice, left: list[str]) -> None:
    assert callable_tools(TOOLS, choice).names == left


@pytest.mark.parametrize("choice, message", [
    (ToolChoice("required", spent=frozenset(TOOLS.names)), "bind another tool or use auto"),
])
def test_a_turn_that_can_call_nothing_it_must_is_refused_by_name(choice: ToolChoice, message: str) -> None:
    with pytest.raises(ToolChoiceError, match=message):
        callable_tools(TOOLS, choice)


@pytest.mark.parametrize("choice, parallel, expected", [
    ("auto", None, ToolChoice("auto")),
    ("any", True, ToolChoice("required", parallel=True)),
    ({"type": "function", "function": {"name": "refund"}}, None, ToolChoice("tool", "refund")),
    (ToolChoice("auto", spent=frozenset({"refund"})), None, ToolChoice("auto", spent=frozenset({"refund"}))),
    (ToolChoice("auto", spent=frozenset({"refund"})), True,
     ToolChoice("auto", parallel=True, spent=frozenset({"refund"}))),
])
def test_tool_choice_spellings(choice: Any, parallel: bool | None, expected: ToolChoice) -> None:
    assert ToolChoice.of(choice, TOOLS, parallel) == expected


@pytest.mark.parametrize("choice", [ToolChoice("auto", spent=frozenset({"cancel"})), ToolChoice("tool", "cancel"),
                                    "cancel", {"type": "function", "function": {}}])
def test_a_choice_naming_an_unbound_tool_is_refused_naming_the_bound_ones(choice: Any) -> None:
    with pytest.raises(ToolChoiceError, match="bound|name a function"):
        ToolChoice.of(choice, TOOLS)
