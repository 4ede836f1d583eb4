"""The agent task of ``kvagent bench tools``: eight tools of a personal assistant, six requests for each with the
arguments they must carry, and sixteen requests that need no tool (small talk, general knowledge, a question about
the assistant itself).

Two splits. ``dev`` (:data:`REQUESTS`, :data:`SMALL_TALK`): written for this task after the model's own tool format
was built, and measured before anything was tried on it; since then it served to find why kvagent's ``auto`` called
less often than the peers' text (the bare-call grammar, docs/tools.md, was checked on it). ``test``
(:data:`TEST_REQUESTS`, :data:`TEST_SMALL_TALK`): written after that change and before any run on it, three requests
per tool and twelve without one, other people, places and phrasings; nothing was tuned on it. Phrasings vary:
questions, orders, fragments, lower case, numbers in words, polite and terse.

An argument is right when every expected key is present with the expected value: strings compared without case and
surrounding space (``"Paris"`` is ``"paris"``), numbers as numbers (``20`` is ``20.0``). Keys not listed may be
anything the schema takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS: list[dict[str, Any]] = [
    _fn("send_email", "Send an email to a recipient.",
        {"to": {"type": "string", "description": "The recipient's email address."},
         "subject": {"type": "string"}, "body": {"type": "string"}}, ["to", "subject", "body"]),
    _fn("set_reminder", "Set a reminder that notifies the user at a time.",
        {"text": {"type": "string", "description": "What to remind the user of."},
         "time": {"type": "string", "description": "When, as HH:MM (24-hour clock)."}}, ["text", "time"]),
    _fn("get_stock_price", "Get the latest price of a stock by its ticker symbol.",
        {"ticker": {"type": "string", "description": "The ticker symbol, e.g. AAPL."}}, ["ticker"]),
    _fn("translate_text", "Translate a text into another language.",
        {"text": {"type": "string"}, "target_language": {"type": "string", "description": "e.g. French"}},
        ["text", "target_language"]),
    _fn("book_table", "Book a table at a restaurant.",
        {"restaurant": {"type": "string"}, "people": {"type": "integer", "minimum": 1, "maximum": 20},
         "time": {"type": "string", "description": "HH:MM (24-hour clock)"}}, ["restaurant", "people", "time"]),
    _fn("check_flight_status", "Check the status of a flight by its flight number.",
        {"flight_number": {"type": "string", "description": "e.g. LH 454"}}, ["flight_number"]),
    _fn("play_music", "Play music by an artist, of a genre or a song.",
        {"query": {"type": "string", "description": "The artist, song or genre."}}, ["query"]),
    _fn("search_recipes", "Search recipes by ingredient or dish name.",
        {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query"]),
]
"""The assistant's tools (OpenAI function dicts)."""


@dataclass(frozen=True)
class Request:
    """A request, the tool it needs (None: no tool) and the arguments that call must carry."""

    text: str
    tool: str | None
    arguments: Mapping[str, Any] = field(default_factory=dict)


REQUESTS: list[Request] = [
    Request("Email bob@example.com with the subject Lunch and say I'll be 10 minutes late.", "send_email",
            {"to": "bob@example.com", "subject": "Lunch"}),
    Request("send an email to ana.silva@corp.pt, subject: Invoice, body: the invoice is attached", "send_email",
            {"to": "ana.silva@corp.pt", "subject": "Invoice"}),
    Request("Could you write to team@startup.io that the demo moved to Friday? Subject 'Demo'.", "send_email",
            {"to": "team@startup.io", "subject": "Demo"}),
    Request("Mail hr@acme.com: subject Holiday request, ask for the 3rd to the 7th of March off.", "send_email",
            {"to": "hr@acme.com", "subject": "Holiday request"}),
    Request("Please notify li.wei@mail.cn by email (subject: Parcel) that the parcel arrived.", "send_email",
            {"to": "li.wei@mail.cn", "subject": "Parcel"}),
    Request("Shoot an email over to max@home.de, subject Keys, telling him the keys are under the mat.",
            "send_email", {"to": "max@home.de", "subject": "Keys"}),
    Request("Remind me to call mum at 18:30.", "set_reminder", {"time": "18:30"}),
    Request("set a reminder for 07:15: take the pills", "set_reminder", {"time": "07:15"}),
    Request("At 21:00 remind me to water the plants, please.", "set_reminder", {"time": "21:00"}),
    Request("I need a reminder at 09:45 to join the standup.", "set_reminder", {"time": "09:45"}),
    Request("Don't let me forget the dentist: remind me at 14:00.", "set_reminder", {"time": "14:00"}),
    Request("reminder 16:20 pick up the kids", "set_reminder", {"time": "16:20"}),
    Request("What's Apple trading at right now? Ticker AAPL.", "get_stock_price", {"ticker": "AAPL"}),
    Request("price of MSFT", "get_stock_price", {"ticker": "MSFT"}),
    Request("How much is one share of Tesla (TSLA) today?", "get_stock_price", {"ticker": "TSLA"}),
    Request("Check the stock price for NVDA.", "get_stock_price", {"ticker": "NVDA"}),
    Request("Where is AMZN's share price at the moment?", "get_stock_price", {"ticker": "AMZN"}),
    Request("Give me the latest quote for the ticker SAP.", "get_stock_price", {"ticker": "SAP"}),
    Request("Translate 'good morning' into Spanish.", "translate_text", {"target_language": "Spanish"}),
    Request("how do you say 'where is the station' in German? use the translator", "translate_text",
            {"target_language": "German"}),
    Request("Please translate 'Thank you for your help' to Japanese.", "translate_text",
            {"target_language": "Japanese"}),
    Request("Put 'the meeting is cancelled' into French for me.", "translate_text", {"target_language": "French"}),
    Request("Translate this into Italian: I would like a coffee.", "translate_text", {"target_language": "Italian"}),
    Request("Can you translate 'happy birthday' to Portuguese?", "translate_text",
            {"target_language": "Portuguese"}),
    Request("Book a table for 4 at Luigi's at 19:30.", "book_table",
            {"restaurant": "Luigi's", "people": 4, "time": "19:30"}),
    Request("table for two at Sakura, 20:00 please", "book_table", {"restaurant": "Sakura", "people": 2, "time": "20:00"}),
    Request("Reserve Le Petit Bistro for six people at 18:45.", "book_table",
            {"restaurant": "Le Petit Bistro", "people": 6, "time": "18:45"}),
    Request("Could you get us a table at The Green Fork, three of us, at 12:30?", "book_table",
            {"restaurant": "The Green Fork", "people": 3, "time": "12:30"}),
    Request("I want to eat at Casa Pepe tonight at 21:15, we are 5.", "book_table",
            {"restaurant": "Casa Pepe", "people": 5, "time": "21:15"}),
    Request("Book Noodle House at 13:00 for one person.", "book_table",
            {"restaurant": "Noodle House", "people": 1, "time": "13:00"}),
    Request("Is flight LH454 on time?", "check_flight_status", {"flight_number": "LH454"}),
    Request("status of BA2490", "check_flight_status", {"flight_number": "BA2490"}),
    Request("Has AF1234 landed yet?", "check_flight_status", {"flight_number": "AF1234"}),
    Request("Check flight UA901 for me, please.", "check_flight_status", {"flight_number": "UA901"}),
    Request("My sister is on KL1775, is it delayed?", "check_flight_status", {"flight_number": "KL1775"}),
    Request("What's the status of flight EK7?", "check_flight_status", {"flight_number": "EK7"}),
    Request("Play some jazz.", "play_music", {"query": "jazz"}),
    Request("put on Bohemian Rhapsody", "play_music", {"query": "Bohemian Rhapsody"}),
    Request("I'd like to listen to Taylor Swift.", "play_music", {"query": "Taylor Swift"}),
    Request("Play Beethoven, please.", "play_music", {"query": "Beethoven"}),
    Request("Can you play some reggae music?", "play_music", {"query": "reggae"}),
    Request("play daft punk", "play_music", {"query": "daft punk"}),
    Request("Find me recipes with chickpeas.", "search_recipes", {"query": "chickpeas"}),
    Request("How do I make lasagna? Look up a recipe.", "search_recipes", {"query": "lasagna"}),
    Request("search recipes: banana bread, at most 3 results", "search_recipes",
            {"query": "banana bread", "max_results": 3}),
    Request("I have leftover rice, any recipes?", "search_recipes", {"query": "rice"}),
    Request("Look up a recipe for pancakes.", "search_recipes", {"query": "pancakes"}),
    Request("Find five recipes for a vegan curry.", "search_recipes", {"query": "vegan curry", "max_results": 5}),
]
"""Six requests per tool, each with the arguments its call must carry."""

SMALL_TALK: list[Request] = [Request(text, None) for text in [
    "Hi there!",
    "How are you doing today?",
    "Thanks, that's all for now.",
    "What's your name?",
    "Tell me a short joke.",
    "What is the capital of Australia?",
    "Explain in one sentence what a prime number is.",
    "Good night!",
    "Who wrote Romeo and Juliet?",
    "What does HTTP stand for?",
    "Can you recommend a good habit for staying focused?",
    "What is 7 times 8?",
    "Write a haiku about autumn.",
    "Why is the sky blue? One sentence.",
    "ok cool",
    "What can you help me with?",
]]
"""Requests that need no tool."""


def arguments_right(arguments: Mapping[str, Any], expected: Mapping[str, Any]) -> bool:
    """Whether ``arguments`` carry every expected key with its value (strings without case and surrounding space,
    numbers as numbers)."""
    for key, want in expected.items():
        if key not in arguments:
            return False
        got = arguments[key]
        if isinstance(want, str):
            if not isinstance(got, str) or got.strip().lower() != want.strip().lower():
                return False
        elif isinstance(want, (int, float)) and not isinstance(want, bool):
            try:
                if float(got) != float(want):
                    return False
            except (TypeError, ValueError):
                return False
        elif got != want:
            return False
    return True


TEST_REQUESTS: list[Request] = [
    Request("Write to clara@studio.fr, subject Contract, saying the signed copy is in the post.", "send_email",
            {"to": "clara@studio.fr", "subject": "Contract"}),
    Request("email support@shop.example subject 'Refund' body 'please refund order 1188'", "send_email",
            {"to": "support@shop.example", "subject": "Refund"}),
    Request("Let omar@clinic.org know by mail that I'll bring the forms; subject: Forms.", "send_email",
            {"to": "omar@clinic.org", "subject": "Forms"}),
    Request("Ping me at 06:30 to go running.", "set_reminder", {"time": "06:30"}),
    Request("remind me about the car service at 11:10", "set_reminder", {"time": "11:10"}),
    Request("Could you set an alarm-style reminder, 22:40, to lock the door?", "set_reminder", {"time": "22:40"}),
    Request("What does IBM cost per share?", "get_stock_price", {"ticker": "IBM"}),
    Request("quote GOOG", "get_stock_price", {"ticker": "GOOG"}),
    Request("Tell me the current share price of Netflix, symbol NFLX.", "get_stock_price", {"ticker": "NFLX"}),
    Request("Say 'see you tomorrow' in Dutch.", "translate_text", {"target_language": "Dutch"}),
    Request("translate 'the bill, please' to Greek", "translate_text", {"target_language": "Greek"}),
    Request("I need 'where is the hospital?' in Korean.", "translate_text", {"target_language": "Korean"}),
    Request("Get me a table at Blue Harbour for 8 people at 20:30.", "book_table",
            {"restaurant": "Blue Harbour", "people": 8, "time": "20:30"}),
    Request("reserve chez marie, 2 persons, 19:00", "book_table",
            {"restaurant": "chez marie", "people": 2, "time": "19:00"}),
    Request("We're four and want lunch at Tokyo Ramen at 12:15, can you book it?", "book_table",
            {"restaurant": "Tokyo Ramen", "people": 4, "time": "12:15"}),
    Request("Any delay on IB3170?", "check_flight_status", {"flight_number": "IB3170"}),
    Request("flight status QF1", "check_flight_status", {"flight_number": "QF1"}),
    Request("Is my dad's flight, SK2903, still scheduled?", "check_flight_status", {"flight_number": "SK2903"}),
    Request("Play lo-fi.", "play_music", {"query": "lo-fi"}),
    Request("play the song Hotel California", "play_music", {"query": "Hotel California"}),
    Request("I feel like hearing Miles Davis.", "play_music", {"query": "Miles Davis"}),
    Request("Show me recipes for gazpacho.", "search_recipes", {"query": "gazpacho"}),
    Request("what can I cook with spinach? two recipes max", "search_recipes", {"query": "spinach", "max_results": 2}),
    Request("Search for a quick omelette recipe.", "search_recipes", {"query": "omelette"}),
]
"""The ``test`` split: three requests per tool, each with the arguments its call must carry."""

TEST_SMALL_TALK: list[Request] = [Request(text, None) for text in [
    "Hello!",
    "Good morning, how's it going?",
    "Perfect, thank you.",
    "Are you a robot?",
    "What's the tallest mountain on Earth?",
    "Give me a fun fact about octopuses.",
    "What is 12 plus 30?",
    "See you later.",
    "Summarise the plot of Cinderella in one sentence.",
    "What does CPU stand for?",
    "nice",
    "Which tools do you have?",
]]
"""The ``test`` split's requests that need no tool."""

SPLITS: dict[str, tuple[list[Request], list[Request]]] = {"dev": (REQUESTS, SMALL_TALK),
                                                          "test": (TEST_REQUESTS, TEST_SMALL_TALK)}
"""The agent task's splits: (tool requests, requests that need no tool)."""
