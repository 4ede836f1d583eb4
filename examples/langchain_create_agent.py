"""A LangChain v1 support agent (``create_agent``) on a local tool-trained model whose KV cache stays alive per thread.

The agent is built as LangChain users build agents: a dynamic system prompt (the clock and the customer's profile,
changed on every model call), tools, ``ContextEditingMiddleware`` (old tool results become ``[cleared]``),
``SummarizationMiddleware`` (old turns become a summary), and a checkpointer. ``KVCacheMiddleware`` comes first: each
thread is one kvagent session, and each rewrite the other middlewares make is an edit of the cached prompt instead of
a rebuild. ``KVCheckpointer`` keeps each thread's KV snapshot beside its checkpoints, so a thread resumed by another
worker (here: a second chat model, as a restarted process would have) restores its cache instead of prefilling.

Run: .venv/bin/python examples/langchain_create_agent.py     (Qwen2.5-Coder-0.5B-Instruct, ``make setup`` installs it)
"""

from __future__ import annotations

import json
import time
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import (ClearToolUsesEdit, ContextEditingMiddleware, ModelRequest,
                                         SummarizationMiddleware, dynamic_prompt)
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from kvagent.demo import POLICY
from langchain_kvagent import ChatKVAgent, KVCacheMiddleware, KVCheckpointer

MODEL = "qwen2.5-coder-0.5b"
PROFILES = {"alice": "Alice Moreau, gold tier since 2021, prefers email", "bruno": "Bruno Rossi, new customer"}
ORDERS = {"A-1042": ("shipped", "DHL"), "B-2210": ("delivered", "UPS")}
QUESTIONS = ["Please look up my order A-1042 with the lookup_order tool.", "Which carrier has it? Get me its shipping ETA.",
             "Thanks! Open a ticket about the delay with open_ticket."]


@tool
def lookup_order(order_number: str) -> str:
    """Look up an order by its number (for example A-1042): its status and carrier."""
    status, carrier = ORDERS.get(order_number.strip().upper(), ("unknown", "none"))
    return json.dumps({"order": order_number, "status": status, "carrier": carrier})


@tool
def get_shipping_eta(carrier: str) -> str:
    """Days until a parcel with this carrier arrives."""
    return json.dumps({"carrier": carrier, "eta_days": 3 if carrier.upper() == "DHL" else 2})


@tool
def open_ticket(summary: str) -> str:
    """Open a support ticket with a one-line summary; returns its number."""
    return json.dumps({"ticket": "T-77", "summary": summary})


@dynamic_prompt
def support_prompt(request: ModelRequest) -> str:
    """The clock and the customer's profile on top of the policy: a prefix cache would recompute it all each call."""
    thread = KVCacheMiddleware.thread()
    return (f"Current time: {time.strftime('%H:%M:%S')}\nCustomer: {PROFILES.get(thread, 'unknown')}\n{POLICY}\n"
            "Use the tools to look orders up; answer in one or two sentences.")


def build(model: ChatKVAgent, checkpointer: KVCheckpointer) -> tuple[Any, KVCacheMiddleware]:
    kv = KVCacheMiddleware(model, checkpointer=checkpointer)
    agent = create_agent(model, [lookup_order, get_shipping_eta, open_ticket], middleware=[
        kv,  # first: it sees the agent's whole tool set and keys each thread's session
        support_prompt,
        ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=400, keep=1)]),
        SummarizationMiddleware(model=model, trigger=("messages", 14), keep=("messages", 6)),
    ], checkpointer=checkpointer)
    return agent, kv


def chat_model(max_tokens: int) -> ChatKVAgent:
    # auto_tools="once": a tool already called since the user's message is not called again (this 0.5B model
    # repeats its call after the result otherwise)
    return ChatKVAgent(model=MODEL, max_tokens=max_tokens, auto_tools="once", n_ctx=8192)


def main(max_tokens: int = 64, questions: list[str] = QUESTIONS) -> list[dict[str, Any]]:
    checkpointer = KVCheckpointer(InMemorySaver())
    agent, kv = build(chat_model(max_tokens), checkpointer)
    rows: list[dict[str, Any]] = []
    config = {"configurable": {"thread_id": "alice"}, "recursion_limit": 20}
    for question in questions:
        before = len(kv.calls("alice"))
        state = agent.invoke({"messages": [("user", question)]}, config)
        print(f"[alice] {question}\n  agent: {str(state['messages'][-1].content).strip()}")
        for call in kv.calls("alice")[before:]:
            print(f"  model call: prompt {call.input_tokens} tokens, computed {call.computed}, reused {call.reused}, "
                  f"transplanted {call.transplanted}, first token {call.ttft_s:.2f}s, edits {list(call.edits)}")
            rows.append({"question": question, "resumed": False, **call.__dict__})
    # another worker picks the thread up: a new chat model (no open session), the same checkpointer
    agent2, kv2 = build(chat_model(max_tokens), checkpointer)
    state = agent2.invoke({"messages": [("user", "One more thing: is the ticket open?")]}, config)
    print(f"[alice, resumed by another worker]\n  agent: {str(state['messages'][-1].content).strip()}")
    for call in kv2.calls("alice"):
        print(f"  model call: prompt {call.input_tokens} tokens, computed {call.computed}, first token "
              f"{call.ttft_s:.2f}s, restored from the checkpointer: {call.restored}")
        rows.append({"question": "resume", "resumed": True, **call.__dict__})
    return rows


if __name__ == "__main__":
    main()
