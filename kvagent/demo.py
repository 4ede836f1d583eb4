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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvagent.backends.registry import baseline_chat
from kvagent.engine import Engine
from kvagent.eviction import Eviction
from kvagent.fields import FieldSpec
from kvagent.segments import Segment
from kvagent.skills.spec import SkillSpec, load_skill

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

# (question, field changes applied before it)
SCRIPT: list[tuple[str, dict[str, str]]] = [
    ("Hi, can I still cancel my order #A-1042?", {}),
    ("How long would the refund take?", {}),
    ("I just got an email that it shipped. Can I still cancel?", {"order_status": "shipped"}),
    ("Then how do I return it, and is the return shipping free for me?", {}),
    ("What did I order before this tent?", {}),
]


@dataclass(frozen=True)
class Side:
    """One system's cost for one turn."""

    computed: int
    ttft_s: float
    answer: str
    cells: int = 0  # KV cells held after the turn (kvagent only)
    transplanted: int = 0  # prompt tokens copied from the compiled skill (kvagent only)


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
    segments = [Segment.policy(POLICY), skill.segment(), *(spec.segment() for spec in FIELDS), Segment.memory(MEMORY)]
    values: dict[str, object] = {spec.name: spec.initial for spec in FIELDS}
    baseline = baseline_chat(engine.settings.backend, engine.model.path, n_ctx=baseline_n_ctx)
    history: list[dict[str, str]] = []
    turns: list[DemoTurn] = []
    try:
        # the erratum named, not the default ``auto``: the demo shows the prefix kept whole under eviction;
        # ``auto`` would recompute from the field here (the history is evicted and no erratum rendering held
        # on SmolLM2's calibration, BENCHMARKS.md "Edits")
        with engine.session(segments, fields=FIELDS, eviction=Eviction("window", budget=BUDGET, chunk=CHUNK),
                            share_prefix=False, edit_strategy="erratum") as session:
            for number, (question, changes) in enumerate(SCRIPT, start=1):
                edit_computed, edit_s = 0, 0.0
                if changes:  # kvagent: one erratum line; the baseline: the value rewritten in its system prompt
                    report = session.set_many(changes)
                    edit_computed, edit_s = report.computed, report.seconds
                    values.update(changes)
                reply = session.chat(question, max_tokens=max_tokens)
                ours = Side(reply.computed + edit_computed, reply.ttft_s + edit_s, reply.text.strip(),
                            len(session.cached_positions), reply.transplanted)
                messages = [*_system_messages(values, skill), *history, {"role": "user", "content": question}]
                theirs = baseline.reply(messages, max_tokens)
                history += [{"role": "user", "content": question}, {"role": "assistant", "content": theirs.text}]
                row = DemoTurn(number, question, dict(changes), ours,
                               Side(theirs.computed, theirs.ttft_s, theirs.text.strip()))
                turns.append(row)
                if on_turn is not None:
                    on_turn(row)
    finally:
        baseline.close()
    return turns
