"""Memory blocks on the real models: edits through the memory tools at the head (a kvagent edit) and at the tail
(only the tail recomputed), refused edits that change nothing, and a block edited 100 times."""

from __future__ import annotations

import pytest

from kvagent import Engine, Segment
from kvagent.memory import Memory, MemoryBlock
from kvagent.skills.fidelity import cosine
from kvagent.tools import ToolCall

POLICY = Segment.policy("You are a personal assistant. Use what you remember about the user.")
HUMAN = MemoryBlock("human", "Name: Ada Lovelace\nCity: London\nPrefers tea.", "facts about the user", limit=400)
PERSONA = MemoryBlock("persona", "I am Sam, a helpful assistant.", read_only=True)


def head_session(engine: Engine, memory: Memory):  # type: ignore[no-untyped-def]
    s = engine.session([POLICY, *memory.segments(), Segment.user("Hello!"), Segment.assistant("Hi Ada.")],
                       fields=memory.fields(), share_prefix=False)
    s.prefill()
    return s


@pytest.mark.parametrize(("call", "after"), [
    (ToolCall("memory_replace", {"label": "human", "old": "London", "new": "Paris"}), "City: Paris"),
    (ToolCall("memory_append", {"label": "human", "text": "Has a cat named Mia."}), "Has a cat named Mia."),
    (ToolCall("memory_rethink", {"label": "human", "new_value": "Name: Ada\nCity: Rome"}), "City: Rome"),
])
def test_a_memory_tool_call_edits_the_head_block_in_place(engine: Engine, call: ToolCall, after: str) -> None:
    memory = Memory([HUMAN, PERSONA])
    with head_session(engine, memory) as s:
        n_before = len(s.tokens)
        result = s.run(memory.apply_work(s, call))
        assert result.startswith("memory block 'human' updated") and after in result
        assert after in memory.values(s)["human"] and after in s.field_values["human"]
        kinds = [seg.kind.value for seg in s.segments]
        assert kinds.count("erratum") <= 1 and "field" in kinds
        # the turns after the block were kept (stale or behind an erratum), not all computed again
        assert len(s.tokens) >= n_before - 16


@pytest.mark.parametrize(("call", "message"), [
    (ToolCall("memory_replace", {"label": "human", "old": "Berlin", "new": "Paris"}), "does not contain 'Berlin'"),
    (ToolCall("memory_append", {"label": "persona", "text": "x"}), "is read-only"),
    (ToolCall("memory_rethink", {"label": "human", "new_value": "x" * 401}), "at most 400 characters"),
    (ToolCall("memory_append", {"label": "nobody", "text": "x"}), "no memory block 'nobody'"),
])
def test_a_refused_memory_edit_changes_nothing(engine: Engine, call: ToolCall, message: str) -> None:
    memory = Memory([HUMAN, PERSONA])
    with head_session(engine, memory) as s:
        tokens, segments = s.tokens, s.segments
        result = s.run(memory.apply_work(s, call))
        assert result.startswith("error: ") and message in result
        assert s.tokens == tokens and s.segments == segments


@pytest.mark.full  # a long run of one block (15 s); the fast tier edits blocks in the module's other checks
def test_a_block_edited_100_times_stays_within_the_context_and_holds_the_latest_value(engine: Engine) -> None:
    memory = Memory([MemoryBlock("counter", "visits: 0", limit=64)])
    with engine.session([POLICY, *memory.segments(), Segment.user("Hello!")], fields=memory.fields(),
                        share_prefix=False, compact_after=4) as s:
        s.prefill()
        lengths = []
        for i in range(1, 101):
            s.run(memory.apply_work(s, ToolCall("memory_rethink", {"label": "counter", "new_value": f"visits: {i}"})))
            lengths.append(len(s.tokens))
        assert max(lengths) <= lengths[0] + 64 < s.n_ctx  # splices do not grow it; errata compact past 4
        assert s.field_values["counter"] == "visits: 100"
        assert "visits: 100" in "".join(seg.text for seg in s.segments)


def test_tail_memory_recomputes_only_the_tail_and_transplants_into_a_new_conversation(engine: Engine) -> None:
    memory = Memory([HUMAN], position="tail")
    turns = [Segment.user("Hello!"), Segment.assistant("Hi, how can I help?"), Segment.user("Where do I live?")]
    for segment in memory.segments():
        engine.skills.compile_segment(segment, engine.renderer(True))
    with engine.session([POLICY, *turns, *memory.segments()], share_prefix=False) as s:
        report = s.prefill()
        assert report.transplanted > 0  # the compiled memory was copied in, not computed
        done = s.run(memory.edit_work(s, "human", "replace", old="London", new="Paris"))
        block = len(engine.renderer(True).segment_tokens(memory.segments()[0]))
        assert done.report is not None and done.report.computed <= block + 2  # the tail only
        edited = s.logits()
        final = list(s.segments)
    with engine.session(final, share_prefix=False) as cold:
        reference = cold.logits()
    assert cosine(edited, reference) >= 0.999  # the tail was recomputed in place: as exact as a cold prefill
