"""How tools, tool calls and tool results are written in a prompt (the tool format).

Neither shipped model's chat template has a tool format: SmolLM2-135M-Instruct's ChatML template renders
roles and text only, and the Gemma-3-270M GGUF carries no template at all (kvagent uses llama.cpp's built-in
Gemma turns). kvagent's default is the Hermes / Qwen convention, the one ChatML models (SmolLM2's family
included: SmolLM3 uses it) are trained on: tool descriptions as JSON lines in a system message, a call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's turn, a result as
``<tool_response name="..." id="...">...</tool_response>`` in the next user-side turn (neither template has a ``tool`` role). The
calls are decoded under a grammar (``kvagent.tools.grammar``), so the format only has to be readable by the
model, never guessed back: parsing a call of a constrained turn cannot fail.

Every tool is its own SKILL segment (after one shared instructions segment): compiled once per model,
transplanted into any prompt, and a changed tool recompiles only its own segment.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kvagent.errors import ToolCallError
from kvagent.segments import Segment
from kvagent.tools.grammar import ITEM_SEPARATOR, KEY_SEPARATOR
from kvagent.tools.spec import ToolSet, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SEPARATOR = "\n"
"""Between two calls of one turn (parallel tool calls)."""
INSTRUCTIONS = (
    "You can call tools. To call one, answer with exactly one line per call: "
    '<tool_call>{"name": "<tool name>", "arguments": {<the arguments as JSON>}}</tool_call>. '
    "Call a tool when the answer needs it; otherwise answer in plain text. The tools are:"
)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` as parsed from its JSON; ``id``: unique within a conversation (8 hex
    digits: a tool result repeats it, and every token of a result is computed in the agent's next turn)."""

    name: str
    arguments: Mapping[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:8]}")

    def arguments_json(self) -> str:
        return dumps(self.arguments)


def dumps(value: Any) -> str:
    """JSON as the grammar writes it: ``json.dumps`` separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR))


def call_schema(tools: ToolSet) -> dict[str, Any]:
    """The JSON schema of one call to one of ``tools``: ``{"name": <const>, "arguments": <its parameters>}``. An
    arguments object that does not say otherwise takes no keys beyond its properties (``additionalProperties:
    false``, as OpenAI's strict mode): measured on both shipped models, an open object makes them append
    schema-like keys until ``max_tokens`` (the grammar closes nested objects too: :func:`grammar.closed_objects`)."""
    return {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": {"additionalProperties": False, **dict(t.parameters)}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]}


def describe(tool: ToolSpec) -> str:
    """A tool as the model reads it: one JSON line with its name, description and parameters."""
    return dumps({"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)})


def tool_segments(tools: ToolSet) -> list[Segment]:
    """The instructions and one SKILL segment per tool (system messages; compiled and transplanted as skills)."""
    if not tools:
        return []
    return [Segment.skill("tools", INSTRUCTIONS, id="tools"),
            *(Segment.skill(f"tool:{t.name}", describe(t), id=f"tool-{t.name}") for t in tools)]


def render_calls(calls: Sequence[ToolCall]) -> str:
    """The text of an assistant turn that makes ``calls`` (what the grammar lets the model write)."""
    return SEPARATOR.join(f"{OPEN}{dumps({'name': c.name, 'arguments': dict(c.arguments)})}{CLOSE}" for c in calls)


def parse_calls(text: str, tools: ToolSet | None = None, *, complete: bool = True) -> list[ToolCall]:
    """The calls in an assistant turn's text (none: a text answer); ``complete=False`` (the turn was cut by
    ``max_tokens``): the last call may be cut short, and is then no call. :class:`ToolCallError` names a call that
    does not parse or names a tool not in ``tools`` (an unconstrained turn; a constrained one always parses).
    JSON-aware: an argument may contain the closing tag's text."""
    calls, decoder, at = [], json.JSONDecoder(), 0
    while (start := text.find(OPEN, at)) >= 0:
        begin = start + len(OPEN)
        try:
            data, end = decoder.raw_decode(text, begin)
        except ValueError as exc:
            if not complete:  # cut short: the turn ended inside the call
                break
            raise ToolCallError(f"a tool call does not parse as JSON ({exc}): {text[begin:begin + 200]!r}") from None
        if not text.startswith(CLOSE, end):
            if not complete and CLOSE.startswith(text[end:]):
                break
            raise ToolCallError(f"a tool call is not closed by {CLOSE}: {text[start:end + 40]!r}")
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(
                data.get("arguments", {}), dict):
            raise ToolCallError(f"a tool call needs a name and an arguments object: {text[begin:end][:200]!r}")
        if tools is not None and data["name"] not in tools:
            raise ToolCallError(f"the model called {data['name']!r}, which is not bound (bound: "
                                f"{', '.join(tools.names) or 'none'})")
        calls.append(ToolCall(data["name"], data.get("arguments", {})))
        at = end + len(CLOSE)
    return calls


def result_segment(name: str, call_id: str | None, content: str, *, id: str = "") -> Segment:
    """A tool's result as the turn after the call (user role: neither template has a tool role). The content is
    written as it is (not escaped into JSON: a result's every token is computed in the agent's next turn)."""
    attrs = f' name="{name}"' + (f' id="{call_id}"' if call_id else "")
    return Segment.user(f"<tool_response{attrs}>\n{content}\n</tool_response>", **({"id": id} if id else {}))


__all__ = ["CLOSE", "INSTRUCTIONS", "OPEN", "SEPARATOR", "ToolCall", "call_schema", "describe", "dumps",
           "parse_calls", "render_calls", "result_segment", "tool_segments"]
