"""A LangGraph support agent: a router picks skills from skills/ for each question (compiled once per model,
then transplanted), the agent node is KVAgentStateRunnable, and each customer is a thread_id with its own
kvagent session and its own order_status field (errata, never a rewritten system prompt).

Run: .venv/bin/python examples/langgraph_agent.py     (the first run compiles the skills it uses)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AnyMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages

from kvagent.demo import POLICY
from kvagent.fields import FieldSpec
from langchain_kvagent import ChatKVAgent, KVAgentStateRunnable

SKILLS = Path(__file__).resolve().parents[1] / "skills"
ROUTES = {"refund-policy": ("refund", "return", "cancel"), "lookup-order-tool": ("order", "where is")}
CONVERSATIONS = {
    "alice": [("processing", "Can I cancel my order A-1042?"), ("shipped", "It shipped. Can I return it instead?")],
    "bruno": [("delivered", "Where is my order B-2210?")],
}


class SupportState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    order_status: str
    skills: list[str]


def route(state: SupportState) -> dict[str, Any]:
    """Skills the latest question needs (a keyword router: a real one could be another model call)."""
    question = str(state["messages"][-1].content).lower()
    return {"skills": [name for name, words in ROUTES.items() if any(w in question for w in words)]}


def build(max_tokens: int = 48) -> tuple[Any, ChatKVAgent]:
    model = ChatKVAgent(model="smollm2-135m", policy=POLICY, max_tokens=max_tokens, skill_dirs=[str(SKILLS)],
                        compile_skills=True, fields=[FieldSpec(name="order_status", initial="processing")])
    graph = StateGraph(SupportState)
    graph.add_node("route", route)
    graph.add_node("agent", KVAgentStateRunnable(model))
    graph.add_edge(START, "route")
    graph.add_edge("route", "agent")
    return graph.compile(checkpointer=InMemorySaver()), model


def main(max_tokens: int = 48) -> list[dict[str, Any]]:
    app, model = build(max_tokens)
    rows = []
    for thread, turns in CONVERSATIONS.items():
        config = {"configurable": {"thread_id": thread}}
        for status, question in turns:
            state = app.invoke({"messages": [("user", question)], "order_status": status}, config)
            reply = state["messages"][-1]
            usage, meta = reply.usage_metadata, reply.response_metadata
            print(f"[{thread} · order_status={status} · skills={','.join(state['skills']) or '-'}] {question}\n"
                  f"  agent: {str(reply.content).strip()}\n  prompt {usage['input_tokens']} tokens: reused "
                  f"{meta['reused']}, transplanted {meta['transplanted']}, computed {meta['computed']}")
            rows.append({"thread": thread, "skills": state["skills"], **meta})
    return rows


if __name__ == "__main__":
    main()
