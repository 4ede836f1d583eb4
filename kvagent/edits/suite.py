"""The decision suite: prompt templates with mutable fields and a question, and the decision read on them.

Shared by ``kvagent edits calibrate`` (:mod:`kvagent.edits.calibrate`), ``kvagent probe notes``
(:mod:`kvagent_bench.probe_notes`) and the edit benchmark (``kvagent bench edit``).

Each case is a plain-text few-shot prompt (instructions and worked examples, the record's fields,
downstream notes) whose answer depends on a field, an edit of one or more fields, and a question.
Plain few-shot text, not the chat template: on these two small models (one of them a base model) the
chat rendering left the answer mostly unconditioned on the field (SmolLM2 1-3 of 12 lookups right,
Gemma-3 0-2 of 12), the few-shot text much less so (Gemma-3 10-11 of 12 on derived and multi). The *decision* is the answer candidate whose first token has the
highest logit after the question (restricted argmax over the candidates' first tokens).

Templates (issue: a rule applied to the field, a lookup, several fields):
- ``derived``: the customer's country; the question asks for its capital (a rule applied to the field).
- ``lookup``: an order status; the question asks for it.
- ``multi``: a ticket's assignee and priority, both edited together; the question asks for the assignee.

:class:`Decider` takes that decision from logits; :func:`question_segments` are the segments a question is
appended as; :func:`answerable` tells whether a case's answers before and after its edit are decidable.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from kvagent.segments import Segment

if TYPE_CHECKING:
    from kvagent.engine import Engine

log = logging.getLogger(__name__)

NOTES = [
    "The customer contacted support by email last week.",
    "They asked for invoices to be sent as PDF files.",
    "The account was opened three years ago.",
    "Marketing emails are disabled for this account.",
    "The delivery address is a pick-up point near the station.",
    "The customer prefers to be contacted in the morning.",
    "A loyalty voucher was applied to the previous purchase.",
    "Phone calls should be avoided unless urgent.",
    "The last survey gave the support team a good score.",
    "Two-factor authentication is enabled on the account.",
    "The customer reviewed a sleeping bag last month.",
    "Gift wrapping was requested for an earlier order.",
]

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Egypt": "Cairo", "Spain": "Madrid",
    "Germany": "Berlin", "Russia": "Moscow", "Kenya": "Nairobi", "Canada": "Ottawa", "Peru": "Lima",
    "Greece": "Athens", "Norway": "Oslo", "Poland": "Warsaw", "Austria": "Vienna", "Portugal": "Lisbon",
    "Ireland": "Dublin", "Thailand": "Bangkok", "Cuba": "Havana",
}
STATUSES = ["processing", "shipped", "delivered", "cancelled", "returned", "refunded", "lost", "pending"]
NAMES = ["Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Gustav", "Hiro", "Ingrid", "Jamal", "Kofi", "Lucia"]
PRIORITIES = ["low", "medium", "high", "urgent"]


@dataclass(frozen=True)
class FieldFormat:
    """How one field renders in the record, and how its erratum line reads."""

    pool: list[str]
    template: str  # str.format with {name} and {value}
    # The erratum line for this field: the record line restated with the new value. Of four renderings
    # tried on 13-14 cases per template and model ("[STATE UPDATE] ... -> v; overrides any previous
    # value", "[STATE UPDATE] field -> v", "Correction: ...", the restated record line) the restated
    # line gave the most correct answers on both models (e.g. SmolLM2 lookup 12/14 vs 7/14).
    erratum: str


@dataclass(frozen=True)
class Template:
    """A prompt family: its fields, which ones an edit changes, the question and the answer rule."""

    name: str
    fields: dict[str, FieldFormat]
    edited: tuple[str, ...]
    question: str
    answer: Callable[[dict[str, str]], str]
    answers: list[str]  # every possible answer: the decision is taken among these

    def record(self, values: dict[str, str]) -> list[str]:
        return [self.fields[f].template.format(name=f, value=v) for f, v in values.items()]

    def policy(self, rng: random.Random) -> str:
        """Instructions plus three worked examples; the last one shows a state update winning."""
        lines = [
            "Answer each question from the record above it. "
            "When a record line is repeated with a new value, the latest line counts.",
            "",
        ]
        for shot in range(3):
            before = {f: rng.choice(fmt.pool) for f, fmt in self.fields.items()}
            lines += self.record(before)
            lines.append("Notes: " + " ".join(rng.sample(NOTES, 2)))
            values = before
            if shot == 2:
                values = {**before, **{f: rng.choice([v for v in self.fields[f].pool if v != before[f]]) for f in self.edited}}
                lines += [self.fields[f].erratum.format(name=f, value=values[f]) for f in self.edited]
            lines += [f"Question: {self.question}", "Answer:", self.answer(values), ""]
        return "\n".join(lines)


TEMPLATES: dict[str, Template] = {
    "derived": Template(
        "derived",
        {"customer_country": FieldFormat(list(CAPITALS), "Record: The customer lives in {value}.",
                                         "Record: The customer lives in {value}.")},
        ("customer_country",),
        "What is the capital of the country where the customer lives?",
        lambda v: CAPITALS[v["customer_country"]], list(CAPITALS.values()),
    ),
    "lookup": Template(
        "lookup",
        {"order_status": FieldFormat(STATUSES, "Record: The order status is {value}.",
                                     "Record: The order status is {value}.")},
        ("order_status",),
        "What is the order status?",
        lambda v: v["order_status"], STATUSES,
    ),
    "multi": Template(
        "multi",
        {
            "ticket_assignee": FieldFormat(NAMES, "Record: The ticket is assigned to {value}.",
                                           "Record: The ticket is assigned to {value}."),
            "ticket_priority": FieldFormat(PRIORITIES, "Record: The ticket priority is {value}.",
                                           "Record: The ticket priority is {value}."),
        },
        ("ticket_assignee", "ticket_priority"),
        "Who is the ticket assigned to?",
        lambda v: v["ticket_assignee"], NAMES,
    ),
}


@dataclass(frozen=True)
class Case:
    """One prompt (plain text, few-shot), its edit, and the question.

    ``split``: ``calibration`` (these templates: they may feed a calibration) or ``test`` (the held-out
    templates of :mod:`kvagent_bench.edit_heldout`); ``format``: ``plain`` (open the session with ``chat=False``)
    or ``chat`` (``chat=True``); ``downstream``: ``short`` (a few sentences of notes) or ``long``."""

    template: str
    segments: tuple[Segment, ...]
    before: dict[str, str]
    changes: dict[str, str]
    question: str
    erratum_templates: dict[str, str]
    split: str = "calibration"
    format: str = "plain"
    downstream: str = "short"


def make_cases(template: Template, n: int, seed: int = 0, notes_sentences: int = 4) -> list[Case]:
    """``n`` cases: random initial values, a different value for each edited field, random notes.

    The policy (instructions and worked examples) is the same for every case of a template, so a
    session reuses its KV across cases; the record and the notes after it change.
    """
    rng = random.Random(f"{template.name}-{seed}")
    policy = template.policy(random.Random(f"{template.name}-policy"))
    cases = []
    for _ in range(n):
        before = {f: rng.choice(fmt.pool) for f, fmt in template.fields.items()}
        changes = {f: rng.choice([v for v in template.fields[f].pool if v != before[f]]) for f in template.edited}
        notes = " ".join(rng.sample(NOTES, notes_sentences))
        segments = (
            Segment.policy(policy),
            *(Segment.field(f, v, template=template.fields[f].template) for f, v in before.items()),
            Segment.memory(f"Notes: {notes}"),
        )
        errata = {f: template.fields[f].erratum for f in template.edited}
        cases.append(Case(template.name, segments, before, changes, f"Question: {template.question}\nAnswer:", errata))
    return cases


FORMATS = ("plain", "chat")


def calibration_cases(template: str, n: int, seed: int = 0, format: str = "plain") -> list[Case]:
    """``n`` cases of one calibration template (:data:`TEMPLATES`) in ``format``: the suite's plain few-shot
    text, opened with ``chat=True`` in the ``chat`` format (the case's ``format`` says which)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}: use one of {', '.join(TEMPLATES)}")
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}: use one of {', '.join(FORMATS)}")
    return [dataclasses.replace(c, format=format) for c in make_cases(TEMPLATES[template], n, seed)]


def long_notes(n_sentences: int, seed: int = 0) -> str:
    """Filler notes for latency cases (numbered log entries built from the note pool)."""
    rng = random.Random(seed)
    return " ".join(f"Log {i + 1}: {rng.choice(NOTES)}" for i in range(n_sentences))


@dataclass
class Decider:
    """Restricted argmax over the answers' first tokens (answers whose first tokens collide are dropped)."""

    tokens: dict[str, int]

    @classmethod
    def build(cls, engine: Engine, answers: Iterable[str]) -> Decider:
        tokens: dict[str, int] = {}
        for answer in answers:
            tok = engine.backend.tokenize(answer, special=False)[0]
            if tok in tokens.values():
                log.info("answer %r shares its first token with another one: left out", answer)
                continue
            tokens[answer] = tok
        return cls(tokens)

    def __call__(self, logits: np.ndarray) -> tuple[str, float]:
        """(decision, margin between the best and second-best candidate logits)."""
        scored = sorted(((float(logits[t]), a) for a, t in self.tokens.items()), reverse=True)
        return scored[0][1], scored[0][0] - scored[1][0]


def question_segments(question: str) -> tuple[Segment, Segment]:
    """The question as a user segment and the open reply after it (what a decision is read after)."""
    return Segment.user(question), Segment.reply()


def answerable(case: Case, template: Template, decide: Decider) -> bool:
    """Whether the right answers before and after the case's edit are both among ``decide``'s candidates."""
    after = {**case.before, **case.changes}
    return template.answer(case.before) in decide.tokens and template.answer(after) in decide.tokens
