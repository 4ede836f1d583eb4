"""An agent with memory that edits without busting its cache: a memory block the model edits with a memory tool,
the application's own edit, and what each one cost.

The block sits after the policy (``memory_position="head"``, as Letta pins blocks in its system prompt). Where Letta
recompiles the system prompt for every edit, here an edit is a kvagent edit: the conversation after the block stays
cached. Run: .venv/bin/python examples/memory_agent.py (``--tail``: the block after the trajectory instead).
"""

from __future__ import annotations

import sys
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from kvagent.memory import MemoryBlock
from langchain_kvagent import ChatKVAgent

HUMAN = MemoryBlock("human", "Name: Ada Lovelace\nCity: London", "what you know about the user", limit=600)


def main(max_tokens: int = 64, position: str = "head") -> list[dict[str, Any]]:
    model = ChatKVAgent(model="smollm2-135m", max_tokens=max_tokens, memory=[HUMAN], memory_position=position,
                        policy="You are Ada's personal assistant. Use what your memory says about her.")
    key = "ada"
    append = model.memory_tools(session_id=key)[1]  # memory_append
    rows: list[dict[str, Any]] = []
    history: list[BaseMessage] = [HumanMessage("Hi! I just adopted a cat named Mia.")]
    # 1. the model writes the new fact to its memory (a tool call under a grammar: it always parses)
    reply = model.bind_tools([append], tool_choice="memory_append").invoke(history, session_id=key)
    call = reply.tool_calls[0]
    result = append.invoke(call["args"])
    history += [reply, ToolMessage(result, tool_call_id=call["id"])]
    print(f"the model called memory_append({call['args']}) -> {result.splitlines()[0]}")
    # 2. it answers, with the new memory in its prompt
    answer: AIMessage = model.bind_tools([append], tool_choice="none").invoke(history, session_id=key)
    history.append(answer)
    rows.append(_row("after the model's memory edit", model, key))
    # 3. the application edits the memory itself (the user moved), then the conversation goes on
    print(model.edit_memory("human", "replace", session_id=key, old="London", new="Paris").splitlines()[0])
    history.append(HumanMessage("Where do I live now?"))
    # the tools stay bound (taking them out of the prompt's middle would recompute everything after them)
    history.append(model.bind_tools([append], tool_choice="none").invoke(history, session_id=key))
    rows.append(_row("after the application's memory edit", model, key))
    for row in rows:
        print(f"{row['turn']}: {row['input_tokens']} prompt tokens, {row['cache_read']} read from the cache, "
              f"{row['computed']} computed; the reply: {row['reply']!r}")
    return rows


def _row(turn: str, model: ChatKVAgent, key: str) -> dict[str, Any]:
    last = model.last_turn(key)
    assert last is not None
    text = model.messages(key)[-1].content
    return {"turn": turn, "input_tokens": last.input_tokens, "cache_read": last.cache_read,
            "computed": last.computed, "reply": str(text)[:120]}


if __name__ == "__main__":
    main(position="tail" if "--tail" in sys.argv else "head")
