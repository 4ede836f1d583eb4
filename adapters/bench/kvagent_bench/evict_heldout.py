"""Held-out eviction cases: agent conversations and tool logs with facts mentioned once, in two splits.

Pure logic: no model, no backend; token counts come from a ``count_tokens`` callable (the model's tokenizer in
the benchmark, a word counter in the unit tests). Written before any policy was tuned on them, and apart from
the shipped books' cloze of :mod:`kvagent_bench.evict_suite`: the contexts are chat prompts (kvagent
:class:`~kvagent.segments.Segment` lists the model renders in its own chat format) and every question is a
user turn answered by the model's assistant turn.

Three families of context, cycled case by case (:data:`FAMILIES`):

- ``sessions``: several sessions of chat between a user and an assistant (as in LoCoMo, Maharana et al. 2024,
  https://arxiv.org/abs/2402.17753), each opened by a dated header; the user mentions personal facts in
  passing (a lock code, a dentist's name, a flight date, a deposit, a favourite tea) inside ordinary messages.
- ``tools``: an agent's trajectory: tool calls in kvagent's tool format and their results (JSON records,
  logs, file contents full of identifiers, timestamps and amounts), facts as one field or line among many.
- ``documents``: documents the user shares (contiguous excerpts of the shipped public-domain books, meeting
  notes and memos); facts as one line of a memo.

Every context holds :data:`FACTS_PER_CASE` facts, each stated once: three are asked (one planted early, one in
the middle, one late: :data:`BANDS`, fractions of the context's tokens), the others are distractors of other
kinds at uniform depths. A question is answered right when the answer's words appear, in order and
contiguous, among the first words of the reply (:func:`score_reply`; punctuation and case ignored).

Splits: ``calibration`` (tune on it) and ``test`` (quote it) draw from the same generator with disjoint
seeds; case ``i`` of a split depends only on ``(split, i)``. Target lengths cycle over :data:`LENGTHS`
(1.5k-4k tokens); :func:`make_dialogues` builds the longer multi-session conversations (>= 4k tokens) whose
questions ask about the early sessions.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvagent.data import load_prose
from kvagent.segments import Segment, SegmentKind
from kvagent.tools.format import ToolCall, render_calls, result_segment
from kvagent_bench.data import load_corpus
from kvagent_bench.evict_suite import ABBREVIATIONS, normalize_answer, sentence_starts, split_paragraphs

log = logging.getLogger(__name__)

SPLITS = ("calibration", "test")
FAMILIES = ("sessions", "tools", "documents")
LENGTHS = (1536, 2048, 3072, 4096)
BANDS: dict[str, tuple[float, float]] = {"early": (0.05, 0.30), "middle": (0.35, 0.65), "late": (0.70, 0.95)}
FACTS_PER_CASE = 6
# chat wrapping of one message (open and close tags), for the length estimate only
MESSAGE_TOKENS = 5
ANSWER_HINT = "Answer in a few words."
MAX_NEW = 20  # reply tokens generated per question (the scorer reads the first sentence, up to 24 words)


# --- what a case is ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fact:
    """One fact stated once: ``statement`` is how the context states it (a clause, a field or a memo line,
    depending on the family), ``question`` the user's question about it, ``answer`` the expected value, ``lead``
    the words the assistant's reply starts with, right before the value ("The code for your bike lock is")."""

    kind: str
    statement: str
    question: str
    answer: str
    lead: str = ""


@dataclass(frozen=True)
class Question:
    """A question about one planted fact: ``text`` the user turn, ``answer`` the expected value, ``band``
    where the fact was planted (a key of :data:`BANDS`), ``depth`` where its message starts (fraction of the
    context's estimated tokens), ``kind`` the fact's template, ``lead`` the start of the assistant's reply (the
    benchmark writes it; the model continues with the value)."""

    text: str
    answer: str
    band: str
    depth: float
    kind: str
    lead: str = ""


@dataclass(frozen=True)
class HeldoutCase:
    """One context (``segments``, rendered by the model's chat format) and the ``questions`` asked after it.

    ``facts`` are every fact planted (asked and distractors) in context order; ``tokens`` the estimated context
    length (``count_tokens`` of every message plus :data:`MESSAGE_TOKENS` each); ``target`` the length it was
    grown to."""

    split: str
    index: int
    family: str
    target: int
    tokens: int
    segments: tuple[Segment, ...]
    questions: tuple[Question, ...]
    facts: tuple[Fact, ...] = field(default=())

    @property
    def id(self) -> str:
        return f"{self.split}-{self.index:03d}-{self.family}"


def question_segment(question: Question) -> Segment:
    """The user turn that asks ``question`` (the benchmark appends :func:`reply_segment`)."""
    return Segment.user(f"{question.text} {ANSWER_HINT}")


def reply_segment(question: Question) -> Segment:
    """The assistant's unfinished reply: the generation prompt and the question's ``lead``, which the model
    continues with the value."""
    return Segment(SegmentKind.TURN, question.lead, role="assistant", complete=False)


def score_reply(reply: str, answer: str, window: int = 24) -> bool:
    """Whether ``reply`` gives ``answer``: its normalized words (:func:`~kvagent_bench.evict_suite.normalize_answer`:
    case, punctuation and a leading article dropped) occur contiguously among the first ``window`` words of the
    reply's first sentence (up to a ``.``, ``!`` or ``?`` that is not inside a number); a date (``14 June``) may also read ``June 14`` or ``the 14th of June``. ``"Your bike lock code is 4817."`` is right for ``4817``;
    ``"48170"`` and an empty reply are not."""
    got = normalize_answer(first_sentence(reply))[:window]
    for variant in _variants(answer):
        want = normalize_answer(variant)
        if want and any(got[i : i + len(want)] == want for i in range(len(got) - len(want) + 1)):
            return True
    return False


def first_sentence(text: str) -> str:
    """``text`` up to its first ``.``, ``!`` or ``?`` that is not inside a number (``1.5``) and does not end an
    abbreviation (``Dr.``)."""
    for m in re.finditer(r"[.!?]", text):
        i = m.start()
        if text[i] == "." and 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit():
            continue
        word = re.search(r"(\w+)$", text[:i])
        if text[i] == "." and word and word.group(1).lower() in ABBREVIATIONS:
            continue
        return text[:i]
    return text


def _variants(answer: str) -> list[str]:
    """The answer and the other ways its form may be written: a date ``14 June`` also as ``June 14``, ``June 14th``,
    ``14th June`` or ``14th of June``."""
    day, _, month = answer.partition(" ")
    if not (day.isdigit() and month in MONTHS):
        return [answer]
    nth = day + ("th" if 10 <= int(day) % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(int(day) % 10, "th"))
    return [answer, f"{month} {day}", f"{month} {nth}", f"{nth} {month}", f"{nth} of {month}"]


# --- values ------------------------------------------------------------------------------------------------

FIRST = ["Aldous", "Berenice", "Cosmo", "Dorcas", "Evander", "Philippa", "Gideon", "Hester", "Ignatius", "Juniper",
         "Leopold", "Marisol", "Octavia", "Percival", "Rosalind", "Thaddeus", "Wilhelmina", "Ambrose", "Clementine",
         "Barnaby", "Isolde", "Lazarus", "Perpetua", "Silas", "Ottilie", "Florian", "Imelda", "Casimir"]
LAST = ["Fenwick", "Ashcombe", "Brindle", "Calloway", "Drummond", "Everleigh", "Farrow", "Galloway", "Hollis",
        "Ivers", "Kettering", "Larkspur", "Merriweather", "Norcott", "Pendry", "Quillon", "Ravensworth", "Stroud",
        "Thistlewood", "Underhill", "Vantreight", "Whitlock", "Yarrow", "Zeller", "Okonkwo", "Szabo", "Lindqvist"]
TOWNS = ["Marlowick", "Tessbury", "Oakhollow", "Brindlemere", "Quenford", "Ashwell", "Corrisdale", "Fennimoor",
         "Haverlocke", "Pellingham", "Wrexley", "Saltmarsh", "Dunmore Cross", "Kelvedon"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TEAS = ["oolong", "rooibos", "jasmine", "lapsang souchong", "genmaicha", "hojicha", "yerba mate", "pu-erh"]
FLOWERS = ["peonies", "ranunculus", "freesias", "anemones", "sweet peas", "alstroemeria", "hellebores"]
PETS = ["Biscuit", "Pepperpot", "Mungo", "Tinsel", "Waffles", "Juniper", "Noodle", "Clementine", "Bramble"]
WORDS = ["juniper", "kestrel", "marzipan", "tamarind", "gondola", "quartz", "wombat", "paprika", "zeppelin",
         "nutmeg", "armadillo", "tangerine", "cobalt", "saffron", "walrus", "origami"]
FLAGS = ["new_checkout", "dark_mode", "fast_search", "bulk_export", "beta_reviews", "gift_wrap", "live_chat"]
ROOMS = ["Aurora", "Basalt", "Cedar", "Dovetail", "Ember", "Foxglove", "Granite", "Heron", "Indigo", "Juno"]


def _name(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def _date(r: random.Random) -> str:
    return f"{r.randint(2, 28)} {r.choice(MONTHS)}"


def _code(r: random.Random, digits: int = 4) -> str:
    return str(r.randint(10 ** (digits - 1), 10 ** digits - 1))


def _ident(r: random.Random, prefix: str, digits: int = 5) -> str:
    return f"{prefix}-{r.randint(10 ** (digits - 1), 10 ** digits - 1)}"


def _amount(r: random.Random) -> str:
    return f"{r.randint(12, 980) * 5}"


# --- fact templates, per family ------------------------------------------------------------------------------
# kind -> rng -> Fact. Sessions: a first-person clause the user says in passing. Tools: a "key": value field of a
# tool result (the key is descriptive). Documents: one line of a memo.

def _f(kind: str, statement: str, question: str, answer: str, lead: str) -> Fact:
    return Fact(kind, statement, question, answer, lead)


def _yours(phrase: str) -> str:
    """A phrase the user said about themselves as the assistant says it back: my -> your, I -> you, capitalised."""
    out = " ".join({"my": "your", "I": "you"}.get(w, w) for w in phrase.split())
    return out[0].upper() + out[1:]


def _lock(r: random.Random) -> Fact:
    thing = r.choice(["bike lock", "garage door", "storage unit", "gym locker", "garden shed"])
    code = _code(r)
    return _f("code", f"the code for my {thing} is {code}", f"What is the code for my {thing}?", code,
              f"The code for your {thing} is")


def _person(r: random.Random) -> Fact:
    role = r.choice(["dentist", "landlord", "new manager", "piano teacher", "physiotherapist", "accountant"])
    name = _name(r)
    title = "Dr. " if role in ("dentist", "physiotherapist") else ""
    return _f("name", f"my {role} is called {title}{name}", f"What is the name of my {role}?", name,
              f"Your {role} is called")


def _event(r: random.Random) -> Fact:
    event = r.choice(["my sister's wedding", "my driving test", "the school reunion", "my cousin's housewarming",
                      "the marathon I signed up for"])
    date = _date(r)
    return _f("date", f"{event} is on {date}", f"On what date is {event}?", date,
              f"{_yours(event)} is on")


def _deposit(r: random.Random) -> Fact:
    what = r.choice(["the deposit for the new flat", "the repair of my car", "the wedding photographer",
                     "the sofa I ordered"])
    amount = _amount(r)
    return _f("amount", f"{what} cost {amount} euros", f"How many euros did {what} cost?", amount,
              f"{_yours(what)} cost")


def _favourite(r: random.Random) -> Fact:
    what, pool = r.choice([("tea", TEAS), ("flower", FLOWERS)])
    value = r.choice(pool)
    stated = f"my favourite {what} is {value}" if what == "tea" else f"my favourite flowers are {value}"
    question = f"What is my favourite {what}?" if what == "tea" else "What are my favourite flowers?"
    lead = "Your favourite tea is" if what == "tea" else "Your favourite flowers are"
    return _f("preference", stated, question, value, lead)


def _pet(r: random.Random) -> Fact:
    animal = r.choice(["puppy", "kitten", "rabbit", "tortoise"])
    name = r.choice(PETS)
    return _f("pet", f"we named our new {animal} {name}", f"What did we name our new {animal}?", name,
              f"You named your new {animal}")


def _hometown(r: random.Random) -> Fact:
    who = r.choice(["my grandmother", "my best friend", "my brother", "my old flatmate"])
    town = r.choice(TOWNS)
    return _f("place", f"{who} lives in {town}", f"In which town does {who} live?", town,
              f"{_yours(who)} lives in")


SESSION_FACTS: dict[str, Callable[[random.Random], Fact]] = {
    "code": _lock, "name": _person, "date": _event, "amount": _deposit, "preference": _favourite, "pet": _pet,
    "place": _hometown,
}


def _tool_field(kind: str, key: str, value: str, question: str, lead: str) -> Fact:
    return _f(kind, json.dumps({key: value})[1:-1], question, value, lead)


TOOL_FACTS: dict[str, Callable[[random.Random], Fact]] = {
    "code": lambda r: _tool_field("code", "support_pin", _code(r), "What is the support PIN on my account?",
                                  "The support PIN on your account is"),
    "name": lambda r: _tool_field("name", "assigned_engineer", _name(r),
                                  "What is the name of the engineer assigned to my ticket?",
                                  "The engineer assigned to your ticket is"),
    "date": lambda r: _tool_field("date", "replacement_delivery_date", _date(r),
                                  "On what date will the replacement be delivered?",
                                  "The replacement will be delivered on"),
    "amount": lambda r: _tool_field("amount", "refund_amount_eur", _amount(r), "How many euros is my refund?",
                                    "Your refund is"),
    "password": lambda r: _tool_field("password", "wifi_passphrase", r.choice(WORDS),
                                      "What is the wifi passphrase in the office config?",
                                      "The wifi passphrase in the office config is"),
    "port": lambda r: _tool_field("port", "staging_port", str(r.randint(3000, 9899)),
                                  "Which port does the staging server use?", "The staging server uses port"),
    "place": lambda r: _tool_field("place", "warehouse_town", r.choice(TOWNS),
                                   "In which town is the warehouse that holds my order?",
                                   "The warehouse that holds your order is in"),
}


def _memo(kind: str, line: str, question: str, answer: str, lead: str) -> Fact:
    return _f(kind, line, question, answer, lead)


DOCUMENT_FACTS: dict[str, Callable[[random.Random], Fact]] = {
    "place": lambda r: (lambda t: _memo("place", f"The team offsite will be held in {t}.",
                                        "Where will the team offsite be held?", t,
                                        "The team offsite will be held in"))(r.choice(TOWNS)),
    "date": lambda r: (lambda d: _memo("date", f"The budget review was moved to {d}.",
                                       "To what date was the budget review moved?", d,
                                       "The budget review was moved to"))(_date(r)),
    "name": lambda r: (lambda n: _memo("name", f"{n} will chair the hiring panel.",
                                       "Who will chair the hiring panel?", n,
                                       "The hiring panel will be chaired by"))(_name(r)),
    "amount": lambda r: (lambda a: _memo("amount", f"Approved travel budget: {a} euros.",
                                         "How many euros is the approved travel budget?", a,
                                         "The approved travel budget is"))(_amount(r)),
    "room": lambda r: (lambda x: _memo("room", f"The weekly sync now takes place in the {x} room.",
                                       "In which room does the weekly sync take place?", x,
                                       "The weekly sync takes place in the"))(r.choice(ROOMS)),
    "code": lambda r: (lambda c: _memo("code", f"The door code for the archive is {c}.",
                                       "What is the door code for the archive?", c,
                                       "The door code for the archive is"))(_code(r)),
    "password": lambda r: (lambda w: _memo("password", f"The guest wifi password is {w}.",
                                           "What is the guest wifi password?", w,
                                           "The guest wifi password is"))(r.choice(WORDS)),
}

FAMILY_FACTS = {"sessions": SESSION_FACTS, "tools": TOOL_FACTS, "documents": DOCUMENT_FACTS}


# --- sessions: chat filler (topic, user message, assistant reply) ---------------------------------------------

CHAT: tuple[tuple[str, str, str], ...] = tuple(
    (row["topic"], row["user"], row["assistant"]) for row in load_corpus("chat_filler.json"))

SESSION_OPENERS = ("Hi again!", "Hello!", "Morning!", "Hey, it's me again.", "Good evening.", "Hi, quick one today.")
FACT_LEADS = ("Oh, before I forget:", "By the way,", "Also, unrelated:", "Random note,", "Side note:",
              "While I think of it,")
ACKS = ("Noted, thanks for telling me.", "Got it.", "Thanks, I'll keep that in mind.", "Good to know.")


# --- tools: a trajectory of calls and results ------------------------------------------------------------------

TOOLS_SYSTEM = (
    "You are a support agent for an online electronics shop. You can call tools to look up the customer's orders, "
    "tickets, account and internal files, and you explain what you found in plain words. Tool results are shown "
    "to you inside <tool_response> tags."
)
TASKS = (
    "Hi, my order arrived with a cracked screen and I also have a billing question. Can you look into both?",
    "I need help with a faulty router I bought, and my account settings seem wrong too.",
    "Can you check what is going on with my return and whether the refund went through?",
)
FOLLOW_UPS = (
    "Thanks. Can you also check the ticket history?",
    "While you are at it, look at the staging config, our IT team asked me to forward it.",
    "OK. What does the warehouse log say about the shipment?",
    "Please also pull up my account details.",
    "Can you search the knowledge base for the warranty rules?",
)
PRODUCTS = ("USB-C hub", "27 inch monitor", "mesh router", "mechanical keyboard", "noise cancelling headphones",
            "portable SSD", "webcam", "laptop stand", "smart plug", "e-reader", "graphics tablet", "power bank")
STATUSES = ("delivered", "in transit", "returned", "processing", "cancelled", "awaiting pickup")
CARRIERS = ("DPD", "UPS", "GLS", "DHL", "PostNL")


def _timestamp(r: random.Random) -> str:
    return f"2024-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z"


def _orders(r: random.Random) -> tuple[ToolCall, dict]:
    orders = []
    for _ in range(r.randint(2, 4)):
        orders.append({"order_id": _ident(r, "ORD", 6), "placed": _timestamp(r), "item": r.choice(PRODUCTS),
                       "quantity": r.randint(1, 3), "total_eur": f"{r.randint(15, 640)}.{r.randint(0, 99):02d}",
                       "status": r.choice(STATUSES), "carrier": r.choice(CARRIERS),
                       "tracking": f"{r.choice('ABCDEFGHJKLMNPRSTUVWXYZ')}{r.choice('ABCDEFGHJKLMNPRSTUVWXYZ')}"
                                   f"{r.randint(10000000, 99999999)}"})
    return ToolCall("search_orders", {"customer_id": _ident(r, "C", 6), "limit": 5}, id=_ident(r, "call", 4)), \
        {"orders": orders, "count": len(orders)}


def _ticket(r: random.Random) -> tuple[ToolCall, dict]:
    ticket = _ident(r, "T", 5)
    events = [{"at": _timestamp(r), "by": r.choice(["agent", "customer", "system"]),
               "note": r.choice(["Customer reported the issue.", "Photos received.", "Escalated to tier 2.",
                                 "Awaiting courier inspection.", "Replacement approved.", "Reminder sent.",
                                 "Status changed to pending.", "Customer called about progress."])}
              for _ in range(r.randint(3, 6))]
    return ToolCall("get_ticket", {"ticket_id": ticket}, id=_ident(r, "call", 4)), \
        {"ticket_id": ticket, "priority": r.choice(["low", "normal", "high"]),
         "queue": r.choice(["returns", "billing", "hardware"]), "events": events}


def _account(r: random.Random) -> tuple[ToolCall, dict]:
    customer = _ident(r, "C", 6)
    return ToolCall("get_account", {"customer_id": customer}, id=_ident(r, "call", 4)), \
        {"customer_id": customer, "member_since": _timestamp(r)[:10], "tier": r.choice(["basic", "plus"]),
         "email_verified": r.choice([True, False]), "newsletter": r.choice([True, False]),
         "addresses": r.randint(1, 3), "open_tickets": r.randint(0, 4), "last_login": _timestamp(r),
         "payment_method": r.choice(["visa ending 4411", "mastercard ending 0932", "paypal", "bank transfer"])}


def _config(r: random.Random) -> tuple[ToolCall, str]:
    lines = [f"# generated {_timestamp(r)}", f"service: {r.choice(['shopfront', 'checkout', 'inventory'])}",
             f"replicas: {r.randint(2, 12)}", f"log_level: {r.choice(['info', 'debug', 'warn'])}",
             f"db_host: db{r.randint(1, 9)}.internal", f"db_pool_size: {r.randint(5, 50)}",
             f"cache_ttl_seconds: {r.randint(30, 3600)}", f"feature_flags: [{', '.join(r.sample(FLAGS, 3))}]",
             f"timeout_ms: {r.randint(200, 9000)}", f"region: {r.choice(['eu-west', 'eu-central', 'us-east'])}"]
    return ToolCall("read_file", {"path": f"config/{r.choice(['staging', 'office', 'prod'])}.yaml"},
                    id=_ident(r, "call", 4)), "\n".join(lines)


def _warehouse(r: random.Random) -> tuple[ToolCall, str]:
    lines = [f"{_timestamp(r)} scan {_ident(r, 'PKG', 7)} bay {r.randint(1, 40)} {r.choice(['inbound', 'outbound', 'hold'])}"
             for _ in range(r.randint(5, 9))]
    return ToolCall("warehouse_log", {"order_id": _ident(r, "ORD", 6), "lines": len(lines)},
                    id=_ident(r, "call", 4)), "\n".join(sorted(lines))


def _knowledge(r: random.Random) -> tuple[ToolCall, dict]:
    articles = r.sample([
        "Warranty covers manufacturing defects for two years from delivery.",
        "Damage in transit must be reported within fourteen days with photos.",
        "Refunds are issued to the original payment method.",
        "Opened software and gift cards cannot be returned.",
        "Replacements ship once the courier has collected the faulty item.",
        "Business customers can request invoices with a VAT number.",
        "Express shipping fees are refunded only for late deliveries.",
        "Firmware updates may be required before a hardware claim is accepted.",
    ], 4)
    return ToolCall("search_kb", {"query": r.choice(["warranty", "damaged delivery", "refund timing"])},
                    id=_ident(r, "call", 4)), \
        {"results": [{"article": _ident(r, "KB", 4), "score": round(r.uniform(0.4, 0.99), 2), "text": t}
                     for t in articles]}


TOOL_RESULTS = (_orders, _ticket, _account, _config, _warehouse, _knowledge)
COMMENTS = (
    "I found the records. Let me check one more thing before I summarise.",
    "That gives me part of the picture. I will look at the next source.",
    "Thanks for waiting. I am still gathering the details.",
    "This looks consistent with what you described so far.",
)


# --- documents: book excerpts, meeting notes ---------------------------------------------------------------

DOCS_SYSTEM = (
    "You are a helpful assistant. The user shares documents with you, one message at a time: excerpts from the "
    "book their reading group is discussing and notes from their workplace. Answer questions about them."
)
MEMO_TITLES = ("Notes from the Monday planning meeting", "Minutes of the facilities committee",
               "Operations update", "Summary of the quarterly review", "Action items from the team call")
MEMO_LINES = (
    "The printer on the second floor is being replaced next week.",
    "Everyone should submit timesheets by Friday noon.",
    "The new expense tool goes live after the training sessions.",
    "Parking permits for the visitor spaces are now issued at reception.",
    "The kitchen will be cleaned out on the last Friday of the month.",
    "Remote work requests go to the team lead, not to HR.",
    "The intranet will be down for maintenance on Saturday night.",
    "Please update your emergency contact details in the HR portal.",
    "The security badge readers at the side entrance are fixed.",
    "Volunteers are needed for the open day stand.",
    "Draft slides for the client workshop are in the shared folder.",
    "The supplier contract renewal is still under legal review.",
    "Lunch and learn sessions restart after the holidays.",
    "Recycling bins have been moved next to the lifts.",
)


# --- building a case ---------------------------------------------------------------------------------------


@dataclass
class _Block:
    """Messages of the context that travel together (an exchange, a call and its result, a document); ``plant``
    (None: no fact goes here) returns the messages with the given facts stated in them."""

    segments: list[Segment]
    plant: Callable[[list[Fact]], list[Segment]] | None = None


def _count(count_tokens: Callable[[str], int], segments: list[Segment]) -> int:
    return sum(count_tokens(s.text) + MESSAGE_TOKENS for s in segments)


def _session_blocks(r: random.Random, count_tokens: Callable[[str], int], target: int) -> list[_Block]:
    """Sessions of 2-5 exchanges, each opened by a dated header, until the estimate reaches ``target``."""
    blocks: list[_Block] = []
    pool = list(CHAT)
    r.shuffle(pool)
    day, hour, month = r.randint(1, 20), r.randint(8, 20), r.randrange(12)
    total, session = 0, 0
    while total < target:
        session += 1
        header = Segment.memory(f"Session {session}, {r.choice(WEEKDAYS)} {day} {MONTHS[month]} 2024, "
                                f"{hour:02d}:{r.randint(0, 59):02d}")
        blocks.append(_Block([header]))
        total += _count(count_tokens, [header])
        for j in range(r.randint(2, 5)):
            if not pool:
                pool = list(CHAT)
                r.shuffle(pool)
            _, user, reply = pool.pop()
            user_text = f"{r.choice(SESSION_OPENERS)} {user}" if j == 0 else user
            lead, ack = r.choice(FACT_LEADS), r.choice(ACKS)

            def plant(facts: list[Fact], user_text: str = user_text, reply: str = reply, lead: str = lead,
                      ack: str = ack) -> list[Segment]:
                said = " ".join(f"{lead if k == 0 else 'And'} {f.statement}." for k, f in enumerate(facts))
                return [Segment.user(f"{user_text} {said}"), Segment.assistant(f"{ack} {reply}")]

            segs = [Segment.user(user_text), Segment.assistant(reply)]
            blocks.append(_Block(segs, plant))
            total += _count(count_tokens, segs)
            if total >= target:
                break
        day += r.randint(1, 6)
        if day > 28:
            day, month = day - 28, (month + 1) % 12
    return blocks


def _tool_text(result: object, facts: list[Fact], r: random.Random) -> str:
    """A tool result's text with ``facts`` (``"key": value`` fields) written in: first fields of a JSON record,
    or ``key: value`` lines at random places of a text result."""
    if isinstance(result, dict):
        text = json.dumps(result, indent=1)
        if facts:
            at = text.index("\n") + 1
            text = text[:at] + "".join(f" {f.statement},\n" for f in facts) + text[at:]
        return text
    lines = str(result).split("\n")
    for f in facts:
        lines.insert(r.randint(1, len(lines)), f.statement.replace('"', ""))
    return "\n".join(lines)


def _tool_blocks(r: random.Random, count_tokens: Callable[[str], int], target: int) -> list[_Block]:
    """The task, then tool calls with their results (and now and then a comment or a follow-up request)."""
    task = Segment.user(r.choice(TASKS))
    blocks = [_Block([task])]
    total = _count(count_tokens, [task])
    follow = list(FOLLOW_UPS)
    r.shuffle(follow)
    while total < target:
        call, result = r.choice(TOOL_RESULTS)(r)
        seed = r.random()

        def plant(facts: list[Fact], call: ToolCall = call, result: object = result, seed: float = seed) -> list[Segment]:
            text = _tool_text(result, facts, random.Random(seed))
            return [Segment.assistant(render_calls([call])), result_segment(call.name, call.id, text)]

        segs = plant([])
        blocks.append(_Block(segs, plant))
        total += _count(count_tokens, segs)
        extra: list[Segment] = []
        roll = r.random()
        if roll < 0.25:
            extra = [Segment.assistant(r.choice(COMMENTS))]
        elif roll < 0.4 and follow:
            extra = [Segment.assistant(r.choice(COMMENTS)), Segment.user(follow.pop())]
        if extra:
            blocks.append(_Block(extra))
            total += _count(count_tokens, extra)
    return blocks


MEMO_TOKENS = 90  # a memo's estimated size, for spreading the excerpts between memos


def _document_blocks(r: random.Random, count_tokens: Callable[[str], int], target: int) -> list[_Block]:
    """Excerpts of one shipped book (contiguous, the reading group's parts) and memos in between (5 for a short
    context, up to 8): excerpt, memo, excerpt, ..., excerpt; the excerpts share what the memos leave of
    ``target``, cut at a sentence start."""
    books = load_prose()
    slug = r.choice(sorted(books))
    sentences = [p[a:b].strip() for p in split_paragraphs(books[slug])
                 for a, b in zip(sentence_starts(p), [*sentence_starts(p)[1:], len(p)])]
    at = r.randrange(max(1, len(sentences) - 2000))
    title = slug.replace("_", " ").title()
    memos = max(5, min(8, target // 400))
    per_excerpt = max(60, (target - memos * MEMO_TOKENS) // (memos + 1))
    blocks: list[_Block] = []
    for part in range(1, memos + 2):
        take: list[str] = []
        while sum(count_tokens(p) + 1 for p in take) < per_excerpt:
            take.append(sentences[at % len(sentences)])
            at += 1
        blocks.append(_Block([Segment.user(f"Here is part {part} of {title} for the reading group:\n\n"
                                           + " ".join(take)),
                              Segment.assistant(f"Thanks, I have read part {part}.")]))
        if part > memos:
            break
        memo_title = r.choice(MEMO_TITLES)
        lines = r.sample(MEMO_LINES, r.randint(4, 7))
        seed = r.random()

        def plant(facts: list[Fact], memo_title: str = memo_title, lines: list[str] = lines,
                  seed: float = seed) -> list[Segment]:
            rr, planted = random.Random(seed), list(lines)
            for f in facts:
                planted.insert(rr.randint(1, len(planted)), f.statement)
            return [Segment.user(f"{memo_title}:\n" + "\n".join(f"- {x}" for x in planted)),
                    Segment.assistant("Thanks, I have the notes.")]

        blocks.append(_Block(plant([]), plant))
    return blocks


SYSTEMS = {
    "sessions": ("You are a friendly personal assistant. Below are your earlier conversations with the user, one "
                 "session at a time, followed by the user's new message."),
    "tools": TOOLS_SYSTEM,
    "documents": DOCS_SYSTEM,
}
_BUILDERS = {"sessions": _session_blocks, "tools": _tool_blocks, "documents": _document_blocks}


def _place(starts: list[float], carriers: list[int], wanted: list[float],
           bands: tuple[str, ...]) -> dict[int, list[int]]:
    """Block -> facts planted there: each fact goes to the carrier block starting nearest its wanted depth, an
    asked fact (the first ``len(bands)``) to one starting inside its band where there is one. Asked facts choose
    first and never share a block; the others share one only when none is free."""
    taken: dict[int, list[int]] = {}
    for j, depth in enumerate(wanted):
        free = [i for i in carriers if i not in taken] or ([] if j < len(bands) else carriers)
        if not free:
            raise ValueError(f"{len(carriers)} places in the context for {len(bands)} asked facts")
        if j < len(bands):
            low, high = BANDS[bands[j]]
            free = [i for i in free if low <= starts[i] <= high] or free
        taken.setdefault(min(free, key=lambda i: (abs(starts[i] - depth), i)), []).append(j)
    return taken


def build_case(split: str, index: int, count_tokens: Callable[[str], int], target: int | None = None,
               family: str | None = None, bands: tuple[str, ...] = ("early", "middle", "late"),
               facts: int = FACTS_PER_CASE) -> HeldoutCase:
    """Case ``index`` of ``split``: family ``FAMILIES[index % 3]`` and target ``LENGTHS[(index // 3) % 4]`` unless
    given; one asked fact per entry of ``bands``, the other ``facts - len(bands)`` distractors (other kinds).
    Deterministic in ``(split, index, target, family, bands, facts)``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    family = family or FAMILIES[index % len(FAMILIES)]
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: use one of {', '.join(FAMILIES)}")
    if not bands or any(b not in BANDS for b in bands):
        raise ValueError(f"bands must be non-empty and among {', '.join(BANDS)}, got {bands}")
    templates = FAMILY_FACTS[family]
    if not len(bands) <= facts <= len(templates):
        raise ValueError(f"need {len(bands)} <= facts <= {len(templates)} for the {family} family, got {facts}")
    target = target or LENGTHS[(index // len(FAMILIES)) % len(LENGTHS)]
    r = random.Random(f"evict-heldout:{split}:{index}:{target}:{family}:{','.join(bands)}:{facts}")
    system = Segment.policy(SYSTEMS[family])
    head = _count(count_tokens, [system])
    blocks = _BUILDERS[family](r, count_tokens, target - head)
    kinds = list(templates)
    r.shuffle(kinds)
    drawn = [templates[k](r) for k in kinds[:facts]]
    sizes = [_count(count_tokens, b.segments) for b in blocks]
    total = head + sum(sizes)
    starts = [(head + sum(sizes[:i])) / total for i in range(len(blocks))]  # where each block starts (fraction)
    wanted = [r.uniform(*BANDS[b]) for b in bands] + [r.uniform(0.05, 0.95) for _ in range(facts - len(bands))]
    taken = _place(starts, [i for i, b in enumerate(blocks) if b.plant is not None], wanted, bands)
    segments: list[Segment] = [system]
    depth_of: dict[int, float] = {}
    for i, block in enumerate(blocks):
        if i in taken and block.plant is not None:
            segments += block.plant([drawn[j] for j in taken[i]])
            depth_of.update((j, starts[i]) for j in taken[i])
        else:
            segments += block.segments
    questions = tuple(Question(drawn[j].question, drawn[j].answer, band, depth_of[j], drawn[j].kind, drawn[j].lead)
                      for j, band in enumerate(bands))
    order = sorted(range(facts), key=lambda j: (depth_of[j], j))
    name = f"{split}-{index:03d}"
    segments = [replace(seg, id=f"{name}-{k}") for k, seg in enumerate(segments)]  # stable ids, not a counter's
    return HeldoutCase(split, index, family, target, _count(count_tokens, segments), tuple(segments), questions,
                       tuple(drawn[j] for j in order))


def make_cases(split: str, n: int, count_tokens: Callable[[str], int], start: int = 0) -> list[HeldoutCase]:
    """Cases ``start .. start + n - 1`` of ``split`` (:func:`build_case`): the families and lengths cycle, so 12
    consecutive cases hold every (family, length) pair once."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [build_case(split, i, count_tokens) for i in range(start, start + n)]


DIALOGUE_TOKENS = 4608
DIALOGUE_BANDS = ("early", "early", "early", "middle")


def make_dialogues(split: str, n: int, count_tokens: Callable[[str], int], tokens: int = DIALOGUE_TOKENS) -> list[HeldoutCase]:
    """``n`` multi-session conversations (the ``sessions`` family) of at least ``tokens`` tokens whose questions
    ask about facts from the early sessions (three in the first 30%, one in the middle), for the dialogue setting:
    the conversation is decoded turn by turn under eviction, then asked. Case ``i`` is index ``1000 + i``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [build_case(split, 1000 + i, count_tokens, target=tokens, family="sessions", bands=DIALOGUE_BANDS)
            for i in range(n)]


__all__ = [
    "BANDS", "FAMILIES", "FACTS_PER_CASE", "HeldoutCase", "LENGTHS", "MAX_NEW", "Question", "SPLITS", "build_case",
    "make_cases", "make_dialogues", "question_segment", "reply_segment", "score_reply",
]
