"""Which calls a turn may make (``tool_choice``, ``parallel_tool_calls``) and the grammar that holds it to them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from kvagent.errors import ToolChoiceError
from kvagent.tools import format as fmt
from kvagent.tools.grammar import json_grammar, json_lark, lark_grammar
from kvagent.tools.spec import ToolSet


@dataclass(frozen=True)
class ToolChoice:
    """Which calls a turn may make: ``mode`` ``auto`` (text or calls), ``none`` (text only), ``required`` (at
    least one call), or ``tool`` (one call to ``name``); ``parallel``: several calls in one turn.

    Several calls only where asked (``parallel=True``): measured on both shipped models, a grammar that allows
    another call after the first makes them repeat the same call until ``max_tokens``."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = False

    @classmethod
    def of(cls, choice: Any, tools: ToolSet, parallel: bool | None = None) -> ToolChoice:
        """From the ecosystems' spellings: ``"auto"``, ``"none"``, ``"required"`` / ``"any"`` / True, a tool name,
        ``{"type": "function", "function": {"name": ...}}`` (OpenAI) or ``{"name": ...}``."""
        par = bool(parallel)
        if choice is None or choice == "auto":
            return cls("auto", parallel=par)
        if choice == "none" or choice is False:
            return cls("none", parallel=par)
        if choice in ("required", "any") or choice is True:
            return cls("required", parallel=par)
        if isinstance(choice, Mapping):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else choice.get("name")
            if not isinstance(name, str):
                raise ToolChoiceError(f"tool_choice {dict(choice)!r}: name a function, e.g. "
                                      '{"type": "function", "function": {"name": "lookup_order"}}')
            choice = name
        if isinstance(choice, str):
            if choice not in tools:
                raise ToolChoiceError(f"tool_choice names {choice!r}, which is not bound (bound: "
                                      f"{', '.join(tools.names) or 'none'}); use auto, none, required or a bound name")
            return cls("tool", choice, parallel=False)
        raise ToolChoiceError(f"tool_choice {choice!r}: use auto, none, required, or a bound tool's name")


def turn_grammar(tools: ToolSet | None, choice: ToolChoice | None, response_schema: Mapping[str, Any] | None) -> str | None:
    """The llguidance grammar of a turn, or None when it is free text (no tools and no schema, or tool_choice none)."""
    llg = _llg()
    if response_schema is not None:
        return str(llg.LLMatcher.grammar_from_json_schema(_with_options(response_schema)))
    if not tools or choice is None or choice.mode == "none":
        return None
    called = tools.only([choice.name]) if choice.mode == "tool" and choice.name else tools
    call = (f"call: {json.dumps(fmt.OPEN)} json {json.dumps(fmt.CLOSE)}\n"
            f"json: %json {json.dumps(_with_options(fmt.call_schema(called)))}\n")
    calls = f"calls: call ({json.dumps(fmt.SEPARATOR)} call)*\n" if choice.parallel else "calls: call\n"
    if choice.mode == "auto":  # a text answer cannot start with "<" (the call's first character)
        start = "start: TEXT | calls\nTEXT: /[^<](.|\\n)*/\n"
    else:
        start = "start: calls\n"
    return str(llg.LLMatcher.grammar_from_lark(start + calls + call))


def turn_grammar(tools: ToolSet | None, choice: ToolChoice | None, response_schema: Mapping[str, Any] | None) -> str | None:
    """The grammar of a turn, or None when it is free text (no tools and no schema, or tool_choice none). With tools
    that may be called and a ``response_schema``: ``auto`` is a call or a reply following the schema (a JSON value
    never starts with ``<``), ``required`` or a named tool calls only."""
    if not tools or choice is None or choice.mode == "none":
        return json_grammar(response_schema) if response_schema is not None else None
    called = tools.only([choice.name]) if choice.mode == "tool" and choice.name else tools
    call = f"call: {json.dumps(fmt.OPEN)} json {json.dumps(fmt.CLOSE)}\njson: {json_lark(fmt.call_schema(called))}\n"
    calls = f"calls: call ({json.dumps(fmt.SEPARATOR)} call)*\n" if choice.parallel else "calls: call\n"
    if choice.mode == "auto" and response_schema is not None:
        start = f"start: reply | calls\nreply: {json_lark(response_schema)}\n"
    elif choice.mode == "auto":  # a text answer cannot start with "<" (the call's first character)
        start = "start: TEXT | calls\nTEXT: /[^<](.|\\n)*/\n"
    else:
        start = "start: calls\n"
    return lark_grammar(start + calls + call)


__all__ = ["ToolChoice", "turn_grammar"]
