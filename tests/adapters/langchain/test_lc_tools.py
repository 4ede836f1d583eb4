"""Tool calling through ``ChatKVAgent``: bind-time checks, calls that parse and validate (invoke and stream),
structured output, and agents (LangGraph's ``create_react_agent``, LangChain's ``create_agent``) running a
two-tool task to a final answer on both models, the second model call reading its prompt from the cache.

Calls are validated with ``jsonschema`` (an implementation of JSON schema apart from the grammar's).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from kvagent.errors import ToolChoiceError, ToolSchemaError, ToolSpecError
from langchain_kvagent import ChatKVAgent

from lc_helpers import SETTINGS

MODELS = ["smollm2-135m", "gemma3-270m"]


@tool
def lookup_order(order_number: str) -> str:
    """Look up an order by its number (for example A-1042): its status and its carrier."""
    return json.dumps({"status": "shipped", "carrier": "DHL"})


@tool
def get_shipping_eta(carrier: str) -> str:
    """How many days a carrier (for example DHL or UPS) takes to deliver."""
    return json.dumps({"days": 3})


TOOLS = [lookup_order, get_shipping_eta]
SCHEMAS = {t.name: t.tool_call_schema.model_json_schema() for t in TOOLS}


def model(name: str = SETTINGS["model"], **options: Any) -> ChatKVAgent:
    return ChatKVAgent(**{**SETTINGS, "model": name, "max_tokens": 48, **options})


def valid(call: dict[str, Any]) -> bool:
    """The call names a bound tool and its arguments validate against that tool's schema (jsonschema)."""
    jsonschema.validate(call["args"], {**SCHEMAS[call["name"]], "additionalProperties": False})
    return True


class Refund(BaseModel):
    """A refund to issue."""

    order_number: str
    amount_eur: float


# (tools, tool_choice, error, message fragment): refused when bound, before any model loads
BAD_BINDS = [
    ([lookup_order, {"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer"}}}}}], None, ToolSpecError, "bound more than once"),
    ([{"type": "function", "function": {"name": "tags", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}], None, ToolSchemaError,
     "uniqueItems"),
    ([{"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}}], None,
     ToolSpecError, "OpenAI's function-name pattern"),
    (TOOLS, "cancel_order", ToolChoiceError, "bound: lookup_order, get_shipping_eta"),
]


@pytest.mark.parametrize(("tools", "choice", "error", "message"), BAD_BINDS)
def test_bad_tools_are_refused_when_bound(tools: list[Any], choice: Any, error: type, message: str) -> None:
    m = model()
    with pytest.raises(error, match=message):
        m.bind_tools(tools, tool_choice=choice)


@pytest.mark.parametrize("choice", ["required", "lookup_order", "any"])
@pytest.mark.parametrize("stream", [False, True])
def test_calls_parse_and_validate(choice: str, stream: bool) -> None:
    bound = model().bind_tools(TOOLS, tool_choice=choice)
    question = [HumanMessage("Where is my order A-1042?")]
    if stream:
        full: AIMessageChunk | None = None
        for chunk in bound.stream(question, session_id=f"calls-{choice}-stream"):
            full = chunk if full is None else full + chunk
        assert full is not None and full.tool_call_chunks  # the call arrived in pieces with its id and name
        reply: AIMessage = full  # type: ignore[assignment]
    else:
        reply = bound.invoke(question, session_id=f"calls-{choice}")
    assert reply.response_metadata["finish_reason"] == "tool_calls" and not reply.invalid_tool_calls
    assert len(reply.tool_calls) == 1 and all(valid(c) for c in reply.tool_calls)
    assert reply.tool_calls[0]["id"].startswith("call_")
    if choice == "lookup_order":
        assert reply.tool_calls[0]["name"] == "lookup_order"


@pytest.mark.parametrize("name", MODELS)
def test_a_tool_loop_reads_the_second_prompt_from_the_cache(name: str) -> None:
    m = model(name)
    bound = m.bind_tools(TOOLS, tool_choice="lookup_order")
    history: list[Any] = [HumanMessage("Where is my order A-1042?")]
    first = bound.invoke(history, session_id="loop")
    call = first.tool_calls[0]
    history += [first, ToolMessage(lookup_order.invoke(call["args"]), tool_call_id=call["id"])]
    second = m.bind_tools(TOOLS, tool_choice="none").invoke(history, session_id="loop")
    assert not second.tool_calls and second.content  # a text answer
    usage = second.usage_metadata
    assert usage is not None and usage["input_token_details"]["cache_read"] >= 0.8 * usage["input_tokens"], usage


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
@pytest.mark.parametrize("include_raw", [False, True])
def test_structured_output_always_parses(method: str, include_raw: bool) -> None:
    structured = model(max_tokens=64).with_structured_output(Refund, method=method, include_raw=include_raw)
    out = structured.invoke("Refund 12.50 euros on order A-1042. Reply as JSON with order_number and amount_eur.",
                            {"configurable": {"session_id": f"structured-{method}-{include_raw}"}})
    parsed = out["parsed"] if include_raw else out
    if include_raw:
        assert out["parsing_error"] is None and isinstance(out["raw"], AIMessage)
    assert isinstance(parsed, Refund)


def _two_tool_run(messages: list[Any]) -> tuple[list[str], AIMessage, dict[str, Any]]:
    """(the tools called in order, the final message, the usage of the second model call)."""
    calls = [c["name"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    replies = [m for m in messages if isinstance(m, AIMessage)]
    usage = replies[1].usage_metadata
    assert usage is not None
    return calls, replies[-1], dict(usage)


QUESTION = "Where is my order A-1042 and when will it arrive?"


def _react(m: ChatKVAgent) -> Any:
    from langgraph.prebuilt import create_react_agent

    return create_react_agent(m, TOOLS)


def _agent(m: ChatKVAgent) -> Any:
    from langchain.agents import create_agent

    return create_agent(m, TOOLS)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("make", [_react, _agent], ids=["create_react_agent", "create_agent"])
def test_an_agent_runs_two_tools_to_an_answer(name: str, make: Any) -> None:
    """LangGraph's prebuilt agent and LangChain 1.x's ``create_agent`` on ChatKVAgent: each tool once, then the answer,
    the second model call reading its prompt from the cache."""
    agent = make(model(name, max_tokens=64, auto_tools="each_once"))
    out = agent.invoke({"messages": [("user", QUESTION)]}, {"configurable": {"thread_id": f"{make.__name__}-{name}"},
                                                            "recursion_limit": 12})
    calls, final, usage = _two_tool_run(out["messages"])
    assert sorted(calls) == ["get_shipping_eta", "lookup_order"]  # each tool once, then the answer
    assert not final.tool_calls and final.content
    assert usage["input_token_details"]["cache_read"] >= 0.8 * usage["input_tokens"], usage


def test_a_tool_that_raises_goes_back_to_the_model_as_its_result() -> None:
    """LangGraph's ToolNode (``handle_tool_errors``) turns the exception into the tool message; the model reads it
    as the call's result and the loop goes on to an answer."""
    from langgraph.prebuilt import create_react_agent

    @tool
    def broken_lookup(order_number: str) -> str:
        """Look up an order by its number."""
        raise ValueError("the order service is down")

    from langgraph.prebuilt import ToolNode

    agent = create_react_agent(model(max_tokens=48, auto_tools="each_once"),
                               ToolNode([broken_lookup], handle_tool_errors=True))
    out = agent.invoke({"messages": [("user", "Where is order A-1042?")]}, {"configurable": {"thread_id": "broken"},
                                                                         "recursion_limit": 8})
    results = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert results and "the order service is down" in str(results[0].content)
    assert isinstance(out["messages"][-1], AIMessage) and not out["messages"][-1].tool_calls


@pytest.mark.parametrize("position", ["head", "tail"])
def test_memory_tools_edit_the_session_memory_in_an_agent_loop(position: str) -> None:
    """The model edits its memory by calling a memory tool (run by LangGraph's ToolNode); the block changes in the
    session, a refused edit changes nothing, and the next turn's prompt holds the new value."""
    from langgraph.prebuilt import create_react_agent

    from kvagent.memory import MemoryBlock

    human = MemoryBlock("human", "Name: Ada\nCity: London", "facts about the user", limit=200)
    m = model(max_tokens=64, memory=[human], memory_position=position, auto_tools="each_once")
    key = f"memory-{position}"
    tools = m.memory_tools(session_id=key)
    assert [t.name for t in tools] == ["memory_replace", "memory_append", "memory_rethink"]
    assert "does not contain 'Berlin'" in tools[0].invoke({"label": "human", "old": "Berlin", "new": "Rome"})
    m.invoke("Hello", session_id=key)
    assert m.edit_memory("human", "replace", session_id=key, old="London", new="Paris").endswith("City: Paris")
    agent = create_react_agent(m, [tools[1]])  # memory_append, called once (each_once), then the answer
    out = agent.invoke({"messages": [("user", "Remember that I have a cat named Mia.")]},
                       {"configurable": {"session_id": key, "thread_id": key}, "recursion_limit": 6})
    results = [msg.content for msg in out["messages"] if isinstance(msg, ToolMessage)]
    assert len(results) == 1 and "memory block 'human' updated" in str(results[0])
    session = m.session(key)
    text = "".join(s.text for s in session.segments)
    assert "City: Paris" in text and "City: London" not in text.split("City: Paris")[-1]
    if position == "tail":  # after the trajectory: the memory is the prompt's last segment but the reply
        assert session.segments[-2].name == "memory:human"


def test_recall_pages_come_in_transplanted_and_go_out_again() -> None:
    from kvagent.skills.spec import SkillSpec

    page = SkillSpec(name="trip-notes", version="1", kind="memory", description="notes from the user's last trip",
                     text="Last trip: Lisbon in May. Hotel near the river. Loved the custard tarts.")
    m = model(max_tokens=16, compile_skills=True)
    recall, drop = m.recall_tools([page], session_id="pages")
    m.invoke("Hello", session_id="pages")
    assert recall.invoke({"page": "trip-notes"}) == "memory page 'trip-notes' is now in your context"
    assert recall.invoke({"page": "nope"}).startswith("error: no memory page 'nope'")
    m.invoke("Where did I go?", session_id="pages")
    assert m.last_turn("pages").transplanted > 0  # type: ignore[union-attr]  # the page was copied in
    assert any(s.name == "trip-notes" for s in m.session("pages").segments)
    assert drop.invoke({"page": "trip-notes"}) == "memory page 'trip-notes' taken out of your context"
    assert not any(s.name == "trip-notes" for s in m.session("pages").segments)
    assert drop.invoke({"page": "trip-notes"}) == "memory page 'trip-notes' was not in your context"


# -- the tool-trained model (its own format: calls under auto, the once decoding) -----------------------------------
QWEN = "qwen2.5-coder-0.5b"
AGENT_POLICY = ("You are the support agent of a shop. Use a tool when you need data; once the tool results answer the "
                "question, reply to the customer in one sentence.")


@pytest.fixture(scope="module")
def qwen() -> ChatKVAgent:
    from kvagent.errors import ModelNotFoundError
    from kvagent.models import resolve_model

    try:
        resolve_model(QWEN)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (make setup installs it)")
    return ChatKVAgent(model=QWEN, n_ctx=4096, n_seq_max=8, max_tokens=96)


def test_a_tool_trained_model_calls_under_auto_invoked_and_streamed(qwen: ChatKVAgent) -> None:
    """Under ``auto`` (what agents bind) Qwen2.5-Coder calls the tool the question needs, with valid arguments and
    no spurious invalid call, as one message and as a stream of chunks."""
    bound = qwen.bind_tools(TOOLS)
    question = [HumanMessage("Where is my order A-1042?")]
    invoked = bound.invoke(question, session_id="qwen-auto")
    streamed: AIMessageChunk | None = None
    for chunk in bound.stream(question, session_id="qwen-auto-stream"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    for reply in (invoked, streamed):
        assert reply.response_metadata["finish_reason"] == "tool_calls" and not reply.invalid_tool_calls
        assert [c["name"] for c in reply.tool_calls] == ["lookup_order"] and valid(reply.tool_calls[0])
        assert reply.content == ""
    assert streamed.tool_calls[0]["args"] == invoked.tool_calls[0]["args"]


@pytest.mark.full  # three model calls over a 500-token prompt
def test_a_tool_trained_model_runs_an_agent_to_an_answer_with_once(qwen: ChatKVAgent) -> None:
    """``create_agent`` on Qwen2.5-Coder with ``auto_tools="once"``: the order is looked up, no tool is called twice
    for the question, and the run ends in a text answer (free, this model calls the same tool again after its result
    until the recursion limit)."""
    from langchain.agents import create_agent

    once = ChatKVAgent(model=QWEN, n_ctx=4096, n_seq_max=8, max_tokens=96, auto_tools="once")
    agent = create_agent(once, TOOLS, system_prompt=AGENT_POLICY)
    out = agent.invoke({"messages": [("user", "Where is my order A-1042?")]},
                       {"configurable": {"thread_id": "qwen-once"}, "recursion_limit": 10})
    calls = [c["name"] for m in out["messages"] if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls[0] == "lookup_order" and len(calls) == len(set(calls))
    final = out["messages"][-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and not final.invalid_tool_calls
    assert "A-1042" in str(final.content) or "ship" in str(final.content).lower()
