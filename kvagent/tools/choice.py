"""Which calls a turn may make (``tool_choice``, ``parallel_tool_calls``) and the grammar that holds it to them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvagent.errors import ToolChoiceError
from kvagent.tools import format as fmt
from kvagent.tools.grammar import json_grammar, json_lark, lark_grammar, lark_text
from kvagent.tools.spec import ToolSet

if TYPE_CHECKING:
    from kvagent.backends.base import Backend
    from kvagent.messages import ChatMessage


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


def turn_grammar(tools: ToolSet | None, choice: ToolChoice | None, response_schema: Mapping[str, Any] | None,
                 tool_format: fmt.ToolFormat = fmt.HERMES, backend: Backend | None = None) -> str | None:
    """The grammar of a turn, or None when it is free text (no tools and no schema). ``tool_choice`` none: text that
    does not open a call (or the reply in the schema). With tools that may be called and a ``response_schema``:
    ``auto`` is a call or a reply following the schema (a JSON value never starts with ``<``), ``required`` or a
    named tool calls only. Calls are written in ``tool_format``; with ``backend``, its special tokens (Qwen's
    ``<tool_call>``) are tokens of the grammar, as the model writes them."""
    if not tools or choice is None:
        return json_grammar(response_schema) if response_schema is not None else None
    if choice.mode == "none":
        if response_schema is not None:
            return json_grammar(response_schema)
        return lark_grammar("start: TEXT\nTEXT: /[^<](.|\\n)*/\n")
    called = tools.only([choice.name]) if choice.mode == "tool" and choice.name else tools

    def literal(text: str) -> str:
        return lark_text(backend, text) if backend is not None else json.dumps(text)

    f = tool_format
    call = (f"call: {literal(f.call_open)} json {literal(f.call_close)}\n"
            f"json: {json_lark(fmt.call_schema(called))}\n")
    calls = f"calls: call ({literal(f.call_separator)} call)*\n" if choice.parallel else "calls: call\n"
    if choice.mode == "auto" and response_schema is not None:
        start = f"start: reply | calls\nreply: {json_lark(response_schema)}\n"
    elif choice.mode == "auto":  # a text answer cannot start with "<" (the call's first character)
        start = "start: TEXT | calls\nTEXT: /[^<](.|\\n)*/\n"
    else:
        start = "start: calls\n"
    return lark_grammar(start + calls + call)


def each_tool_once(messages: Sequence[ChatMessage], tools: ToolSet) -> tuple[str, ToolSet]:
    """The ``each_once`` decoding of ``tool_choice="auto"`` for models too small to choose a call on their own
    (measured: under free ``auto`` neither shipped model ever starts a call, 0 of 8 requests each): after the
    last user message, the turn must call one of the tools not called since; once each was called, it answers
    in text. Returns (tool_choice, the tools the turn may call)."""
    since = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1) + 1
    called = {c.name for m in messages[since:] if m.role == "assistant" for c in m.tool_calls}
    left = [t for t in tools if t.name not in called]
    return ("required", ToolSet(left)) if left else ("none", tools)


__all__ = ["ToolChoice", "each_tool_once", "turn_grammar"]
