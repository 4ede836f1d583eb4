"""The proxy's prefix-stable layout (``kvagent_server.layout``): a table of the changes agents make to their own
prompts, then the property a prefix cache needs."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from kvagent.edits.implicit import field_name
from kvagent_server.layout import Layout, Planner, key

DOC = "\n".join(f"Policy clause {i}: refunds within {i + 10} days." for i in range(60))  # ~2.7k characters


def S(clock: str = "10:00", tier: str = "gold", extra: str = "") -> dict[str, Any]:
    text = f"You are the support agent.\nCurrent time: {clock}\nTier: {tier}\n{extra}{DOC}"
    return {"role": "system", "content": text}


def U(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def A(text: str | None, calls: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = [{"id": c, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
                             for c in calls]
    return out


def T(call: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call, "content": text}


FIRST = [S(), U("Where is my order?")]
REPLY = A("It shipped.")
LONG_REPLY = A("It shipped on Monday by ground; the carrier confirmed the pickup. " * 20)
HISTORY = [*FIRST, REPLY]
LONG_RESULT = "order 77: " + "shipped via ground; " * 80
TOOLS = [S(), U("Where is order 77?"), A(None, ("c1",)), T("c1", LONG_RESULT), A("It shipped."), U("Thanks.")]
UPDATE = "[STATE UPDATE] {} -> {}; overrides any previous value"

# (name, messages of the turn before (None: no session), the reply, this turn's messages,
#  kind, errata lines added, the messages forwarded: "sent" = the previous request and reply, then these)
CASES: list[tuple[str, Any, Any, list[dict[str, Any]], str, list[str], list[Any]]] = [
    ("first request", None, None, FIRST, "new", [], FIRST),
    ("the next turn appended", FIRST, REPLY, [*HISTORY, U("When?")], "append", [], ["sent", U("When?")]),
    ("the reply resent in the SDK's shape", FIRST, REPLY,
     [*FIRST, {**REPLY, "refusal": None, "name": None}, U("When?")], "append", [], ["sent", U("When?")]),
    ("a clock line changed near the top", FIRST, REPLY, [S("10:05"), *HISTORY[1:], U("When?")], "errata",
     [UPDATE.format("Current time", "10:05")], ["sent", "erratum", U("When?")]),
    ("the same question asked again after a change", FIRST, REPLY, [S("10:05"), *HISTORY[1:], FIRST[1]], "errata",
     [UPDATE.format("Current time", "10:05")], ["sent", "erratum", FIRST[1]]),
    ("two lines changed", FIRST, REPLY, [S("10:05", "silver"), *HISTORY[1:], U("When?")], "errata",
     [UPDATE.format("Current time", "10:05"), UPDATE.format("Tier", "silver")], ["sent", "erratum", U("When?")]),
    ("a memory block inserted into the system prompt", FIRST, REPLY,
     [S(extra="<memory>likes email</memory>\n"), *HISTORY[1:], U("Hi")], "errata",
     [UPDATE.format("<memory>likes email</memory>", "<memory>likes email</memory>")],
     ["sent", "erratum", U("Hi")]),
    ("a long tool result cleared", TOOLS[:-2] + [A("It shipped.")] + [U("Thanks.")], A("Welcome."),
     [*TOOLS[:3], T("c1", "[cleared]"), A("It shipped."), U("Thanks."), A("Welcome."), U("Bye.")], "errata",
     [UPDATE.format("order 77", "[cleared]")], ["sent", "erratum", U("Bye.")]),
    ("old turns summarised into one message", [*FIRST, LONG_REPLY, U("And the invoice?")], A("Sent by email."),
     [S(), U("Summary: order shipped, invoice sent."), U("Anything else?")], "errata",
     [UPDATE.format("Where is my order?", "(removed)"),
      UPDATE.format(field_name(LONG_REPLY["content"]), "(removed)"),
      UPDATE.format("And the invoice?", "(removed)"), UPDATE.format("Sent by email.", "(removed)")],
     ["sent", "erratum", U("Summary: order shipped, invoice sent."), U("Anything else?")]),
    ("a message inserted before the last reply (in place)", FIRST, REPLY,
     [*FIRST, U("(note: VIP)"), REPLY, U("When?")], "inplace", [], [*FIRST, U("(note: VIP)"), REPLY, U("When?")]),
    ("a message inserted before a long reply", FIRST, LONG_REPLY, [*FIRST, U("(note: VIP)"), LONG_REPLY, U("When?")],
     "errata", [UPDATE.format("user message", "(note: VIP)")], ["sent", "erratum", U("When?")]),
    ("the last question rewritten (in place: only the tail is computed)", FIRST, REPLY,
     [S(), U("Where is my parcel?")], "inplace", [], [S(), U("Where is my parcel?")]),
    ("the reply regenerated (in place)", FIRST, REPLY, FIRST, "inplace", [], FIRST),
    ("another conversation on the same key: a new layout", FIRST, REPLY, [S(tier="x"), U("Hi")], "new", [],
     [S(tier="x"), U("Hi")]),
    ("the first message's role changed: a new layout", FIRST, REPLY, [U("Hi")], "new", [], [U("Hi")]),
]


def _run(previous: Any, reply: Any, messages: list[dict[str, Any]], planner: Planner = Planner()) -> tuple[Any, Any]:
    layout = None
    sent: list[dict[str, Any]] = []
    if previous is not None:
        first = planner.plan(None, previous)
        layout = first.layout
        layout.commit(reply)
        sent = list(layout.sent)
    return planner.plan(layout, messages), sent


@pytest.mark.parametrize("name,previous,reply,messages,kind,errata,expected", CASES, ids=[c[0] for c in CASES])
def test_a_change_becomes_the_layout_of_the_table(name: str, previous: Any, reply: Any, messages: Any, kind: str,
                                                  errata: list[str], expected: list[Any]) -> None:
    forward, sent = _run(previous, reply, messages)
    assert forward.kind == kind
    assert list(forward.errata) == errata
    want: list[Any] = []
    for part in expected:
        if part == "sent":
            want += sent
        elif part == "erratum":
            want.append({"role": "system", "content": "\n".join(errata)})
        else:
            want.append(part)
    assert forward.messages == want


def test_an_erratum_before_the_cut_is_never_dropped_by_an_in_place_change() -> None:
    """An erratum stands after the turns; a later change near the end that would cut it is an erratum too."""
    planner = Planner()
    first = planner.plan(None, FIRST)
    first.layout.commit(REPLY)
    second = planner.plan(first.layout, [S("10:05"), *HISTORY[1:], U("When?")])
    assert second.kind == "errata"
    second.layout.commit(A("Tomorrow."))
    # the client rewrites its last question: the cut would fall after the erratum, which stays
    third = planner.plan(second.layout, [S("10:05"), *HISTORY[1:], U("When exactly?")])
    assert third.kind == "inplace"
    assert any(m["content"].startswith("[STATE UPDATE] Current time -> 10:05") for m in third.messages
               if m["role"] == "system")
    # a change before the erratum cannot be made in place
    fourth = planner.plan(second.layout, [S("10:05"), U("Where is my order??"), REPLY, U("When?")])
    assert fourth.kind == "errata"


def test_the_erratum_role_and_the_tail_threshold_are_settings() -> None:
    forward, _ = _run(FIRST, REPLY, [S("10:05"), *HISTORY[1:], U("When?")], Planner(role="user"))
    assert forward.messages[-2] == {"role": "user", "content": UPDATE.format("Current time", "10:05")}
    forward, _ = _run(FIRST, REPLY, [S(), U("Where is my parcel?")], Planner(inplace_tail_chars=0))
    assert forward.kind == "errata"


def test_rebuilt_folds_the_errata_into_the_clients_messages() -> None:
    layout = Layout.rebuilt([S("10:05"), U("x")])
    assert layout.sent == [S("10:05"), U("x")] and layout.errata == [] and layout.where == [0, 1]
    assert layout.client == [key(S("10:05")), key(U("x"))]


_EDITS = st.lists(st.tuples(st.sampled_from(["clock", "tier", "ask", "regenerate", "clear"]),
                            st.integers(0, 59)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(_EDITS)
def test_every_forwarded_request_extends_the_previous_one_or_says_why_not(edits: list[tuple[str, int]]) -> None:
    """Whatever an agent does to its prompt, an ``append`` or ``errata`` request starts with the previous request
    and its reply byte for byte (what a prefix cache reuses); ``inplace`` keeps all but a short tail."""
    planner = Planner()
    clock, tier = "10:00", "gold"
    turns: list[dict[str, Any]] = []
    messages = [S(clock, tier), U("q0")]
    forward = planner.plan(None, messages)
    for n, (edit, value) in enumerate(edits):
        reply = A(f"answer {n}")
        layout = forward.layout
        layout.commit(reply)
        before = list(layout.sent)
        turns = [*messages[1:], reply]
        if edit == "clock":
            clock = f"10:{value:02d}"
        elif edit == "tier":
            tier = f"tier{value}"
        elif edit == "regenerate":
            turns = turns[:-1]
        elif edit == "clear" and len(turns) > 2:
            turns[0] = U("[cleared]")
        if edit != "regenerate":
            turns.append(U(f"q{n + 1}"))
        messages = [S(clock, tier), *turns]
        forward = planner.plan(layout, messages)
        if forward.kind in ("append", "errata"):
            assert forward.messages[:len(before)] == before
        else:
            assert forward.kind == "inplace"
            kept = next(i for i, (a, b) in enumerate(zip([*forward.messages, None], [*before, None])) if a != b)
            assert sum(len(m["content"] or "") for m in before[kept:]) <= planner.inplace_tail_chars
        # the client's messages map onto what was sent: every one it wrote stands there, or as an erratum
        assert len(forward.layout.where) == len(messages)
        for i, w in enumerate(forward.layout.where):
            if w >= 0:
                assert key(forward.layout.sent[w]) == key(messages[i])
