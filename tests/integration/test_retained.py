"""Retained KV on the real models: a closed session's cells serve the next session of its scope.

A client without a session key opens a new conversation per request and resends its history. Each case runs that
client (a new session per request, closed after the reply) in a scope of its own, so other tests' retained
sequences never take part, and checks what it computes and what it answers:

- against the same turns on one keyed session (the path a session key gets): the same reply tokens;
- against a cold prefill of the same final prompt: the greedy token, and the logits within the implicit edits'
  floor (``test_implicit_edits``: a splice keeps the KV after it stale, so not exact);
- a prefix taken from a retained sequence is the cells a cold prefill computes: exact.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvagent.messages import ChatMessage, to_segments
from kvagent.skills.fidelity import logit_cosine
from tests.models import FIRST

RULES = "\n".join(f"Rule {i}: when a customer asks about order type {i}, check ledger entry {i * 7} and reply "
                  "politely." for i in range(10))
QUESTIONS = ["Where is my order 1234?", "Can I change the address?", "How long does shipping take?"]
_scopes = itertools.count()


def system(minute: int) -> ChatMessage:
    return ChatMessage("system", f"You are a support agent.\nCurrent time: 2026-12-07 10:{minute:02d}\n{RULES}\n"
                                 "Be brief.")


def scope() -> str:
    return f"retained-test-{next(_scopes)}"


def keyless(engine: Any, messages: list[ChatMessage], where: str, max_tokens: int = 6) -> tuple[Any, Any]:
    """One request of a client that sends no session key: a new session, closed after the reply."""
    with engine.session(scope=where) as session:
        gen = session.generate(max_tokens, segments=to_segments(messages))
        return gen, session.logits()


def test_a_new_conversation_starts_from_a_closed_ones_prefix_exactly(engine: Any) -> None:
    where = scope()
    keyless(engine, [system(0), ChatMessage("user", QUESTIONS[0])], where)
    messages = [system(0), ChatMessage("user", QUESTIONS[1])]
    gen, logits = keyless(engine, messages, where)
    with engine.session(to_segments(messages), share_prefix=False) as cold:
        cold_gen = cold.generate(6)
    question = len(engine.renderer(True).render(to_segments(messages[1:])).tokens)
    assert gen.computed <= question + 8 and gen.reused > 200 and gen.resumed == 0
    assert gen.token_ids == cold_gen.token_ids


def test_a_keyless_history_with_a_changed_clock_line_resumes_its_conversation(engine: Any) -> None:
    where = scope()
    history: list[ChatMessage] = []
    keyed = engine.session(scope=scope())
    try:
        for turn, question in enumerate(QUESTIONS):
            messages = [system(turn), *history, ChatMessage("user", question)]
            gen, logits = keyless(engine, messages, where)
            mine = keyed.generate(6, segments=to_segments(messages))
            if turn:
                new = len(engine.renderer(True).render(to_segments(messages[-1:])).tokens)
                # the minute (one token or two), the reply before it (its closing), the new question, the last token
                assert gen.computed <= 2 + new + 64 < len(keyed.tokens) // 2, (turn, gen.computed)
                assert gen.resumed > 0 and [e.kind for e in gen.edits] == ["replace"]
                assert gen.computed == mine.computed
            assert gen.token_ids == mine.token_ids  # the same reply as a keyed session's
            history += [messages[-1], ChatMessage("assistant", gen.text)]
        keyed_logits = keyed.logits()
        with engine.session(keyed.segments, share_prefix=False) as cold:
            cold_logits = cold.logits()
            assert cold.tokens == keyed.tokens
        # the cache's own noise floor: the same prompt extended warm from a cached prefix against cold
        with engine.session(keyed.segments[:-2], share_prefix=False) as warm:
            warm.prefill()
            warm.resend(keyed.segments)
            floor = logit_cosine(warm.logits(), cold_logits)
        # the keyed session's cells, resumed: they differ from its own only as cells decoded in other chunks do
        assert logit_cosine(logits, keyed_logits) >= floor - 0.001, floor
        # two clock lines spliced in place: the KV after them is stale, as on a keyed session (the same floor)
        assert logit_cosine(logits, cold_logits) >= logit_cosine(keyed_logits, cold_logits) - 0.005
        assert logits.argmax() == cold_logits.argmax() == keyed_logits.argmax()
    finally:
        keyed.close()


def test_a_conversation_is_never_resumed_from_another_scope(engine: Any) -> None:
    mine, other = scope(), scope()
    keyless(engine, [system(0), ChatMessage("user", QUESTIONS[0])], other)
    gen, _ = keyless(engine, [system(1), ChatMessage("user", QUESTIONS[0])], mine)
    assert gen.resumed == 0 and gen.reused == 0


def test_a_prefix_given_back_under_pressure_is_restored_from_host_memory_exactly(engine: Any) -> None:
    where = scope()
    keyless(engine, [system(0), ChatMessage("user", QUESTIONS[0])], where)
    assert engine.pool.reclaim()  # the pool needs the room: the prefix goes to the RAM tier, its cells are freed
    assert engine.pool.retained == () and len(engine.tiers) == 1
    messages = [system(0), ChatMessage("user", QUESTIONS[1])]
    gen, _ = keyless(engine, messages, where)
    with engine.session(to_segments(messages), share_prefix=False) as cold:
        cold_gen = cold.generate(6)
    question = len(engine.renderer(True).render(to_segments(messages[1:])).tokens)
    assert gen.restored > 200 and gen.computed <= question + 8
    assert gen.token_ids == cold_gen.token_ids


def test_a_side_request_under_the_same_key_does_not_lose_the_conversation(engine: Any) -> None:
    """An agent's side request on its own session (another system prompt: smolagents' final-answer call) replaces
    the prompt; the conversation it left is retained, and the next ordinary step resumes it (its new tokens only)."""
    where = scope()
    history = [system(0), ChatMessage("user", QUESTIONS[0])]
    with engine.session(scope=where) as session:
        gen = session.generate(6, segments=to_segments(history))
        history.append(ChatMessage("assistant", gen.text))
        side = [ChatMessage("system", "Write the final answer to the task below in one short sentence."),
                ChatMessage("user", "Task: " + QUESTIONS[0])]
        session.generate(6, segments=to_segments(side))
        assert any(r.scope == where for r in engine.pool.retained)  # the conversation it left
        history.append(ChatMessage("user", QUESTIONS[1]))
        back = session.generate(6, segments=to_segments(history))
        new = len(engine.renderer(True).render(to_segments(history[-1:])).tokens)
        assert back.resumed > 0 and back.computed <= new + 8, (back.resumed, back.computed)
        tokens = session.tokens
    with engine.session(to_segments(history), share_prefix=False) as cold:
        cold_gen = cold.generate(6)
        assert cold.tokens == tokens
    assert back.token_ids == cold_gen.token_ids


AGENTS = [f"You are the {desk} agent of a bicycle shop.\n" + "\n".join(
    f"Rule {i}: {rule} {i * 3}." for i in range(8)) for desk, rule in [
    ("workshop", "book a repair slot only after checking the bench calendar, page"),
    ("orders", "quote the delivery estimate from the courier's table, row")]]
"""Two agents' system prompts: nothing in common after "You are the"."""


@pytest.mark.parametrize("pressure", [False, pytest.param(True, marks=pytest.mark.full)],
                         ids=["in the pool", "given back to host memory"])
def test_agents_taking_turns_each_come_back_to_their_own_prompt(engine: Any, pressure: bool) -> None:
    """Two agents with their own system prompts and the same compiled tools take turns, A B A, each request a new
    session. B starts afresh, the tools transplanted, rather than resuming A's conversation to keep only the tools;
    so A's next conversation keeps its whole prompt: from the pool, or, where the pool needed the room after each
    request, restored from host memory. Its reply is a cold session's."""
    from tests.tool_cases import TOOLS

    where = scope()
    tools = engine.tool_segments(TOOLS, scope=where)

    def prompt(agent: int, question: str) -> list[Any]:
        return [*to_segments([ChatMessage("system", AGENTS[agent])]), *tools, *to_segments([ChatMessage("user",
                                                                                                        question)])]

    def request(agent: int, question: str) -> Any:
        with engine.session(scope=where) as session:
            gen = session.generate(6, segments=prompt(agent, question))
        if pressure:
            while engine.pool.reclaim():  # the pool needs the room: retained prefixes go to the RAM tier
                pass
        return gen

    request(0, QUESTIONS[0])
    other = request(1, QUESTIONS[1])
    back = request(0, QUESTIONS[2])
    question = len(engine.renderer(True, where).render(to_segments([ChatMessage("user", QUESTIONS[2])])).tokens)
    assert other.resumed == 0 and back.resumed == 0, (other.resumed, back.resumed)
    assert back.computed <= question + 8, back.computed
    assert (back.restored > 0) is pressure
    with engine.session(prompt(0, QUESTIONS[2]), share_prefix=False) as cold:
        assert back.token_ids == cold.generate(6).token_ids


REFERENCE = "\n".join(f"Courier table row {i}: zone {i % 5}, {i + 2} working days, tracking prefix LK{i * 11}."
                      for i in range(10))
"""A reference block both agents' prompts hold, after their own instructions."""


@pytest.mark.parametrize("n_seq_max", [None, pytest.param(2, marks=pytest.mark.full)],
                         ids=["free sequences", "no free sequence"])
def test_a_conversation_another_prompt_takes_over_is_kept_in_host_memory_for_its_own(engine: Any,
                                                                                   n_seq_max: int | None) -> None:
    """Agent B's prompt holds the reference block agent A's conversation holds, after instructions of its own: B
    resumes A's retained conversation to keep the block, and A's conversation, whose instructions B drops, is saved
    into host memory first (copied through a free sequence, or saved as it is where none is free: a pool of two,
    B's session and A's conversation); A's next conversation restores it (the question computed, nothing else) and
    answers as a cold session does."""
    if n_seq_max is not None:
        from kvagent import Engine

        with Engine.load(engine.model.name, n_ctx=2048, n_seq_max=n_seq_max) as small:
            test_a_conversation_another_prompt_takes_over_is_kept_in_host_memory_for_its_own(small, None)
        return
    where = scope()

    def prompt(agent: int, question: str) -> list[ChatMessage]:
        return [ChatMessage("system", AGENTS[agent] + "\n\n" + REFERENCE), ChatMessage("user", question)]

    keyless(engine, prompt(0, QUESTIONS[0]), where)
    other, _ = keyless(engine, prompt(1, QUESTIONS[1]), where)
    stored = len(engine.tiers)  # type: ignore[arg-type]
    back, _ = keyless(engine, prompt(0, QUESTIONS[2]), where)
    question = len(engine.renderer(True).render(to_segments([ChatMessage("user", QUESTIONS[2])])).tokens)
    assert other.resumed > 0 and stored >= 1, (other.resumed, stored)
    assert back.restored > 0 and back.computed <= question + 8, (back.restored, back.computed)
    with engine.session(to_segments(prompt(0, QUESTIONS[2])), share_prefix=False) as cold:
        assert back.token_ids == cold.generate(6).token_ids


def resident_bytes() -> int:
    """This process's resident memory (``VmRSS``)."""
    for line in open("/proc/self/status", encoding="ascii"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS in /proc/self/status")  # pragma: no cover - Linux only


@pytest.mark.full  # 16 prefixes through the tiers on an engine of its own
def test_full_tiers_keep_memory_and_disk_within_their_bounds_and_lose_nothing_live() -> None:
    """Sixteen conversations of about 250 tokens (about 5.7 MB of KV each, some 90 MB in all) pass through tiers of
    8 MiB in host memory and 8 MiB on disk. The process's resident memory grows by at most the RAM tier's bound and
    a margin of 32 MiB (an unbounded tier would grow by some 80 MB), the disk folder stays within its bound, and a
    live session opened first holds byte for byte the same cells at the end."""
    from kvagent import Engine

    ram, disk = 8 << 20, 8 << 20
    with Engine.load(FIRST, n_ctx=2048, n_seq_max=3, cache_ram_mb=ram >> 20,
                     cache_disk_mb=disk >> 20) as small:
        live = small.session(to_segments([system(0), ChatMessage("user", QUESTIONS[0])]), share_prefix=False)
        live.prefill()
        before = small.backend.seq_save(live.seq)  # the live cells' bytes
        folder = small.tiers.lower.store.folder  # type: ignore[union-attr]
        grown = []
        for n in range(16):
            topic = f"Conversation {n}: the customer's favourite colour is shade {n * 37 % 101}.\n{RULES}"
            with small.session([*to_segments([ChatMessage("system", topic)])]) as s:
                s.prefill()
            # the pool holds one retained sequence beside the live one: each new one gives the last back to the tiers
            ram_tier, disk_tier = small.tiers.tiers()  # type: ignore[union-attr]
            assert ram_tier.bytes <= ram and disk_tier.bytes <= disk
            assert sum(f.stat().st_size for f in folder.iterdir()) <= disk
            if n == 3:
                start = resident_bytes()  # after the first prefixes: the engine's buffers are at their size
            if n > 3:
                grown.append(resident_bytes() - start)
        stored = sum(len(t) for t in small.tiers.tiers())  # type: ignore[union-attr]
        assert stored >= 2, stored  # the tiers did fill
        assert len(grown) >= 10
        assert max(grown) <= ram + (32 << 20), [g >> 20 for g in grown]
        assert small.backend.seq_save(live.seq) == before
        live.close()
