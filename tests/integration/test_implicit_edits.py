"""Implicit edits on the real models: a resent prompt that changed inside is edited in place (``Session.resend``,
``kv.rebase``), and each kind of edit is checked against a cold prefill of the same final prompt.

On Gemma-3 they are copies (``make test-copies``, not CI): the prompts stay inside its sliding window, so nothing
here depends on the architecture that SmolLM2 does not check. The reference is the shift-invariant logit cosine the skills use (``logit_cosine``), next to the cache's own noise
floor: the same prompt reused warm (extended from a cached prefix) against cold. Spliced regions keep the KV after
them stale, as a field-only edit does; what must hold exactly is checked exactly: the tokens the cache holds, the
cells it reports reused and computed, and a fallback's logits (a recompute) against the cold prefill.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from kvagent.messages import ChatMessage, to_segments
from kvagent.skills.fidelity import logit_cosine
from kvagent.tools.format import ToolCall

RULES = [f"Rule {i}: when a customer asks about order type {i}, check ledger entry {i * 7} and reply politely."
         for i in range(8)]


def system(minute: int = 10, memory: str = "likes tea", rules: list[str] = RULES) -> ChatMessage:
    body = "\n".join(rules)
    return ChatMessage("system", f"You are a support agent.\nCurrent time: 2026-12-06 09:{minute:02d}\n{body}\n"
                                 f"<memory chars={len(memory)}>{memory}</memory>\nBe brief.")


CALL = ToolCall("lookup", {"topic": "refunds"}, id="c1")
RESULT = "Refunds are accepted within 30 days of delivery when the item is unused and in its original packaging. " * 3
TURNS = [ChatMessage("user", "Where is my order 1234?"), ChatMessage("assistant", "It shipped yesterday."),
         ChatMessage("user", "Look up the refund policy."), ChatMessage("assistant", "", tool_calls=(CALL,)),
         ChatMessage("tool", RESULT, name="lookup", tool_call_id="c1"), ChatMessage("assistant", "Within 30 days."),
         ChatMessage("user", "Thanks. And the warranty?"), ChatMessage("assistant", "Two years."),
         ChatMessage("user", "Can I return a gift?")]
OLD = [system(), *TURNS]
CLEARED = ChatMessage("tool", "[cleared]", name="lookup", tool_call_id="c1")
OTHER_CALL = ChatMessage("assistant", "", tool_calls=(ToolCall("lookup", {"topic": "returns"}, id="c1"),))

# (name, new messages, kinds of the edits applied)
CASES = [
    ("a clock line", [system(11), *TURNS], ["replace"]),
    ("a memory block grows", [system(memory="likes tea and owns a cat named Pip"), *TURNS], ["replace"]),
    ("a line deleted", [system(rules=RULES[:4] + RULES[5:]), *TURNS], ["delete"]),
    ("a line inserted", [system(rules=RULES[:4] + ["Rule 99: gifts need a receipt."] + RULES[4:]), *TURNS], ["insert"]),
    ("a tool result cleared", [system(), *TURNS[:4], CLEARED, *TURNS[5:]], ["replace"]),
    ("two regions", [system(11, "likes coffee"), *TURNS], ["replace", "replace"]),
    ("everything changed", [ChatMessage("system", "You are a poet. " * 40), ChatMessage("user", "Write.")],
     ["fallback"]),
    ("a tool call's arguments", [system(), *TURNS[:3], OTHER_CALL, *TURNS[4:]], ["fallback"]),
]


def _cold(engine: Any, messages: list[ChatMessage]) -> tuple[Any, tuple[int, ...]]:
    with engine.session(to_segments(messages), share_prefix=False) as cold:
        return cold.logits(), cold.tokens


@pytest.fixture(scope="module")
def floors(engine: Any) -> dict[str, float]:
    """The noise floor per model: the same final prompt extended warm from a cached prefix against cold."""
    with engine.session(to_segments(OLD[:-1]), share_prefix=False) as warm:
        warm.prefill()
        warm.resend(to_segments(OLD))
        warm_logits = warm.logits()
    cold, _ = _cold(engine, OLD)
    return {engine.model.name: logit_cosine(warm_logits, cold)}


_COSINES: dict[str, list[float]] = {}


@pytest.mark.parametrize("name,new,kinds", CASES, ids=[c[0] for c in CASES])
def test_each_edit_kind_against_a_cold_prefill(engine: Any, floors: dict[str, float], name: str,
                                               new: list[ChatMessage], kinds: list[str]) -> None:
    with engine.session(to_segments(OLD), share_prefix=False) as session:
        session.prefill()
        report = session.resend(to_segments(new))
        ours = session.logits()
        held, stale = session.tokens, session.stale_positions
    cold, tokens = _cold(engine, new)
    assert held == tokens  # the cache holds exactly the new prompt
    assert [e.kind for e in report.edits] == kinds
    assert report.reused + report.computed + report.transplanted == len(tokens)
    spliced = [e for e in report.edits if e.kind != "fallback"]
    # honest accounting: computed = the changed tokens + the new ones at the end (none here) + the last token's logits
    assert report.computed <= sum(e.new_end - e.new_first for e in spliced) + 1 or not spliced
    cos = logit_cosine(ours, cold)
    if spliced:
        assert stale  # the KV after a splice is kept, and marked stale
        _COSINES.setdefault(engine.model.name, []).append(cos)
        assert cos > 0.98 and ours.argmax() == cold.argmax()  # a misplaced or wrongly rotated cell scores far lower
    else:  # a fallback recomputes from the change: the cold prefill's logits, up to the cache's noise
        assert not stale
        assert cos >= floors[engine.model.name] - 0.001
        assert report.edits[0].reason


def test_the_median_edit_is_within_the_noise_floor(engine: Any, floors: dict[str, float]) -> None:
    cosines = _COSINES.get(engine.model.name)
    if not cosines:
        pytest.skip("runs after the edit kinds of this model (run the module)")
    assert statistics.median(cosines) >= floors[engine.model.name] - 0.005, (cosines, floors)


def test_an_unchanged_prompt_changes_nothing(engine: Any) -> None:
    with engine.session(to_segments(OLD), share_prefix=False) as session:
        first = session.resend(to_segments(OLD))
        again = session.resend(to_segments(OLD))
        assert again.computed == 0 and again.edits == () and first.edits == ()
        assert not session.stale_positions


def test_a_region_edited_turn_after_turn_is_a_discovered_field(engine: Any) -> None:
    with engine.session(share_prefix=False) as session:
        history: list[ChatMessage] = []
        for minute in range(3):
            messages = [system(10 + minute), *history, ChatMessage("user", f"Question {minute}?")]
            gen = session.generate(2, segments=to_segments(messages))
            history += [messages[-1], ChatMessage("assistant", gen.text)]
        assert session.discovered_fields == {"Current time": 2}
        assert [e.kind for e in gen.edits] == ["replace"] and gen.edits[0].line == "Current time: 2026-12-06 09:12"


def test_a_turn_that_edits_in_place_reserves_only_the_cells_it_adds(engine: Any) -> None:
    # the server makes room in the shared KV pool from this estimate: a changed clock line must not reserve the
    # whole prompt again (a 4k-token prompt in an 8k pool would be refused)
    with engine.session(to_segments(OLD), share_prefix=False) as session:
        session.prefill()
        closing = session.renderer.closing_length("assistant") + 1
        edited = session.fit(to_segments([system(11), *TURNS, ChatMessage("user", "One more.")]), 8)
        rebuilt = session.fit(to_segments([ChatMessage("system", "You are a poet. " * 40), ChatMessage("user", "Hi")]), 8)
        assert edited.cells <= 1 + 12 + 8 + closing < rebuilt.cells  # the minute, the new message, the reply
