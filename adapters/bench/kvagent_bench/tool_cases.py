"""The tool benchmark's data: an agent's six tools and a request set for them, and tool specs made to size.

The request set is held out: written for ``kvagent bench tools`` alone, after the tool calling was built and
never used to tune it (nor any prompt, grammar or default). Each request names the tool it is meant for;
phrasings vary (questions, orders, fragments, lower case, numbers in words, several values in one request).

:func:`synthetic_tools` makes ``n`` plausible tools of about 100 tokens each (their description line as the
tool format writes it) for the time-to-first-token rows: deterministic, unique names, schemas the grammar takes.
"""

from __future__ import annotations

from typing import Any

from kvagent_bench.data import load_corpus

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

REQUESTS: list[tuple[str, str]] = [(row["request"], row["tool"]) for row in load_corpus("tool_requests.json")]
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
