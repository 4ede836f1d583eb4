"""ChatKVAgent on SmolLM2-135M: session keys, cache reuse per turn, concurrency, streams, errors by name."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from kvagent import Eviction, ModelNotFoundError
from kvagent.fields import FieldSpec
from kvagent.segments import Segment
from langchain_kvagent import (
    ChatKVAgent,
    KVAgentStateRunnable,
    SkillNotCompiledError,
    UndeclaredFieldError,
    UnknownSessionError,
    UnknownSkillError,
)

from lc_helpers import POLICY, SETTINGS, cosine

STATUS = FieldSpec(name="order_status", allowed=("processing", "shipped", "delivered"), initial="processing")


def model(**overrides: object) -> ChatKVAgent:
    return ChatKVAgent(**{**SETTINGS, "max_tokens": 12, **overrides})  # type: ignore[arg-type]


# -- the session key ---------------------------------------------------------------------------------
def test_session_key_order_keyword_then_session_id_then_thread_id_then_default() -> None:
    m = model()
    both = {"configurable": {"session_id": "s", "thread_id": "t"}}
    assert m.session_key(both, "kw") == "kw"
    assert m.session_key(both) == "s"
    assert m.session_key({"configurable": {"thread_id": "t"}}) == "t"
    assert m.session_key(None) == "default"


def test_configurable_reaches_the_session_on_every_entry_point() -> None:
    m = model()
    m.invoke("Hi", config={"configurable": {"session_id": "a"}})
    list(m.stream("Hi", config={"configurable": {"thread_id": "b"}}))
    m.batch(["Hi", "Hello"], config=[{"configurable": {"session_id": "c"}}, {"configurable": {"session_id": "d"}}])
    reply = m.invoke("Hi", session_id="e", config={"configurable": {"session_id": "ignored"}})
    assert reply.response_metadata["session_id"] == "e"
    assert set(m.session_ids()) == {"a", "b", "c", "d", "e"}
    assert m.session("a").tokens and m.session("b").tokens


async def test_configurable_reaches_the_session_on_async_entry_points() -> None:
    m = model()
    await m.ainvoke("Hi", config={"configurable": {"session_id": "a"}})
    async for _ in m.astream("Hi", config={"configurable": {"thread_id": "b"}}):
        pass
    await m.abatch(["Hi", "Yo"], config=[{"configurable": {"session_id": "c"}}, {"configurable": {"thread_id": "d"}}])
    assert set(m.session_ids()) == {"a", "b", "c", "d"}


def test_two_chat_models_never_share_a_conversation() -> None:
    first, second = model(), model()
    first.invoke("Hi", session_id="same")
    with pytest.raises(UnknownSessionError):
        second.session("same")


# -- reuse per turn ----------------------------------------------------------------------------------
async def test_follow_up_computes_only_the_new_message() -> None:
    m = model(policy=POLICY, fields=[STATUS])
    history: list = [SystemMessage("Customer: Alice Moreau, gold member."),
                     HumanMessage("Can I still cancel my order?")]
    first = await m.ainvoke(history, session_id="follow-up")
    question = "And how long does a refund take?"
    second = await m.ainvoke([*history, first, HumanMessage(question)], session_id="follow-up")
    # the message as the prompt holds it (in its chat-template wrapping): 13 tokens; then SmolLM2's
    # generation prompt, "<|im_start|>assistant\n", 4 more
    n_message = len(m.load_engine().renderer(True).segment_tokens(Segment.user(question)))
    usage, meta = second.usage_metadata, second.response_metadata
    assert meta["computed"] <= n_message + 8, meta
    assert usage["input_tokens"] == meta["reused"] + meta["computed"] + meta["transplanted"]
    assert usage["input_token_details"]["cache_read"] == meta["reused"] + meta["transplanted"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert meta["model_name"] == "smollm2-135m" and meta["session_id"] == "follow-up" and meta["ttft_s"] > 0


@pytest.mark.parametrize("closed", [True, False], ids=["after close_session", "beside the live one"])
def test_a_new_session_id_starts_from_a_conversation_seen_before(closed: bool) -> None:
    """A new conversation (a new session_id, as a new LangGraph thread) with the system prompt seen before computes
    its own message only: the earlier session's cells are shared, live or retained after close_session. A resent
    history whose clock line changed resumes the closed conversation and edits the line in place."""
    m = model(policy=POLICY, n_seq_max=6)  # an engine of its own: no other test's sessions hold its sequences
    system = SystemMessage("Customer: Alice Moreau, gold member.\nCurrent time: 10:05\n" +
                           " ".join(f"Rule {i}: reply politely about order type {i}." for i in range(12)))
    first = m.invoke([system, HumanMessage("Can I still cancel my order?")], session_id=f"a-{closed}")
    if closed:
        assert m.close_session(f"a-{closed}")
    question = "Where is my parcel now?"
    other = m.invoke([system, HumanMessage(question)], session_id=f"b-{closed}")
    n_message = len(m.load_engine().renderer(True).segment_tokens(Segment.user(question)))
    assert other.response_metadata["computed"] <= n_message + 8, other.response_metadata
    if closed:  # the first conversation, resent whole with another minute, by a third session id
        assert m.close_session(f"b-{closed}")
        later = SystemMessage(system.content.replace("10:05", "10:06"))
        history = [later, HumanMessage("Can I still cancel my order?"), first, HumanMessage("Thanks.")]
        resumed = m.invoke(history, session_id=f"c-{closed}")
        assert resumed.response_metadata["computed"] <= 2 + 8 + n_message, resumed.response_metadata
    m.close_session()


def test_a_system_prompt_changed_by_the_agent_is_edited_not_recomputed() -> None:
    # a dynamic prompt (a clock line at its top) through the plain chat model: no field declared
    m = model()
    rules = "\n".join(f"Rule {i}: parcels of zone {i} leave the depot at {i + 6} o'clock." for i in range(30))
    history: list = []
    metas = []
    for minute in range(3):
        system = SystemMessage(f"You are a courier's assistant.\nCurrent time: 09:{minute:02d}\n{rules}")
        question = HumanMessage(f"When does zone {minute} leave?")
        reply = m.invoke([system, *history, question], session_id="dynamic-prompt")
        history += [question, reply]
        metas.append((reply.response_metadata, reply.usage_metadata))
    for meta, usage in metas[1:]:
        assert [e["kind"] for e in meta["edits"]] == ["replace"], meta["edits"]
        assert meta["computed"] <= 64 < usage["input_tokens"] // 4, meta  # the changed digit, the new turn
        assert usage["input_token_details"]["cache_read"] == meta["reused"] + meta["transplanted"]
    assert m.session("dynamic-prompt").discovered_fields == {"Current time": 2}


@pytest.mark.slow  # 12-17 s; the fast tier keeps the other concurrent-session checks
async def test_eight_concurrent_ainvokes_match_a_cold_recompute() -> None:
    # its own engine: 8 sessions, a cold one to compare with, a scratch sequence
    m = ChatKVAgent(model=SETTINGS["model"], n_ctx=2048, n_seq_max=10, max_tokens=12)
    questions = [f"Name one thing to pack for a camping trip, number {i}." for i in range(8)]
    replies = await asyncio.gather(*(m.ainvoke([SystemMessage(POLICY), HumanMessage(q)], session_id=f"c{i}")
                                     for i, q in enumerate(questions)))
    assert all(r.content for r in replies)
    engine = m.load_engine()
    for i in range(8):
        session = m.session(f"c{i}")
        warm = session.logits()
        with engine.session(list(session.segments), share_prefix=False) as cold:
            reference = cold.logits()
        assert cosine(warm, reference) >= 0.999, i


def test_a_resent_history_that_diverges_is_rebuilt() -> None:
    m = model()
    first = m.invoke([HumanMessage("Hello")], session_id="div")
    m.invoke([HumanMessage("Hello"), first, HumanMessage("Tell me about tents.")], session_id="div")
    edited = m.invoke([HumanMessage("Goodbye")], session_id="div")  # not a continuation: a new prompt
    assert edited.response_metadata["computed"] > 0
    assert m.session("div").tokens == m.session("div").rendered.tokens
    # the history the session holds is the last call's messages and its reply, as LangChain messages
    assert [(type(x).__name__, x.content) for x in m.messages("div")] == [
        ("HumanMessage", "Goodbye"), ("AIMessage", edited.content)]
    assert [t.computed for t in m.turns("div")][-1] == edited.response_metadata["computed"]


# -- streams -----------------------------------------------------------------------------------------
def test_stream_last_chunk_carries_usage_and_metadata_once() -> None:
    chunks = list(model().stream("Count to five.", session_id="s1"))
    assert chunks[-1].chunk_position == "last"
    with_usage = [c for c in chunks if c.usage_metadata]
    with_meta = [c for c in chunks if c.response_metadata.get("session_id")]
    assert with_usage == [chunks[-1]] and with_meta == [chunks[-1]]
    meta = chunks[-1].response_metadata
    assert {"model_name", "finish_reason", "session_id", "reused", "computed", "transplanted", "ttft_s"} <= set(meta)


async def test_leaving_a_stream_early_rolls_the_turn_back() -> None:
    m = model(max_tokens=40)
    await m.ainvoke("Hi", session_id="early")
    session = m.session("early")
    before = (session.tokens, session.segments)
    history = ["Hi", AIMessage(m.session("early").segments[-1].text), "Count to thirty."]
    async for _ in m.astream(history, session_id="early"):
        break  # the abandoned generators are closed by the event loop's finalizer, which cancels the turn
    deadline = time.monotonic() + 10
    while (session.tokens, session.segments) != before and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert (session.tokens, session.segments) == before
    again = await m.ainvoke(["Hi", AIMessage(session.segments[-1].text), "Thanks"], session_id="early")
    assert again.response_metadata["reused"] >= len(before[0]) - 1  # the rolled-back turn left nothing behind


def test_timeout_cancels_and_rolls_back() -> None:
    m = model(max_tokens=200, timeout=0.001)
    with pytest.raises(TimeoutError, match="rolled back"):
        m.invoke("Count from one to one hundred.", session_id="slow")
    session = m.session("slow")
    assert session.tokens == () or session.tokens == session.rendered.tokens


# -- fields, skills, state -----------------------------------------------------------------------------
def test_fields_become_errata_once_a_conversation_exists() -> None:
    m = model(policy=POLICY, fields=[STATUS], edit_strategy="erratum")
    assert m.set_fields({"order_status": "shipped"}, session_id="f") is None  # no conversation yet: rendered in
    first = m.invoke("Can I cancel my order?", session_id="f")
    assert "order_status: shipped" in "".join(s.text for s in m.session("f").segments)
    report = m.set_fields({"order_status": "delivered"}, session_id="f")
    assert report is not None and report.strategy == "erratum"
    assert m.field_values("f")["order_status"] == "delivered"
    second = m.invoke(["Can I cancel my order?", first, "Is it delivered?"], session_id="f")
    assert second.response_metadata["computed"] >= report.computed  # the erratum is charged to this turn
    assert m.set_fields({"order_status": "delivered"}, session_id="f") is None  # unchanged: nothing to do


def test_state_runnable_turns_changed_state_into_one_erratum() -> None:
    m = model(policy=POLICY, fields=[STATUS], edit_strategy="erratum")
    agent = KVAgentStateRunnable(m)
    config = {"configurable": {"thread_id": "state"}}
    update = agent.invoke({"messages": [HumanMessage("Where is my order?")], "order_status": "processing"}, config)
    reply = update["messages"][0]
    agent.invoke({"messages": [HumanMessage("Where is my order?"), reply, HumanMessage("Now?")],
                  "order_status": "shipped"}, config)
    errata = [s for s in m.session("state").segments if s.kind.value == "erratum"]
    assert [(s.name, s.value) for s in errata] == [("order_status", "shipped")]


def test_named_errors_say_the_fix(tmp_path: Path) -> None:
    m = model(fields=[STATUS])
    with pytest.raises(UnknownSessionError, match="session_id='nobody'"):
        m.session("nobody")
    with pytest.raises(UndeclaredFieldError, match=r"add FieldSpec\(name='plan'"):
        m.set_fields({"plan": "gold"})
    with pytest.raises(UndeclaredFieldError, match=r"not declared on this ChatKVAgent.*add FieldSpec"):
        KVAgentStateRunnable(m, fields=["plan"])
    skill = tmp_path / "fresh_skill.yaml"  # text no store has seen: certainly not compiled
    skill.write_text(f"name: fresh-skill\nversion: 1\nkind: rules\ntext: |\n  Rule {tmp_path.name}: greet by name.\n")
    with pytest.raises(SkillNotCompiledError, match=r"kvagent skills compile .*fresh_skill.yaml --model smollm2-135m"):
        model(skills=[str(skill)]).invoke("Hi")
    with pytest.raises(UnknownSkillError, match="skill_dirs"):
        m.include_skill("no-such-skill")
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'"):
        ChatKVAgent(model="no-such-model").invoke("Hi")  # constructing loads nothing; the first call says so
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        ChatKVAgent(model=str(tmp_path / "missing.gguf")).invoke("Hi")


def test_compiled_skill_is_transplanted_and_counted_as_cache_read(tmp_path: Path) -> None:
    skill = tmp_path / "greeting.yaml"
    skill.write_text("name: greeting\nversion: 1\nkind: rules\nseam: 4\ntext: |\n"
                     f"  Greet the customer by name ({tmp_path.name}). "
                     + "Thank them for choosing Northwind Outdoor and offer help with orders, returns and repairs. " * 3
                     + "\n")
    # a policy of its own: a session that shares the policy and the system tag after it with another one
    # reuses that tag from there, and the skill (whose span it starts) is then decoded, not transplanted
    m = model(policy=f"{POLICY}\nDesk {tmp_path.name}.", skills=[str(skill)], compile_skills=True)
    reply = m.invoke("Hello!", session_id="skill")
    meta = reply.response_metadata
    assert meta["transplanted"] > 0
    assert reply.usage_metadata["input_token_details"]["cache_read"] >= meta["transplanted"]


# -- eviction, save, load, capacity -------------------------------------------------------------------
async def test_save_and_load_round_trip(tmp_path: Path) -> None:
    m = model(policy=POLICY)
    first = await m.ainvoke("Hello", session_id="saved")
    path = tmp_path / "chat.kvlc"
    assert await m.asave_session(path, session_id="saved") > 0
    other = model(policy=POLICY)
    await other.aload_session(path, session_id="restored")
    assert other.session("restored").tokens == m.session("saved").tokens
    follow = await other.ainvoke(["Hello", first, "Thanks!"], session_id="restored")
    assert follow.response_metadata["reused"] >= len(m.session("saved").tokens) - 1


async def test_eviction_can_be_switched_on_a_live_session() -> None:
    m = model(policy=POLICY)
    await m.ainvoke("Hello", session_id="ev")
    tokens = m.session("ev").tokens
    await m.aset_eviction(Eviction("window", budget=256, chunk=32), session_id="ev")
    assert m.session("ev").tokens == tokens and m.session("ev").cache.evictor is not None
    long = " ".join(f"Note {i}: the customer asked about tent pegs." for i in range(40))
    reply = await m.ainvoke(["Hello", AIMessage(m.session("ev").segments[-1].text), long], session_id="ev")
    assert reply.content and m.session("ev").evicted_positions


def test_idle_sessions_are_closed_when_sequences_run_short() -> None:
    m = ChatKVAgent(model=SETTINGS["model"], n_ctx=1024, n_seq_max=2, max_tokens=4)  # 1 session + 1 scratch
    first = m.invoke("Hi", session_id="one")
    m.invoke("Hi", session_id="two")  # closes "one" (idle) to keep a scratch sequence free
    assert m.session_ids() == ["two"]
    with pytest.raises(UnknownSessionError, match="closed to free a sequence"):
        m.session("one")
    again = m.invoke(["Hi", first, "Hello again"], session_id="one")  # rebuilt from the resent history
    assert again.content
