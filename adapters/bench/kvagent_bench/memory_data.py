"""The memory benchmark's conversations: personas in LoCoMo's spirit, written for this benchmark alone.

A persona has seven facts (name, city, pet, job, favourite food, hobby and colour), each stated once by the
user in the first sessions of a long multi-session conversation between small talk; in the last session six
of them change (the user moved, changed jobs, adopted another pet, ...; the name and the kind of pet stay).
Questions (14) ask for every current value, the kind of pet, and the earlier value of every changed fact, each with an answer prefix (so a small model answers with the
value) and a short string that a correct answer contains. Nothing here is tuned on: the value pools, sentences
and questions are this module's own and the benchmark runs every question once.

:func:`make_persona` is deterministic in its seed; its small talk is drawn until the conversation renders to
about ``target_tokens`` tokens for the model at hand (``count``: a function from turns to their token count).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from kvagent_bench.data import load_corpus

NAMES = ("Maya", "Tomas", "Priya", "Jonas", "Elena", "Kofi", "Ingrid", "Mateo", "Aiko", "Lars", "Noor", "Felix")
VALUES: dict[str, tuple[str, ...]] = {
    "city": ("Porto", "Lisbon", "Dublin", "Vienna", "Krakow", "Seville", "Oslo", "Lyon", "Bristol", "Ghent", "Turin",
             "Tallinn", "Bergen", "Leeds", "Malaga", "Zurich"),
    "pet": ("Biscuit", "Pepper", "Mango", "Luna", "Otis", "Ziggy", "Noodle", "Maple", "Pixel", "Waffles", "Juniper",
            "Clover"),
    "job": ("teacher", "nurse", "plumber", "architect", "baker", "pilot", "librarian", "electrician", "pharmacist",
            "journalist", "carpenter", "chemist"),
    "food": ("sushi", "lasagna", "paella", "ramen", "tacos", "curry", "risotto", "falafel", "dumplings", "pancakes",
             "goulash", "pierogi"),
    "hobby": ("chess", "climbing", "pottery", "cycling", "knitting", "rowing", "gardening", "painting", "fishing",
              "surfing", "archery", "juggling"),
    "colour": ("green", "purple", "orange", "yellow", "teal", "crimson", "navy", "silver"),
}
PET_KINDS = ("cat", "dog", "rabbit", "parrot")
ATTRIBUTES = ("name", "city", "pet", "job", "food", "hobby", "colour")
UPDATABLE = ("city", "pet", "job", "food", "hobby", "colour")

STATE = {  # how the user states a fact the first time
    "name": "By the way, I'm {v}, nice to meet you.",
    "city": "I live in {v}, it's a nice place.",
    "pet": "I have a {kind} called {v}.",
    "job": "I work as a {v}.",
    "food": "My favourite food is {v}.",
    "hobby": "My favourite hobby is {v}.",
    "colour": "My favourite colour is {v}.",
}
UPDATE = {  # how the user states that it changed
    "city": "Big news: I moved from {old} to {v} last week.",
    "pet": "Sad news, {old} passed away. I adopted a new {kind} called {v}.",
    "job": "I quit my job as a {old}; I'm a {v} now.",
    "food": "I'm tired of {old}. These days my favourite food is {v}.",
    "hobby": "I gave up {old}; now my favourite hobby is {v}.",
    "colour": "Funny thing, my favourite colour is no longer {old}, it's {v} now.",
}
MEMORY_LINE = {  # the line of the memory block (what memory_replace rewrites)
    "name": "Name: {v}", "city": "City: {v}", "pet": "Pet: {v} (a {kind})", "job": "Job: {v}",
    "food": "Favourite food: {v}", "hobby": "Favourite hobby: {v}", "colour": "Favourite colour: {v}",
}
CURRENT = {  # (question, answer prefix) about the current value
    "name": ("What is my name?", "Your name is"),
    "city": ("Which city do I live in now?", "You live in"),
    "pet": ("What is my pet called now?", "Your pet is called"),
    "job": ("What is my job now?", "You work as"),
    "food": ("What is my favourite food now?", "Your favourite food is"),
    "hobby": ("What is my favourite hobby now?", "Your favourite hobby is"),
    "colour": ("What is my favourite colour now?", "Your favourite colour is"),
}
EARLIER = {  # (question, answer prefix) about the value before the update
    "city": ("Which city did I live in before I moved?", "Before you moved, you lived in"),
    "pet": ("What was my previous pet called?", "Your previous pet was called"),
    "job": ("What was my job before I changed jobs?", "Before, you worked as"),
    "food": ("What was my favourite food before?", "Your favourite food used to be"),
    "hobby": ("What was my favourite hobby before?", "Your favourite hobby used to be"),
    "colour": ("What was my favourite colour before?", "Your favourite colour used to be"),
}
PET_KIND_QUESTION = ("What kind of animal is my pet?", "Your pet is a")
# the user's small talk and the assistant's replies between the facts (written for this benchmark)
_CHAT = load_corpus("memory_chat.json")
SMALL_TALK = tuple(_CHAT["small_talk"])
REPLIES = tuple(_CHAT["replies"])
FACT_REPLIES = tuple(_CHAT["fact_replies"])
POLICY = ("You are a personal assistant with a long-term memory. The memory block holds what you know about the user; "
          "the conversation below spans several sessions. Answer briefly and use the most recent information.")


@dataclass(frozen=True)
class Question:
    attribute: str
    kind: str  # "current" or "earlier"
    text: str
    prefix: str
    answer: str


@dataclass(frozen=True)
class Persona:
    """One user: initial and updated facts, the conversation (sessions of (role, text) turns) and the questions."""

    seed: int
    initial: dict[str, str]
    updated: dict[str, str]  # attribute -> new value (the attributes that change in the last session)
    pet_kind: str
    sessions: tuple[tuple[tuple[str, str], ...], ...]
    questions: tuple[Question, ...]

    def memory_value(self, facts: dict[str, str] | None = None) -> str:
        """The memory block's text holding ``facts`` (default: the initial ones)."""
        facts = facts or self.initial
        return "\n".join(MEMORY_LINE[a].format(v=facts[a], kind=self.pet_kind) for a in ATTRIBUTES)

    def memory_edits(self) -> list[tuple[str, str, str]]:
        """(attribute, old line, new line) of each update, in the order the user stated them."""
        return [(a, MEMORY_LINE[a].format(v=self.initial[a], kind=self.pet_kind),
                 MEMORY_LINE[a].format(v=v, kind=self.pet_kind)) for a, v in self.updated.items()]

    @property
    def turns(self) -> list[tuple[str, str]]:
        return [t for s in self.sessions for t in s]


def make_persona(seed: int, count: Callable[[Sequence[tuple[str, str]]], int], target_tokens: int = 2000,
                 n_updates: int = 6, n_sessions: int = 5) -> Persona:
    """A persona whose conversation ``count``s to about ``target_tokens`` (see the module docstring)."""
    rng = random.Random(seed)
    pet_kind = rng.choice(PET_KINDS)
    initial = {"name": rng.choice(NAMES), **{a: rng.choice(VALUES[a]) for a in UPDATABLE}}
    changed = rng.sample(UPDATABLE, n_updates)
    updated = {a: rng.choice([v for v in VALUES[a] if v != initial[a]]) for a in changed}
    fact_order = list(ATTRIBUTES)
    rng.shuffle(fact_order)
    fact_order.remove("name")
    fact_order.insert(0, "name")  # the user introduces themself first
    early = n_sessions - 1
    # facts spread over the first sessions, updates all in the last one
    plan: list[list[tuple[str, str]]] = [[] for _ in range(n_sessions)]
    for i, a in enumerate(fact_order):
        plan[i * early // len(fact_order)].append(("state", a))
    for a in changed:
        plan[-1].append(("update", a))
    talk = list(SMALL_TALK)
    rng.shuffle(talk)
    talk_i = 0

    def build(n_talk: int) -> tuple[tuple[tuple[str, str], ...], ...]:
        sessions = []
        per = [n_talk // n_sessions + (1 if i < n_talk % n_sessions else 0) for i in range(n_sessions)]
        k = 0
        for s in range(n_sessions):
            turns: list[tuple[str, str]] = [("user", f"(Session {s + 1}, day {1 + 9 * s}) Hi, it's me again.")]
            turns.append(("assistant", "Hello! Good to hear from you again."))
            events = [("talk", "")] * per[s] + plan[s]
            order = random.Random(seed * 100 + s).sample(range(len(events)), len(events))
            for j in order:
                what, a = events[j]
                if what == "talk":
                    turns += [("user", talk[k % len(talk)]), ("assistant", REPLIES[(seed + k) % len(REPLIES)])]
                    k += 1
                elif what == "state":
                    text = STATE[a].format(v=initial[a], kind=pet_kind)
                    turns += [("user", text), ("assistant", FACT_REPLIES[(seed + k) % len(FACT_REPLIES)])]
                else:
                    text = UPDATE[a].format(v=updated[a], old=initial[a], kind=pet_kind)
                    turns += [("user", text), ("assistant", FACT_REPLIES[(seed + k + 1) % len(FACT_REPLIES)])]
            sessions.append(tuple(turns))
        return tuple(sessions)

    n_talk = 0
    sessions = build(n_talk)
    while count([t for s in sessions for t in s]) < target_tokens and n_talk < 400:
        n_talk += 1
        sessions = build(n_talk)
    del talk_i
    current = {**initial, **updated}
    questions = [Question(a, "current", *CURRENT[a], current[a]) for a in ATTRIBUTES]
    questions.append(Question("pet_kind", "current", *PET_KIND_QUESTION, pet_kind))
    questions += [Question(a, "earlier", *EARLIER[a], initial[a]) for a in changed]
    return Persona(seed, initial, updated, pet_kind, sessions, tuple(questions))


def correct(answer: str, expected: str) -> bool:
    """Whether a generated answer holds the expected value (case-insensitive, as a word)."""
    words = "".join(c.lower() if c.isalnum() else " " for c in answer).split()
    return expected.lower() in words


__all__ = ["ATTRIBUTES", "POLICY", "Persona", "Question", "correct", "make_persona"]
