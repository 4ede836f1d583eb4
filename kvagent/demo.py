"""The demo: one scripted support conversation on kvagent, side by side with llama-cpp-python's own chat API.

The agent's prompt is a policy, a compiled skill (``skills/refund_policy.yaml``: transplanted, not computed),
two declared fields and a long account history (memory). Mid-way the order ships: kvagent appends an erratum
line (``session.set``), where the baseline does what users do today and rewrites the value in its system
prompt. The memory is longer than the agent's eviction budget: kvagent keeps at most ``BUDGET`` cells
(``Eviction("window")``: the pinned policy, skill and fields plus the most recent tokens; it needs no
activation capture, so the demo needs no torch and its session stays in the shared decode batch), where the
baseline keeps every token. Per turn both report the prompt tokens they computed, the time to the first
token and the answer. The baseline (the backend registry's ``baseline_chat``: llama-cpp-python's chat API) renders the same messages
with the model's own chat template, so both see the same conversation.

One turn calls a tool: the agent looks the order up (:func:`lookup_order`, a fixed record) under ``tool_choice``
naming the tool, the result is fed back and the agent answers from it. On kvagent the tool's description comes from
``engine.tool_segments`` (compiled once per model, transplanted into the turn) and the call is decoded under the
tool's grammar; the baseline gets ``create_chat_completion(tools=..., tool_choice=...)``, which for these models writes
no tool description into the prompt (their chat formats have none) and constrains the arguments to the tool's
schema. Both calls, their arguments and their costs are shown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from kvagent.backends.registry import baseline_chat
from kvagent.engine import Engine
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.segments import Segment
from kvagent.skills.spec import SkillSpec, load_skill
from kvagent.tools import ToolSet, result_segment

POLICY = """You are the support agent of Northwind Outdoor, a shop for camping gear.
Rules:
1. Be brief: answer in at most two sentences.
2. Orders can be cancelled only while their status is "processing". Shipped orders cannot be cancelled;
   offer a return instead, free within 30 days of delivery.
3. Refunds go back to the original payment method within 5 business days.
4. Never invent order numbers, prices or dates. If you do not know, say so.
5. Gold members get free express shipping on every order."""

SKILL = Path(__file__).resolve().parent / "data" / "skills" / "refund_policy.yaml"
"""The demo's skill, shipped as package data (``skills/refund_policy.yaml`` in the repository, linked)."""
BUDGET = 1024  # KV cells the agent's session keeps (policy, skill and fields are pinned inside it)
CHUNK = 64
FIELDS = (FieldSpec(name="customer", initial="Alice Moreau, gold member"),
          FieldSpec(name="order_status", allowed=("processing", "shipped"), initial="processing"))

_ITEMS = ["a 2-person tent", "a sleeping bag", "a camping stove", "trekking poles", "a headlamp", "a rain jacket",
          "a water filter", "a backpack", "hiking boots", "a camping chair"]
_EVENTS = ["ordered {item}; delivered on time", "asked whether {item} fits in a carry-on; answered yes",
           "returned {item} within 30 days; refunded to the card", "reported {item} arrived scratched; sent a voucher",
           "asked for the manual of {item}; sent the PDF link", "changed the delivery address for {item}"]
MEMORY = "Account history of Alice Moreau (oldest first):\n" + "\n".join(
    f"- 20{23 + i // 12}-{i % 12 + 1:02d}-{(7 * i) % 27 + 1:02d}: "
    f"{_EVENTS[i % len(_EVENTS)].format(item=_ITEMS[i % len(_ITEMS)])}."
    for i in range(30)) + "\n- 2026-02-11: ordered #A-1042, a 2-person tent, paid by card."

ORDER_NUMBER = {"type": "string", "pattern": "^[A-Z]-[0-9]{4}$", "description": "The order number, e.g. A-1042."}
LOOKUP_ORDER: dict[str, Any] = {"type": "function", "function": {
    "name": "lookup_order",
    "description": "Look up one of the customer's orders by its number: its item, status, payment and shipping date.",
    "parameters": {"type": "object", "properties": {"order_number": ORDER_NUMBER}, "required": ["order_number"]},
}}
"""The demo's one tool, as an OpenAI function (the baseline's ``tools``; kvagent's ``ToolSet``)."""
ORDER_RECORD = {"order_number": "A-1042", "item": "2-person tent", "status": "processing", "paid_by": "card",
                "ordered": "2026-02-11", "ships_by": "2026-02-14"}
CALL_TOKENS = 48  # tokens a call may take, whatever --max-tokens says (the grammar ends it when the call is done)


def lookup_order(order_number: str) -> dict[str, str]:
    """The tool's implementation: the demo's fixed order record (whatever number was asked)."""
    return dict(ORDER_RECORD)


# (question, field changes applied before it, the tool the agent must call first, if any)
SCRIPT: list[tuple[str, dict[str, str], str | None]] = [
    ("Hi, can I still cancel my order #A-1042?", {}, None),
    ("When will order #A-1042 ship?", {}, "lookup_order"),
    ("How long would the refund take?", {}, None),
    ("I just got an email that it shipped. Can I still cancel?", {"order_status": "shipped"}, None),
    ("Then how do I return it, and is the return shipping free for me?", {}, None),
    ("What did I order before this tent?", {}, None),
]


@dataclass(frozen=True)
class Call:
    """A tool call one side made: the name, the arguments' JSON as written, whether they are an object whose
    ``order_number`` matches the schema's pattern, and the cost of the call's generation."""

    name: str
    arguments: str
    valid: bool
    computed: int
    ttft_s: float
    transplanted: int = 0  # prompt tokens of the tool's description copied from its compiled segment (kvagent)


def check_arguments(arguments: str) -> dict[str, Any] | None:
    """The call's arguments when they are what :data:`LOOKUP_ORDER` asks (an object with a matching
    ``order_number``), else None."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    number = value.get("order_number") if isinstance(value, dict) else None
    if not isinstance(number, str) or not re.fullmatch(ORDER_NUMBER["pattern"], number) or set(value) - {"order_number"}:
        return None
    return value


@dataclass(frozen=True)
class Side:
    """One system's cost for one turn."""

    computed: int
    ttft_s: float
    answer: str
    cells: int = 0  # KV cells held after the turn (kvagent only)
    transplanted: int = 0  # prompt tokens copied from the compiled skill (kvagent only)
    call: Call | None = None  # the tool call of a tool turn (its cost is in computed and ttft_s too)


@dataclass(frozen=True)
class DemoTurn:
    turn: int
    question: str
    changes: dict[str, str]
    kvagent: Side
    baseline: Side


def _system_messages(values: dict[str, object], skill: SkillSpec) -> list[dict[str, str]]:
    """The baseline's system prompt: the same segments, the current values written into their messages."""
    return [{"role": "system", "content": POLICY}, {"role": "system", "content": skill.body()},
            *({"role": "system", "content": f"{name}: {value}"} for name, value in values.items()),
            {"role": "system", "content": MEMORY}]


def run_demo(engine: Engine, max_tokens: int = 40, on_turn: Callable[[DemoTurn], None] | None = None,
             baseline_n_ctx: int = 4096) -> list[DemoTurn]:
    """Run :data:`SCRIPT` on ``engine`` and on llama-cpp-python's chat API; one :class:`DemoTurn` per turn."""
    skill = load_skill(SKILL)
    renderer = engine.renderer(True)
    engine.skills.compile(skill, renderer)  # once per model, ever: later runs find it in the store
    tools = ToolSet([LOOKUP_ORDER])
    tool_segments = engine.tool_segments(tools)  # likewise: the tool's description, compiled once per model
    segments = [Segment.policy(POLICY), skill.segment(), *(spec.segment() for spec in FIELDS), Segment.memory(MEMORY)]
    values: dict[str, object] = {spec.name: spec.initial for spec in FIELDS}
    baseline = baseline_chat(engine.settings.backend, engine.model.path, n_ctx=baseline_n_ctx)
    history: list[dict[str, Any]] = []
    turns: list[DemoTurn] = []
    bound = False  # the tool's segments are in kvagent's prompt
    try:
        # the erratum named, not the default ``auto``: the demo shows the prefix kept whole under eviction;
        # ``auto`` would recompute from the field here (the history is evicted and no erratum rendering held
        # on SmolLM2's calibration, BENCHMARKS.md "Edits")
        with engine.session(segments, fields=FIELDS, eviction=Eviction("window", budget=BUDGET, chunk=CHUNK),
                            share_prefix=False, edit_strategy="erratum") as session:
            for number, (question, changes, tool) in enumerate(SCRIPT, start=1):
                edit_computed, edit_s = 0, 0.0
                if changes:  # kvagent: one erratum line; the baseline: the value rewritten in its system prompt
                    report = session.set_many(changes)
                    edit_computed, edit_s = report.computed, report.seconds
                    values.update(changes)
                messages = [*_system_messages(values, skill), *history, {"role": "user", "content": question}]
                if tool is None:
                    # once the tool's description is in the prompt the tool stays bound, under tool_choice "none" on
                    # turns that answer in text (measured: free, SmolLM2's next answer copies the <tool_response> turn)
                    reply = session.chat(question, max_tokens=max_tokens, tools=tools if bound else None,
                                         tool_choice="none")
                    ours = Side(reply.computed + edit_computed, reply.ttft_s + edit_s, reply.text.strip(),
                                len(session.cached_positions), reply.transplanted)
                    theirs = baseline.reply(messages, max_tokens)
                    history += [{"role": "user", "content": question}, {"role": "assistant", "content": theirs.text}]
                    theirs_side = Side(theirs.computed, theirs.ttft_s, theirs.text.strip())
                else:
                    ours = _kvagent_tool_turn(session, tools, [] if bound else tool_segments, question, tool,
                                              max_tokens)
                    bound = True
                    ours = replace(ours, computed=ours.computed + edit_computed, ttft_s=ours.ttft_s + edit_s,
                                   cells=len(session.cached_positions))
                    theirs_side, added = _baseline_tool_turn(baseline, messages, tool, max_tokens)
                    history += [{"role": "user", "content": question}, *added]
                row = DemoTurn(number, question, dict(changes), ours, theirs_side)
                turns.append(row)
                if on_turn is not None:
                    on_turn(row)
    finally:
        baseline.close()
    return turns


def _kvagent_tool_turn(session: Any, tools: ToolSet, tool_segments: list[Segment], question: str, tool: str,
                       max_tokens: int) -> Side:
    """The call (the tool's segments transplanted into the same pass, the turn held to the tool's grammar), the
    tool run, its result fed back with the answer in one pass."""
    call_gen = session.generate(CALL_TOKENS, segments=[*session.segments, *tool_segments], user=question, tools=tools,
                                tool_choice=tool)
    if not call_gen.tool_calls:  # only a call cut short by CALL_TOKENS: the grammar admits nothing else
        raise RuntimeError(f"kvagent made no complete call to {tool} in {CALL_TOKENS} tokens: {call_gen.text!r}")
    made = call_gen.tool_calls[0]
    arguments = made.arguments_json()
    call = Call(made.name, arguments, check_arguments(arguments) is not None, call_gen.computed, call_gen.ttft_s,
                call_gen.transplanted)
    result = lookup_order(**made.arguments)
    # the answer with the tool still bound under tool_choice "none": text that cannot open a call, nor start with
    # "<" (measured: free, SmolLM2 answers by writing another <tool_response>, and its later turns copy it)
    answer = session.generate(max_tokens, segments=[*session.segments,
                                                    result_segment(made.name, made.id, json.dumps(result))],
                              tools=tools, tool_choice="none")
    return Side(call_gen.computed + answer.computed, call_gen.ttft_s + answer.ttft_s, answer.text.strip(),
                transplanted=call_gen.transplanted + answer.transplanted, call=call)


def _baseline_tool_turn(baseline: Any, messages: list[dict[str, Any]], tool: str,
                        max_tokens: int) -> tuple[Side, list[dict[str, Any]]]:
    """The same turn through ``create_chat_completion(tools=..., tool_choice=...)``: the call, the result as a
    ``tool`` message, the answer; returns the side and the messages the turn added to the history."""
    choice = {"type": "function", "function": {"name": tool}}
    called = baseline.reply(messages, CALL_TOKENS, tools=[LOOKUP_ORDER], tool_choice=choice)
    made = called.tool_calls[0] if called.tool_calls else None
    name, arguments = (made.name, made.arguments) if made is not None else (tool, called.text)
    parsed = check_arguments(arguments)
    result = lookup_order(**parsed) if parsed is not None else {"error": "the call's arguments are not valid"}
    call_id = (made.id if made is not None else "") or "call_0"
    added: list[dict[str, Any]] = [
        # content "" (not None, as OpenAI clients send): SmolLM2's chat template concatenates it and fails on None
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function",
                                                            "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "name": name, "content": json.dumps(result)},
    ]
    answer = baseline.reply([*messages, *added], max_tokens, tools=[LOOKUP_ORDER])
    added.append({"role": "assistant", "content": answer.text})
    call = Call(name, arguments.strip(), parsed is not None, called.computed, called.ttft_s)
    return Side(called.computed + answer.computed, called.ttft_s + answer.ttft_s, answer.text.strip(), call=call), added
