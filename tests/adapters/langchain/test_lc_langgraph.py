"""A 10-turn LangGraph conversation whose field changes every turn: kvagent's layout (policy, skill, declared
field; a change is an erratum line) against the layout users write today (the value at the top of the
system prompt, rebuilt every turn: an implicit edit in place), on the same chat model class. Prints cache_read /
input_tokens per turn for both."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, TypedDict

import pytest
from langchain_core.messages import AnyMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from lc_helpers import POLICY, SETTINGS

from kvagent.fields import FieldSpec
from langchain_kvagent import ChatKVAgent, KVAgentStateRunnable

langgraph = pytest.importorskip("langgraph")
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.graph import START, StateGraph  # noqa: E402
from langgraph.graph.message import add_messages  # noqa: E402

SKILL = Path(__file__).resolve().parents[3] / "skills" / "refund_policy.yaml"
QUEUE = FieldSpec(name="queue_position", type="int", initial=10)
QUESTIONS = [
    "Hi, I want to return my tent.", "Is return shipping free?", "I am a gold member.",
    "How long does the refund take?",
    "Can I get store credit instead?", "The tent has a broken pole.", "Is that covered by the warranty?",
    "Do I need the original packaging?", "What if I lost it?", "Thanks, that is all.",
]


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    queue_position: int


def run(node: Any, thread: str) -> list[tuple[int, int, int]]:
    """(input_tokens, cache_read, computed) per turn of the scripted conversation through a one-node graph."""
    graph = StateGraph(State)
    graph.add_node("agent", node)
    graph.add_edge(START, "agent")
    app = graph.compile(checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": thread}}
    rows = []
    for turn, question in enumerate(QUESTIONS):
        state = app.invoke({"messages": [("user", question)], "queue_position": 10 - turn}, config)
        reply = state["messages"][-1]
        usage = reply.usage_metadata
        cache_read = usage["input_token_details"]["cache_read"]
        rows.append((usage["input_tokens"], cache_read, reply.response_metadata["computed"]))
    return rows


def volatile_system_prompt(model: ChatKVAgent) -> Callable[[State, RunnableConfig], dict[str, Any]]:
    """The layout users write today: the changing value first in a system prompt rebuilt every turn."""
    skill_text = SKILL.read_text(encoding="utf-8").split("text: |", 1)[1]

    def agent(state: State, config: RunnableConfig) -> dict[str, Any]:
        system = SystemMessage(f"queue_position: {state['queue_position']}\n{POLICY}\n{skill_text}")
        return {"messages": [model.invoke([system, *state["messages"]], config)]}
    return agent


@pytest.mark.e2e  # ten turns of a whole graph (about a minute): the full tier
def test_ten_turn_graph_reads_the_cache_from_the_second_turn() -> None:
    fields_model = ChatKVAgent(**SETTINGS, max_tokens=12, policy=POLICY, skills=[str(SKILL)], fields=[QUEUE],
                               compile_skills=True, edit_strategy="erratum")
    kv = run(KVAgentStateRunnable(fields_model), "graph-fields")
    plain_model = ChatKVAgent(**SETTINGS, max_tokens=12)
    plain = run(volatile_system_prompt(plain_model), "graph-volatile")
    print("\nturn  kvagent layout: input cache_read ratio computed | "
          "value in the system prompt: input cache_read ratio computed")
    for turn, ((i1, c1, k1), (i2, c2, k2)) in enumerate(zip(kv, plain), start=1):
        print(f"{turn:>4}  {i1:>6} {c1:>6} {c1 / i1:6.3f} {k1:>5} | {i2:>6} {c2:>6} {c2 / i2:6.3f} {k2:>5}")
    ratios = [cache / total for total, cache, _ in kv]
    assert all(r >= 0.9 for r in ratios[1:]), ratios
    # the volatile value would break a prefix cache; here it is edited in place: the changed digit and the new turn
    assert all(cache / total >= 0.9 for total, cache, _ in plain[1:]), plain
    assert plain_model.session("graph-volatile").discovered_fields == {"queue_position": 9}
    errata = [s for s in fields_model.session("graph-fields").segments if s.kind.value == "erratum"]
    assert [s.value for s in errata] == list(range(9, 0, -1))  # one erratum per changed turn, none before
