"""The held-out (``test``) split of the decision suite: templates written apart from the calibration ones.

The calibration split (:data:`kvagent.edits.suite.TEMPLATES`) was written together with the erratum
rendering: its worked examples show a restated record line winning, and its instructions say the latest
line counts. A user's prompt teaches no such thing, so what a calibration chooses is checked here, on
templates that never feed a calibration:

- no worked example and no instruction is about updates, errata or repeated lines; the examples only show
  the rule applied once;
- their own wording, notes and answer cues (nothing shared with the calibration templates' text);
- each renders in two formats: ``plain`` (few-shot text; open the session with ``chat=False``) and
  ``chat`` (the instructions as the system prompt, the worked examples as user/assistant turns, the record
  as messages of its own; open the session with ``chat=True``);
- two downstream lengths after the record: ``short`` (four sentences of notes) and ``long`` (about 2,000
  tokens of log entries, past Gemma-3's 512-token sliding window).

Templates: ``tool`` (an agent's JSON state names the next tool; the question asks which tool it calls;
the state is a user message in chat, like a tool result), ``room`` (a meeting's room code and day, both
edited; the floor is the code's first digit, by a rule the instructions state), ``currency`` (a trip's
destination country -> the currency to buy; world knowledge, no table) and ``carrier`` (a parcel's
destination region -> its carrier, from a dispatch table in the instructions). Measured on 8 cases per
template before this split was frozen: the two registry models flip their answer with the field on most
``tool`` and ``room`` cases and on few ``carrier`` (and, for SmolLM2, ``currency``) cases, whose answers
stay on one candidate: these tiny models do not apply the table; a flip, not accuracy, is what an edit
benchmark counts.

The cases are :class:`kvagent.edits.suite.Case` with ``split="test"``; decisions are read with
:class:`kvagent.edits.suite.Decider` over ``template.answers`` and the question appended with
:func:`kvagent.edits.suite.question_segments`, as on the calibration split. A held-out case names no
erratum template (``erratum_templates`` is empty): the strategy's own rendering is what gets measured.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Mapping

from kvagent.edits.suite import FORMATS, TEMPLATES, Case, FieldFormat, Template, calibration_cases
from kvagent.segments import Segment

DOWNSTREAMS = ("short", "long")
SPLITS = ("calibration", "test")

# Notes written for this split (the calibration templates use kvagent.edits.suite.NOTES).
HELD_NOTES = [
    "The office kitchen was cleaned on Tuesday.",
    "Badge readers on the east door are being replaced.",
    "The quarterly report is due at the end of the month.",
    "A new intern joins the design team next week.",
    "The printer on the third desk row needs toner.",
    "Parking spots near the entrance are reserved for visitors.",
    "The team lunch moved to the Italian place downstairs.",
    "Laptops must be locked when left unattended.",
    "The heating in the north wing runs until seven.",
    "Expense claims now need a scanned receipt.",
    "The wifi password changes on the first of each month.",
    "A fire drill is planned for Thursday morning.",
]
SHORT_SENTENCES = 4
LONG_SENTENCES = 130  # about 2,000 tokens of log entries on both registry models (15-16 tokens each)

TOOLS = ["email", "search", "math", "calendar", "weather", "translate", "maps", "timer", "camera", "notes"]
CARRIERS = {  # destination region -> carrier (the rule the instructions state)
    "Europe": "DHL", "North America": "FedEx", "East Asia": "Yamato", "the Middle East": "Aramex",
    "Latin America": "Estafeta", "Oceania": "Toll",
}
ROOMS = [f"{floor}{wing}" for floor in range(1, 9) for wing in "ABC"]  # a room code starts with its floor
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
CURRENCIES = {
    "Japan": "yen", "India": "rupee", "Mexico": "peso", "Britain": "pound", "Brazil": "real", "Korea": "won",
    "Germany": "euro", "America": "dollar", "Switzerland": "franc", "Thailand": "baht", "Turkey": "lira",
    "South Africa": "rand",
}


@dataclass(frozen=True)
class HeldoutTemplate(Template):
    """A test-split template: instructions, worked examples that only apply the rule, and how it renders.

    ``cue`` ends the plain question (the answer follows it); ``hint`` follows the chat question;
    ``field_role`` is the role of the record's messages in the chat format."""

    instructions: str = ""
    cue: str = "Answer:"
    hint: str = ""
    field_role: str = "system"
    shots: int = 4

    def _shots(self) -> list[tuple[list[str], str, str]]:
        """(record lines, notes line, answer) of each worked example; the same for every case and format."""
        rng = random.Random(f"heldout-{self.name}-shots")
        shots = []
        for _ in range(self.shots):
            values = {f: rng.choice(fmt.pool) for f, fmt in self.fields.items()}
            shots.append((self.record(values), "Context: " + " ".join(rng.sample(HELD_NOTES, 2)), self.answer(values)))
        return shots

    def policy(self, rng: random.Random | None = None) -> str:
        """The plain format's system text: the instructions, then the worked examples (no updates in them)."""
        lines = [self.instructions, ""]
        for record, notes, answer in self._shots():
            lines += [*record, notes, self.question, self.cue, answer, ""]  # the answer after the cue's line, as asked
        return "\n".join(lines)

    def prefix(self, format: str) -> list[Segment]:
        """The segments before the record: one policy (plain), or the policy and the examples as turns (chat)."""
        if format == "plain":
            return [Segment.policy(self.policy(), id="policy")]
        turns: list[Segment] = [Segment.policy(self.instructions, id="policy")]
        for i, (record, notes, answer) in enumerate(self._shots()):
            ask = "\n".join([*record, notes, "", self.ask("chat")])
            turns += [Segment.user(ask, id=f"shot-{i}-user"), Segment.assistant(answer, id=f"shot-{i}-assistant")]
        return turns

    def ask(self, format: str) -> str:
        """The question as it is appended (after it, the decision is read)."""
        return f"{self.question}\n{self.cue}" if format == "plain" else f"{self.question} {self.hint}".strip()


def _field(pool: list[str], template: str) -> FieldFormat:
    return FieldFormat(pool, template, erratum="")  # no per-field erratum on this split: the strategy's own renders


HELDOUT: dict[str, HeldoutTemplate] = {
    "tool": HeldoutTemplate(
        "tool",
        {"next_tool": _field(TOOLS, 'Agent state: {{"step": 3, "next_tool": "{value}", "retries": 0}}')},
        ("next_tool",),
        "Which tool does the agent call now?",
        lambda v: v["next_tool"], TOOLS,
        instructions=("You run the tools of a personal assistant agent. The tools are " + ", ".join(TOOLS)
                      + ". Read the agent state and name the tool to call."),
        cue="Tool:", hint="Reply with the tool name only.", field_role="user",
    ),
    "carrier": HeldoutTemplate(
        "carrier",
        {"ship_region": _field(list(CARRIERS), "Shipment: this parcel goes to {value}.")},
        ("ship_region",),
        "Which carrier takes this parcel?",
        lambda v: CARRIERS[v["ship_region"]], list(CARRIERS.values()),
        instructions="\n".join(["Warehouse dispatch table (destination: carrier):",
                                 *(f"{region}: {carrier}" for region, carrier in CARRIERS.items()),
                                 "Name the carrier for the parcel described."]),
        cue="Carrier:", hint="Give only the carrier's name.",
    ),
    "room": HeldoutTemplate(
        "room",
        {
            "meeting_room": _field(ROOMS, "Booking: the meeting takes place in room {value}."),
            "meeting_day": _field(DAYS, "Booking: the meeting is on {value}."),
        },
        ("meeting_room", "meeting_day"),
        "On which floor is the meeting?",
        lambda v: v["meeting_room"][0], [str(floor) for floor in range(1, 9)],
        instructions=("Front desk. A room code is its floor number followed by a wing letter: room 6B is on floor 6. "
                      "Tell visitors the floor of their meeting as a number."),
        cue="Floor:", hint="Reply with the floor number only.",
    ),
    "currency": HeldoutTemplate(
        "currency",
        {"destination": _field(list(CURRENCIES), "Trip: the traveller flies to {value}.")},
        ("destination",),
        "Which currency should the traveller buy?",
        lambda v: CURRENCIES[v["destination"]], sorted(set(CURRENCIES.values())),
        instructions="You are a travel desk assistant. Say which currency a traveller needs at the destination, in one word.",
        cue="Currency:", hint="One word.",
    ),
}


def heldout_long_notes(n_sentences: int = LONG_SENTENCES, seed: int = 0) -> str:
    """About 15 tokens per sentence of numbered log entries from this split's notes."""
    rng = random.Random(f"heldout-long-{seed}")
    return " ".join(f"Entry {i + 1}: {rng.choice(HELD_NOTES)}" for i in range(n_sentences))


def make_heldout_cases(
    template: HeldoutTemplate | str, n: int, seed: int = 0, format: str = "plain", downstream: str = "short",
) -> list[Case]:
    """``n`` test-split cases of ``template`` (deterministic in ``seed``): random values, a different value for
    each edited field, random notes (``short``) or about 2,000 tokens of log entries (``long``).

    The prefix (instructions and worked examples) is the same for every case of a template and format, so
    a session reuses its KV across cases."""
    tpl = HELDOUT[template] if isinstance(template, str) else template
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}: use one of {', '.join(FORMATS)}")
    if downstream not in DOWNSTREAMS:
        raise ValueError(f"unknown downstream {downstream!r}: use one of {', '.join(DOWNSTREAMS)}")
    rng = random.Random(f"heldout-{tpl.name}-{format}-{downstream}-{seed}")
    prefix = tpl.prefix(format)
    role = tpl.field_role if format == "chat" else "system"
    cases = []
    for _ in range(n):
        before = {f: rng.choice(fmt.pool) for f, fmt in tpl.fields.items()}
        changes = {f: rng.choice([v for v in tpl.fields[f].pool if v != before[f]]) for f in tpl.edited}
        if downstream == "short":
            notes = " ".join(rng.sample(HELD_NOTES, SHORT_SENTENCES))
        else:
            notes = heldout_long_notes(LONG_SENTENCES, seed=rng.randrange(1 << 30))
        segments = (
            *prefix,
            *(Segment.field(f, v, template=tpl.fields[f].template, id=f"field-{f}", role=role) for f, v in before.items()),
            Segment.memory(f"Context: {notes}", id="notes"),
        )
        cases.append(Case(tpl.name, segments, before, changes, tpl.ask(format), {}, split="test", format=format,
                          downstream=downstream))
    return cases


def split_templates(split: str) -> Mapping[str, Template]:
    """The templates of a split: ``calibration`` (suite.TEMPLATES) or ``test`` (:data:`HELDOUT`)."""
    if split == "calibration":
        return TEMPLATES
    if split == "test":
        return HELDOUT
    raise ValueError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")


def split_cases(split: str, template: str, n: int, seed: int = 0, format: str = "plain",
                downstream: str = "short") -> list[Case]:
    """Cases of one template of either split, in ``format``; ``long`` downstream on the test split only. The
    calibration split's cases are the suite's (its plain few-shot text, opened with ``chat=True`` in the chat
    format)."""
    if split == "test":
        return make_heldout_cases(template, n, seed, format, downstream)
    if downstream != "short":
        raise ValueError("the calibration split has short-downstream cases only")
    return calibration_cases(template, n, seed, format)
