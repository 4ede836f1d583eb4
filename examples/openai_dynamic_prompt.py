"""A plain OpenAI client whose system prompt changes every turn (a clock line at its top), against `kvagent serve`.

Nothing kvagent-specific is declared: the client resends its whole prompt, as agents do. The server aligns the new
prompt with the cached one and edits the changed line in place, so each turn computes the changed tokens and the new
message instead of the whole prompt again. ``report_edits`` (kvagent's extension, off by default) shows what it did.

Run: ``.venv/bin/kvagent serve --port 8000 &`` then ``.venv/bin/python examples/openai_dynamic_prompt.py``
(``--base-url`` for another server: any OpenAI-compatible one answers, without the ``kvagent_edits`` field).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
from typing import Any

import openai

POLICY = "\n".join(
    f"- Orders shipped to zone {zone} arrive within {zone + 2} working days; tracking starts after {zone * 3} hours."
    for zone in range(40)
)


def system_prompt(now: dt.datetime) -> str:
    return f"You are the support agent of Northwind Outdoor.\nCurrent time: {now:%Y-%m-%d %H:%M}\n{POLICY}"


def main(base_url: str = "http://127.0.0.1:8000/v1", turns: int = 4, api_key: str = "unused") -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    start = dt.datetime(2026, 12, 6, 9, 14)
    history: list[dict[str, Any]] = []
    rows = []
    for turn in range(turns):
        messages = [{"role": "system", "content": system_prompt(start + dt.timedelta(minutes=turn))}, *history,
                    {"role": "user", "content": f"When does an order to zone {turn} arrive?"}]
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=24,
            extra_body={"prompt_cache_key": "support-agent", "report_edits": True})
        history += [messages[-1], {"role": "assistant", "content": reply.choices[0].message.content}]
        usage = reply.usage.model_dump()
        computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        edits = [f"{e['kind']} at {e['line']!r}" for e in usage.get("kvagent_edits") or []]
        print(f"turn {turn}: prompt {usage['prompt_tokens']} tokens, computed {computed}; edits: {edits or 'none'}")
        rows.append({"prompt_tokens": usage["prompt_tokens"], "computed": computed, "edits": edits})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--api-key", default=os.environ.get("KVAGENT_API_KEY", "unused"))
    args = parser.parse_args()
    main(args.base_url, args.turns, args.api_key)
