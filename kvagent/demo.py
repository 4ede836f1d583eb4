"""The demo agent: a stateful support agent whose policy and fields stay cached across turns.

``run_demo`` returns one :class:`TurnStats` per turn; the CLI prints them. The second customer's
session opens with the same policy and shows prefix sharing across sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvagent.engine import Engine
from kvagent.segments import Segment

POLICY = """You are the support agent of Northwind Outdoor, a shop for camping gear.
Rules:
1. Be brief: answer in at most two sentences.
2. Orders can be cancelled only while their status is "processing". Shipped orders cannot be cancelled;
   offer a return instead, free within 30 days of delivery.
3. Refunds go back to the original payment method within 5 business days.
4. Never invent order numbers, prices or dates. If you do not know, say so.
5. Gold members get free express shipping on every order."""

CUSTOMERS = [
    {
        "customer": "Alice Moreau",
        "plan": "gold",
        "order": "#A-1042, a 2-person tent",
        "order_status": "processing",
        "questions": [
            "Hi, can I still cancel my order?",
            "And how long does a refund take?",
            "Do I pay for express shipping on my next order?",
        ],
    },
    {
        "customer": "Bruno Keller",
        "plan": "basic",
        "order": "#B-2210, a sleeping bag",
        "order_status": "shipped",
        "questions": ["Can I cancel my sleeping bag order?"],
    },
]


@dataclass(frozen=True)
class TurnStats:
    customer: str
    turn: int
    question: str
    answer: str
    reused: int
    computed: int
    generated: int
    ttft_s: float


def run_demo(engine: Engine, max_tokens: int = 48, on_turn: Callable[[TurnStats], None] | None = None) -> list[TurnStats]:
    """Run every customer's conversation; each turn reports reused vs computed tokens and TTFT.

    Sessions stay open together, as on a server: the second customer's session starts from the
    first one's cached policy cells (shared, not copied).
    """
    stats: list[TurnStats] = []
    sessions = []
    try:
        for customer in CUSTOMERS:
            segments = [
                Segment.policy(POLICY),
                *(Segment.field(name, customer[name]) for name in ("customer", "plan", "order", "order_status")),
            ]
            session = engine.session(segments)
            sessions.append(session)
            for turn, question in enumerate(customer["questions"], start=1):
                reply = session.chat(str(question), max_tokens=max_tokens)
                row = TurnStats(
                    str(customer["customer"]), turn, str(question), reply.text.strip(),
                    reply.reused, reply.computed, reply.generated, reply.ttft_s,
                )
                stats.append(row)
                if on_turn is not None:
                    on_turn(row)
    finally:
        for session in sessions:
            session.close()
    return stats
