"""An LCEL chain whose declared field changes over three turns: each change is an erratum line, the prompt's
cached prefix stays valid, and every turn prints how much of its prompt came from the cache.

Run: .venv/bin/python examples/langchain_fields.py
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.runnables import RunnableLambda

from kvagent.demo import POLICY
from kvagent.fields import FieldSpec
from langchain_kvagent import ChatKVAgent, KVAgentStateRunnable

STATUS = FieldSpec(name="order_status", allowed=("processing", "shipped", "delivered"), initial="processing")
TURNS = [
    ("processing", "Hi, can I still cancel my tent order?"),
    ("shipped", "It says it left the warehouse. Can I cancel now?"),
    ("delivered", "It arrived today. How do I return it?"),
]


def main(max_tokens: int = 48) -> list[dict[str, Any]]:
    # erratum named (the default, auto, rewrites the field in place on SmolLM2: kvagent/edits/data/auto.json)
    model = ChatKVAgent(model="smollm2-135m", policy=POLICY, fields=[STATUS], max_tokens=max_tokens,
                        edit_strategy="erratum")
    history: list[BaseMessage] = []
    # the chain: a turn's question and status -> the state dict -> the chat model's reply
    chain = (RunnableLambda(lambda turn: {"messages": [*history, HumanMessage(turn["question"])],
                                          "order_status": turn["status"]})
             | KVAgentStateRunnable(model, output="message"))
    config = {"configurable": {"session_id": "alice"}}
    rows = []
    for status, question in TURNS:
        reply = chain.invoke({"question": question, "status": status}, config=config)
        history += [HumanMessage(question), reply]
        usage, meta = reply.usage_metadata or {}, reply.response_metadata
        cache_read = usage["input_token_details"]["cache_read"]
        print(f"[order_status={status}] customer: {question}\n  agent: {str(reply.content).strip()}\n"
              f"  prompt {usage['input_tokens']} tokens: {cache_read} read from the cache "
              f"({cache_read / usage['input_tokens']:.0%}), {meta['computed']} computed, "
              f"TTFT {meta['ttft_s'] * 1000:.0f} ms")
        rows.append({"status": status, **usage, "computed": meta["computed"]})
    errata = [s.text for s in model.session("alice").segments if s.kind.value == "erratum"]
    print("errata in the prompt:", *errata, sep="\n  ")
    return rows


if __name__ == "__main__":
    main()
