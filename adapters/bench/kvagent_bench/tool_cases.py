"""The tool benchmark's data: an agent's six tools and a request set for them, and tool specs made to size.

The request set is held out: written for ``kvagent bench tools`` alone, after the tool calling was built and
never used to tune it (nor any prompt, grammar or default). Each request names the tool it is meant for;
phrasings vary (questions, orders, fragments, lower case, numbers in words, several values in one request).

:func:`synthetic_tools` makes ``n`` plausible tools of about 100 tokens each (their description line as the
tool format writes it) for the time-to-first-token rows: deterministic, unique names, schemas the grammar takes.
"""

from __future__ import annotations

from typing import Any

ORDER = {"type": "string", "pattern": "^[A-Z]-[0-9]{4}$", "description": "The order number, e.g. A-1042."}
CURRENCY = {"type": "string", "pattern": "^[A-Z]{3}$", "description": "ISO 4217 code, e.g. EUR."}


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


AGENT_TOOLS: list[dict[str, Any]] = [
    _fn("lookup_order", "Look up a customer's order: its status, items, carrier and delivery date.",
        {"order_number": ORDER}, ["order_number"]),
    _fn("get_weather", "The current weather and today's forecast for a city.",
        {"city": {"type": "string", "description": "The city, e.g. Lisbon."},
         "unit": {"enum": ["celsius", "fahrenheit"], "description": "Temperature unit."}}, ["city"]),
    _fn("convert_currency", "Convert an amount of money from one currency to another at today's rate.",
        {"amount": {"type": "number", "exclusiveMinimum": 0}, "from_currency": CURRENCY, "to_currency": CURRENCY},
        ["amount", "from_currency", "to_currency"]),
    _fn("create_event", "Add an event to the user's calendar.",
        {"title": {"type": "string"}, "date": {"type": "string", "format": "date", "description": "YYYY-MM-DD"},
         "start_time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$", "description": "HH:MM"},
         "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480}}, ["title", "date"]),
    _fn("read_file", "Read a text file from the user's workspace and return its lines.",
        {"path": {"type": "string"}, "max_lines": {"type": "integer", "minimum": 1, "maximum": 1000}}, ["path"]),
    _fn("calculate", "Evaluate an arithmetic expression exactly (+, -, *, /, **, sqrt, %, factorial).",
        {"expression": {"type": "string", "description": "e.g. (48 + 12) / 6"}}, ["expression"]),
]
"""The agent's tools (OpenAI function dicts): patterns, an enum, a date format, bounded integers, a number."""

REQUESTS: list[tuple[str, str]] = [
    ("Where is my order B-2291?", "lookup_order"),
    ("Can you check the status of order A-1042 for me?", "lookup_order"),
    ("has order C-7730 shipped yet", "lookup_order"),
    ("I ordered a tent last week, order number D-5012. When will it arrive?", "lookup_order"),
    ("Track the package for order E-0815 please.", "lookup_order"),
    ("What's going on with my order F-3344? It's late.", "lookup_order"),
    ("Look up order G-9001.", "lookup_order"),
    ("my order number is H-1207, is it still processing?", "lookup_order"),
    ("Could you tell me whether order K-4410 was delivered?", "lookup_order"),
    ("Status update on order M-6618, please.", "lookup_order"),
    ("What's the weather in Lisbon today?", "get_weather"),
    ("Is it going to rain in Oslo?", "get_weather"),
    ("How hot is it in Phoenix right now, in fahrenheit?", "get_weather"),
    ("weather berlin", "get_weather"),
    ("Do I need a jacket in Edinburgh this evening?", "get_weather"),
    ("Tell me the temperature in Tokyo in celsius.", "get_weather"),
    ("What's the forecast for Nairobi?", "get_weather"),
    ("Is it sunny in Barcelona at the moment?", "get_weather"),
    ("How cold is Montreal today?", "get_weather"),
    ("Check the weather for Buenos Aires.", "get_weather"),
    ("Convert 250 euros to US dollars.", "convert_currency"),
    ("How much is 100 USD in Japanese yen?", "convert_currency"),
    ("what's 75 GBP in EUR", "convert_currency"),
    ("I need to change 1200 Swiss francs into euros, how much do I get?", "convert_currency"),
    ("Convert 49.99 dollars to Canadian dollars.", "convert_currency"),
    ("How many Indian rupees is 30 euros?", "convert_currency"),
    ("Exchange 500 SEK to NOK.", "convert_currency"),
    ("What is 18 Australian dollars in US dollars?", "convert_currency"),
    ("Turn ten thousand yen into British pounds.", "convert_currency"),
    ("How much are 640 Mexican pesos in dollars?", "convert_currency"),
    ("Schedule a meeting with Dana on 2026-03-12 at 14:00 for 30 minutes.", "create_event"),
    ("Add 'dentist appointment' to my calendar on 2026-04-02 at 09:30.", "create_event"),
    ("Put a team standup on March 3rd 2026 at 10:00, 15 minutes.", "create_event"),
    ("Create an event called Project review on 2026-05-20.", "create_event"),
    ("Block two hours on 2026-02-27 at 13:00 for focus time.", "create_event"),
    ("remind me: call mom, 2026-03-01 18:00", "create_event"),
    ("Book 'Lunch with Sam' on 2026-06-11 at 12:30 for an hour.", "create_event"),
    ("Set up a calendar entry for the board meeting on 2026-09-15.", "create_event"),
    ("Can you add a yoga class on 2026-03-08 at 07:00, 60 minutes?", "create_event"),
    ("New event: quarterly taxes due, 2026-04-15.", "create_event"),
    ("Open the file notes/todo.txt.", "read_file"),
    ("Show me the first 20 lines of src/main.py.", "read_file"),
    ("What's in /etc/hosts?", "read_file"),
    ("read config.yaml", "read_file"),
    ("Print the contents of docs/README.md.", "read_file"),
    ("Can you show me last month's report, reports/2026-01.csv?", "read_file"),
    ("Display logs/server.log, just 50 lines.", "read_file"),
    ("I need to see what's written in drafts/letter.txt.", "read_file"),
    ("Read the file data/customers.json for me.", "read_file"),
    ("Look at the Makefile and show it to me.", "read_file"),
    ("What is 17 times 23?", "calculate"),
    ("Calculate 15% of 240.", "calculate"),
    ("how much is (48 + 12) / 6", "calculate"),
    ("What's the square root of 144?", "calculate"),
    ("Compute 2 to the power of 10.", "calculate"),
    ("If a bill of 96 is split among 4 people, how much does each pay?", "calculate"),
    ("What is 1234 minus 567?", "calculate"),
    ("Work out 3.5 * 12.25 please.", "calculate"),
    ("What's 7 factorial?", "calculate"),
    ("Add up 19, 42 and 77.", "calculate"),
]
"""(request, the tool it is meant for): ten per tool."""

def pick_requests(k: int) -> list[tuple[str, str]]:
    """``k`` requests spread over the tools (the first of each tool, then the second of each, ...); all of them in
    :data:`REQUESTS` order when ``k`` is their number."""
    if not isinstance(k, int) or not 1 <= k <= len(REQUESTS):
        raise ValueError(f"pick_requests: k must be an integer from 1 to {len(REQUESTS)}, got {k!r}")
    if k == len(REQUESTS):
        return list(REQUESTS)
    by_tool: dict[str, list[tuple[str, str]]] = {}
    for case in REQUESTS:
        by_tool.setdefault(case[1], []).append(case)
    rounds = max(len(v) for v in by_tool.values())
    spread = [cases[i] for i in range(rounds) for cases in by_tool.values() if i < len(cases)]
    return spread[:k]


_VERBS = [("get", "Fetch one"), ("list", "List the"), ("create", "Create a new"), ("update", "Change the fields of a"),
          ("delete", "Delete a"), ("search", "Search the"), ("export", "Export the"), ("archive", "Archive a")]
_NOUNS = [("invoice", "billing"), ("customer", "CRM"), ("ticket", "helpdesk"), ("shipment", "logistics"),
          ("product", "catalogue"), ("employee", "HR"), ("contract", "legal"), ("warehouse", "inventory"),
          ("supplier", "procurement"), ("payment", "finance"), ("campaign", "marketing"), ("device", "IT asset"),
          ("booking", "reservation"), ("vehicle", "fleet"), ("project", "planning"), ("document", "records")]
MAX_SYNTHETIC = len(_VERBS) * len(_NOUNS)


def synthetic_tools(n: int) -> list[dict[str, Any]]:
    """``n`` (1-128) distinct plausible tools as OpenAI function dicts, about 100 tokens each as described to the
    model; the same ``n`` gives the same tools, and the first ``n`` of a larger set are the smaller set."""
    if not isinstance(n, int) or not 1 <= n <= MAX_SYNTHETIC:
        raise ValueError(f"synthetic_tools: n must be an integer from 1 to {MAX_SYNTHETIC}, got {n!r}")
    tools = []
    for i in range(n):
        (verb, phrase), (noun, system) = _VERBS[i % len(_VERBS)], _NOUNS[i // len(_VERBS)]
        prefix = noun[:3].upper()
        description = (f"{phrase} {noun} record{'s' if verb in ('list', 'search', 'export') else ''} in the "
                       f"{system} system, by identifier or status; returns the {noun}'s owner, status and last change.")
        properties: dict[str, Any] = {
            f"{noun}_id": {"type": "string", "pattern": f"^{prefix}-[0-9]{{4}}$"},
            "status": {"enum": ["open", "pending", "closed"]},
        }
        tools.append(_fn(f"{verb}_{noun}", description, properties, [f"{noun}_id"]))
    return tools


__all__ = ["AGENT_TOOLS", "MAX_SYNTHETIC", "REQUESTS", "pick_requests", "synthetic_tools"]
