"""``KVCacheMiddleware`` in LangChain v1 agents (``create_agent``) and ``KVCheckpointer`` beside LangGraph's savers.

Each model call's cost is checked against a diff made apart from kvagent's: the prompt's tokens and the tokens the
session held before the call, compared with :mod:`difflib`; a call computes at most the tokens that diff finds
changed or new, plus 64. A resumed thread is checked against the session before it was saved (its logits) and
against a cold resume (what it computes).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (AgentMiddleware, ClearToolUsesEdit, ContextEditingMiddleware,
                                         ModelRequest, SummarizationMiddleware,
                                         dynamic_prompt)
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver

from kvagent.fields import FieldSpec
from kvagent.sessions import Snapshot
from kvagent.sessions.snapshot import SnapshotSignatureError, sign, signed_payload
from langchain_kvagent import ChatKVAgent, KVCacheMiddleware, KVCheckpointer, SnapshotModelError
from langchain_kvagent import operations as ops
from langchain_kvagent.middleware import EVENT

from lc_helpers import POLICY

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
SECRET = "a test secret of at least 32 bytes.."
SLACK = 64
RULES = " ".join(f"Rule {i}: answer about orders, refunds and deliveries precisely, and never invent a number."
                 for i in range(12))


@tool
def lookup_order(order_number: str) -> str:
    """Look up an order by its number (for example A-1042): its status and its carrier."""
    return json.dumps({"order": order_number, "status": "shipped", "carrier": "DHL", "history": ["paid", "packed"] * 8})


@tool
def get_shipping_eta(carrier: str) -> str:
    """Days until a parcel with this carrier arrives."""
    return json.dumps({"carrier": carrier, "eta_days": 3})


@tool
def open_ticket(summary: str) -> str:
    """Open a support ticket with a one-line summary."""
    return json.dumps({"ticket": "T-77", "summary": summary})


TOOLS = [lookup_order, get_shipping_eta, open_ticket]
QUESTIONS = ["Where is my order A-1042?", "When will it arrive, and can you open a ticket about the delay?"]


@pytest.fixture(autouse=True)
def _close_sessions() -> Any:
    """Sessions of this module's chat models close after each case (the engine's pool is shared)."""
    yield
    for model in MADE:
        for key in model.session_ids():
            model.close_session(key)
    MADE.clear()


MADE: list[ChatKVAgent] = []


def chat_model(name: str, **kw: Any) -> ChatKVAgent:
    # an engine of this module's own (its pool is not the other adapter tests', whose sessions stay open)
    settings = {"model": name, "n_ctx": 6144, "n_seq_max": 10, "max_tokens": 40,
                "auto_tools": "once" if name.startswith("qwen") else "each_once"}
    MADE.append(ChatKVAgent(**{**settings, **kw}))
    return MADE[-1]


def changed(before: list[int], after: list[int]) -> int:
    """Tokens of ``after`` outside the runs of at least 8 tokens it shares in order with ``before`` (difflib's
    matching blocks): what a splice can keep is a run, not a token that happens to recur in a rewritten block."""
    blocks = difflib.SequenceMatcher(None, before, after, autojunk=False).get_matching_blocks()
    return len(after) - sum(b.size for b in blocks if b.size >= 8)


class Probe(AgentMiddleware):
    """Innermost: the agent session's tokens before each model call, and the prompt it computed the call on."""

    def __init__(self, model: ChatKVAgent) -> None:
        super().__init__()
        self.model, self.rows = model, []

    def _held(self) -> list[int]:
        found = self.model.conversations.find(KVCacheMiddleware.thread())
        return list(found.live.rendered.tokens) if found is not None and found.active and found.live.segments else []

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        held = self._held()
        return self._row(request, held, handler(request))

    async def awrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        held = self._held()
        return self._row(request, held, await handler(request))

    def _row(self, request: ModelRequest, held: list[int], response: Any) -> Any:
        key = KVCacheMiddleware.thread()
        reply = next(m for m in response.result if isinstance(m, AIMessage))
        n = reply.usage_metadata["input_tokens"]
        prompt = list(self.model.session(key).rendered.tokens[:n])
        self.rows.append({"changed": changed(held, prompt), "computed": reply.response_metadata["computed"],
                          "input": n, "tools": sorted(t.name for t in request.tools),
                          "edits": [(e["kind"], e["reason"]) for e in reply.response_metadata["edits"]]})
        return response


class Scripted(AgentMiddleware):
    """A tool call after each user message, then the answer (``tool_choice``), so every model makes the same calls."""

    @staticmethod
    def _scripted(request: ModelRequest) -> ModelRequest:
        last = request.messages[-1] if request.messages else None
        return request.override(tool_choice="required" if isinstance(last, HumanMessage) else "none")

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        return handler(self._scripted(request))

    async def awrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        return await handler(self._scripted(request))


def clock() -> Any:
    ticks = iter(range(10_000))

    @dynamic_prompt
    def prompt(request: ModelRequest) -> str:
        return f"Current time: 10:{next(ticks) % 60:02d}\n{POLICY}\n{RULES}"

    return prompt


class Subsets(AgentMiddleware):
    """A tool selector that needs no model: each call binds the next of the agent's tools alone."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        self.n += 1
        return handler(request.override(tools=[request.tools[self.n % len(request.tools)]]))


def static_prompt() -> Any:
    @dynamic_prompt
    def prompt(request: ModelRequest) -> str:
        return f"{POLICY}\n{RULES}"

    return prompt


# the rewrites an agent's middlewares make to its prompt between model calls
REWRITES: dict[str, Callable[[], list[AgentMiddleware]]] = {
    "dynamic prompt": lambda: [clock()],
    "context editing": lambda: [static_prompt(), ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=100,
                                                                                                   keep=1)])],
    "tool subset": lambda: [static_prompt(), Subsets()],
}


def run_agent(model: ChatKVAgent, rewrites: list[AgentMiddleware], thread: str, *, kv: bool = True,
              questions: list[str] = QUESTIONS, **kv_args: Any) -> tuple[Probe, KVCacheMiddleware | None, dict]:
    probe = Probe(model)
    middleware = KVCacheMiddleware(model, **kv_args) if kv else None
    agent = create_agent(model, TOOLS, middleware=[*([middleware] if middleware else []), *rewrites, Scripted(), probe],
                         checkpointer=kv_args.get("checkpointer") or InMemorySaver())
    config = {"configurable": {"thread_id": thread}, "recursion_limit": 16}
    out: dict = {}
    for question in questions:
        out = agent.invoke({"messages": [("user", question)]}, config)
    return probe, middleware, out


@pytest.mark.parametrize("rewrite", [pytest.param(r, marks=() if r == "dynamic prompt" else pytest.mark.full)
                                     for r in REWRITES])  # the fast tier runs one (its budget is spent)
@pytest.mark.parametrize("name", MODELS)
def test_a_call_after_a_rewrite_computes_the_changed_and_new_tokens(name: str, rewrite: str) -> None:
    """A dynamic prompt, cleared tool results, a changed tool subset: every model call after the first computes at
    most what changed and what is new (by difflib) + 64, and the agent runs to an answer."""
    model = chat_model(name)
    probe, kv, out = run_agent(model, REWRITES[rewrite](), f"{rewrite}-{name}")
    assert isinstance(out["messages"][-1], AIMessage) and out["messages"][-1].content
    assert len(probe.rows) >= 4, probe.rows
    over = [r for r in probe.rows[1:] if r["computed"] > r["changed"] + SLACK]
    assert not over, [(r["changed"], r["computed"], r["edits"]) for r in over]
    assert [c.computed for c in kv.calls()] == [r["computed"] for r in probe.rows]
    if rewrite == "tool subset":
        assert len({tuple(r["tools"]) for r in probe.rows}) > 1  # the subsets did change
    if rewrite == "context editing":  # the middleware clears the request's copy; the state keeps the results
        assert any("[cleared]" in seg.text for seg in model.session(f"{rewrite}-{name}").segments)


@pytest.mark.full
def test_without_the_middleware_a_changed_tool_subset_recomputes_the_tools() -> None:
    """The same agent on ChatKVAgent alone: a changed subset changes the prompt's tool specs, which are recomputed
    from the first changed one; the middleware keeps every spec in place and holds the grammar to the subset."""
    plain, _, _ = run_agent(chat_model("smollm2-135m"), REWRITES["tool subset"](), "subset-plain", kv=False)
    kept, _, _ = run_agent(chat_model("smollm2-135m"), REWRITES["tool subset"](), "subset-kept")
    over = lambda rows: [r for r in rows[1:] if r["computed"] > r["changed"] + SLACK]  # noqa: E731
    assert over(plain.rows) and not over(kept.rows), (kept.rows, plain.rows)
    assert sum(r["computed"] for r in kept.rows[1:]) < sum(r["computed"] for r in plain.rows[1:])


@pytest.mark.full
def test_state_fields_are_edits_and_each_call_is_reported() -> None:
    """A declared state key is the chat model's field: changed between invokes it is an edit (``auto``), not a
    rewritten prompt; each call's cost reaches ``on_custom_event``."""
    model = chat_model("smollm2-135m", fields=[FieldSpec(name="customer_tier", initial="standard")])
    events: list[dict] = []

    class Events(BaseCallbackHandler):
        def on_custom_event(self, name: str, data: Any, **kw: Any) -> None:
            if name == EVENT:
                events.append(data)

    kv = KVCacheMiddleware(model, state_fields={"tier": "customer_tier"})
    probe = Probe(model)
    agent = create_agent(model, TOOLS, system_prompt=POLICY, middleware=[kv, Scripted(), probe],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "fields"}, "recursion_limit": 16, "callbacks": [Events()]}
    agent.invoke({"messages": [("user", QUESTIONS[0])], "tier": "standard"}, config)
    agent.invoke({"messages": [("user", QUESTIONS[1])], "tier": "gold"}, config)
    assert model.field_values(session_id="fields")["customer_tier"] == "gold"
    assert any("gold" in seg.text for seg in model.session("fields").segments)
    assert all(r["computed"] <= r["changed"] + SLACK for r in probe.rows[1:]), probe.rows
    assert [e["computed"] for e in events] == [c.computed for c in kv.calls("fields")]
    assert all(e["thread"] == "fields" for e in events)


@pytest.mark.full
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_built_in_middlewares_run_with_it_and_side_calls_keep_their_own_session(name: str) -> None:
    """``SummarizationMiddleware`` on the agent's own ChatKVAgent, with a dynamic prompt and context editing: the agent
    runs to an answer; the summarizer's calls (on the thread's config) go to ``<thread>#side``, so the agent's session
    is edited, never rebuilt by them (no call recomputes half its prompt). ``LLMToolSelectorMiddleware`` is not run
    here: on these models its selection fails on its own (SmolLM2 and Qwen2.5-Coder-0.5B repeat a tool's name in its
    JSON list until ``max_tokens`` cuts it, and the selector refuses the cut name; measured); a changed tool subset
    is the ``tool subset`` case above."""
    model = chat_model(name, max_tokens=96)
    rewrites = [clock(), SummarizationMiddleware(model=model, trigger=("messages", 8), keep=("messages", 3)),
                ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=300, keep=1)])]
    probe, kv, out = run_agent(model, rewrites, f"built-ins-{name}",
                               questions=[*QUESTIONS, "Thanks. Anything else?"])
    assert isinstance(out["messages"][-1], AIMessage) and out["messages"][-1].content
    assert {f"built-ins-{name}", f"built-ins-{name}#side"} <= set(model.session_ids())
    assert any("summary" in str(m.content).lower() for m in out["messages"])  # the summarizer ran
    # a summary is not one of the rewrites the +64 bound is for: its turns go whole (spliced out), and where the
    # summarised stretch reaches the cache's end it is recomputed from there; never is the whole prompt rebuilt
    rebuilt = [r for r in probe.rows[1:] if r["computed"] > r["input"] / 2
               or any(kind == "fallback" and "reaches the end" not in str(why) for kind, why in r["edits"])]
    assert not rebuilt, [(r["changed"], r["computed"], r["input"], r["edits"]) for r in rebuilt]


def _history(model: ChatKVAgent, saver: KVCheckpointer, thread: str) -> KVCacheMiddleware:
    kv = KVCacheMiddleware(model, checkpointer=saver)
    agent = create_agent(model, TOOLS, middleware=[kv, clock(), Scripted()], checkpointer=saver)
    for question in QUESTIONS:
        agent.invoke({"messages": [("user", question)]}, {"configurable": {"thread_id": thread}, "recursion_limit": 16})
    return kv


def _resume(model: ChatKVAgent, saver: Any, thread: str, kv: bool = True) -> tuple[KVCacheMiddleware, Probe]:
    probe = Probe(model)
    mw = KVCacheMiddleware(model, checkpointer=saver if kv else None)
    agent = create_agent(model, TOOLS, middleware=[mw, clock(), Scripted(), probe], checkpointer=saver)
    agent.invoke({"messages": [("user", "Thanks, that is all.")]}, {"configurable": {"thread_id": thread},
                                                                    "recursion_limit": 16})
    return mw, probe


@pytest.mark.full
def test_a_thread_resumed_from_sqlite_restores_its_kv(tmp_path: Path) -> None:
    """A thread saved through ``SqliteSaver`` and resumed by another chat model (a restarted worker): the snapshot is
    the session as it was (same logits), and the first call computes the new message, where a cold resume of the same
    checkpoints computes the whole history."""
    db = tmp_path / "threads.db"
    first = chat_model("smollm2-135m")
    with SqliteSaver.from_conn_string(str(db)) as inner:
        _history(first, KVCheckpointer(inner, secret=SECRET), "resumed")
    before = first.session("resumed").logits()
    held = len(first.session("resumed").rendered.tokens)
    first.close_session("resumed")

    with SqliteSaver.from_conn_string(str(db)) as inner:
        saver = KVCheckpointer(inner, secret=SECRET)
        assert saver.snapshots.size() > 0
        second = chat_model("smollm2-135m")
        snapshot = saver.snapshot("resumed", second)
        assert snapshot is not None
        second.conversations.apply("resumed", lambda e: ops.restore(e, snapshot))
        assert np.array_equal(second.session("resumed").logits(), before)
        second.close_session("resumed")

        third = chat_model("smollm2-135m")
        kv, probe = _resume(third, saver, "resumed")
        third.close_session("resumed")
        cold_model = chat_model("smollm2-135m")
        engine = cold_model.load_engine()  # a cold reference: nothing earlier sessions left behind
        engine.pool.clear_retained()
        if engine.tiers is not None:
            engine.tiers.clear()
        cold_kv, cold = _resume(cold_model, inner, "resumed", kv=False)
    assert kv.calls("resumed")[0].restored
    assert probe.rows[0]["computed"] <= probe.rows[0]["changed"] + SLACK < held / 4, probe.rows
    assert cold.rows[0]["computed"] > held / 2, cold.rows


@pytest.mark.full
def test_a_tampered_or_foreign_snapshot_is_refused_and_changes_nothing() -> None:
    """Bytes changed after signing, or a snapshot another model saved: a named error before anything is restored."""
    model = chat_model("smollm2-135m")
    saver = KVCheckpointer(InMemorySaver(), secret=SECRET)
    _history(model, saver, "tamper")
    keys = [k for k in saver.snapshots._kept if k[0] == "tamper"]  # type: ignore[attr-defined]
    good = saver.snapshots.get(keys[-1])
    assert good is not None
    for key in keys:
        saver.snapshots.put(key, good[:-1] + bytes([good[-1] ^ 1]))
    fresh = chat_model("smollm2-135m")
    with pytest.raises(SnapshotSignatureError, match="delete_thread"):
        _resume(fresh, saver, "tamper")
    assert "tamper" not in fresh.session_ids()

    inner = Snapshot.from_bytes(signed_payload(good))
    foreign = Snapshot(inner.segments, inner.messages, inner.blob, {**inner.meta, "fingerprint": "another model",
                                                                    "model": "gemma3-270m"})
    saver.snapshots.put(keys[-1], sign(foreign.to_bytes(), SECRET.encode(), b"kvagent-thread:tamper"))
    with pytest.raises(SnapshotModelError, match="gemma3-270m"):
        _resume(fresh, saver, "tamper")
    assert "tamper" not in fresh.session_ids()



@pytest.mark.full
async def test_the_async_hooks_keep_the_thread_as_the_sync_ones() -> None:
    """``ainvoke``: ``abefore_agent``, ``awrap_model_call`` and ``aafter_agent`` (a snapshot parked) as the sync path."""
    model = chat_model("smollm2-135m")
    saver = KVCheckpointer(InMemorySaver(), secret=SECRET)
    kv, probe = KVCacheMiddleware(model, checkpointer=saver), Probe(model)
    agent = create_agent(model, TOOLS, middleware=[kv, clock(), Scripted(), probe], checkpointer=saver)
    for question in QUESTIONS:
        await agent.ainvoke({"messages": [("user", question)]}, {"configurable": {"thread_id": "async"},
                                                                  "recursion_limit": 16})
    assert len(kv.calls("async")) == 4 and saver.snapshots.size() > 0
    over = [r for r in probe.rows[1:] if r["computed"] > r["changed"] + SLACK]
    assert not over, [(r["changed"], r["computed"], r["edits"]) for r in over]
