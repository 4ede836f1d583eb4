"""Which calls a turn may make (``tool_choice``, ``parallel_tool_calls``) and the grammar that holds it to them."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from kvagent.errors import ToolChoiceError
from kvagent.tools import format as fmt
from kvagent.tools.grammar import LOOSE_JSON_OPTIONS, LOOSE_WS, json_grammar, json_lark, lark_grammar, lark_text
from kvagent.tools.spec import ToolSet

if TYPE_CHECKING:
    from kvagent.backends.base import Backend


class Message(Protocol):
    """What :func:`spent_tools` and :func:`each_tool_once` read of a conversation's message
    (:class:`kvagent.messages.ChatMessage` is one)."""

    @property
    def role(self) -> str: ...
    @property
    def tool_calls(self) -> Sequence[fmt.ToolCall]: ...


@dataclass(frozen=True)
class ToolChoice:
    """Which calls a turn may make: ``mode`` ``auto`` (text or calls), ``none`` (text only), ``required`` (at
    least one call), or ``tool`` (one call to ``name``); ``parallel``: several calls in one turn.

    Several calls only where asked (``parallel=True``): measured on both shipped models, a grammar that allows
    another call after the first makes them repeat the same call until ``max_tokens``.

    ``spent``: bound tools that ``auto`` and ``required`` may not call this turn (:func:`spent_tools`: called since the
    last user message, their results are in the prompt); they stay bound, and a reply may not open their bare call."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = False
    spent: frozenset[str] = frozenset()

    @classmethod
    def of(cls, choice: Any, tools: ToolSet, parallel: bool | None = None) -> ToolChoice:
        """From the ecosystems' spellings: ``"auto"``, ``"none"``, ``"required"`` / ``"any"`` / True, a tool name,
        ``{"type": "function", "function": {"name": ...}}`` (OpenAI) or ``{"name": ...}``; a ``ToolChoice`` as it is
        (``parallel``, when given, replacing its own)."""
        if isinstance(choice, ToolChoice):
            unknown = sorted(n for n in choice.spent | ({choice.name} if choice.name else set()) if n not in tools)
            if unknown:
                raise ToolChoiceError(f"tool_choice names {unknown[0]!r}, which is not bound (bound: "
                                      f"{', '.join(tools.names) or 'none'})")
            return choice if parallel is None else replace(choice, parallel=bool(parallel))
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
    named tool calls only. Without a schema, ``auto`` is a call or text; where the format reads bare-JSON calls
    (``tool_format.untagged``), text may not open a JSON object naming a bound tool: such a reply is that bare call
    (optionally fenced). Calls are written in ``tool_format``; with ``backend``, its special tokens (Qwen's
    ``<tool_call>``) are tokens of the grammar, as the model writes them."""
    if not tools or choice is None:
        return json_grammar(response_schema) if response_schema is not None else None
    called = callable_tools(tools, choice)
    if choice.mode == "none" or not called:
        if response_schema is not None:
            return json_grammar(response_schema)
        if tool_format.untagged:  # nor a bare call to a bound tool, which would be read as none
            return lark_grammar(f"start: TEXT\n{_text(tools, choice)}\n")
        return lark_grammar("start: TEXT\nTEXT: /[^<](.|\\n)*/\n")

    def literal(text: str) -> str:
        return lark_text(backend, text) if backend is not None else json.dumps(text)

    f = tool_format
    close = f" {literal(f.call_close)}" if f.call_close else ""
    if f.call_name_close is not None:  # the name, then its arguments (Mistral's [TOOL_CALLS]name[ARGS]{...})
        call = (f"call: {literal(f.call_open)} ("
                + " | ".join(f"{json.dumps(t.name)} {literal(f.call_name_close)} named{i}" for i, t in enumerate(called))
                + f"){close}\n"
                + "".join(f"named{i}: {json_lark({'additionalProperties': False, **dict(t.parameters)})}\n"
                          for i, t in enumerate(called)))
    else:  # a format of bare calls (Llama-3.x) writes the call object alone
        call = (f"call: {literal(f.call_open)} json{close}\n" if f.tagged else "call: json\n") + \
            f"json: {json_lark(fmt.call_schema(called, f.arguments_key))}\n"
    separator = f"{literal(f.call_separator)} " if f.call_separator else ""
    calls = f"calls: call ({separator}call)*\n" if choice.parallel and not f.single_call else "calls: call\n"
    if choice.mode == "auto" and response_schema is not None:
        start = f"start: reply | calls\nreply: {json_lark(response_schema)}\n"
    elif choice.mode == "auto" and f.untagged:  # a format of bare calls has them as ``bare`` only
        start = (f"start: TEXT | {'calls | ' if f.tagged else ''}bare\n{_text(tools, choice)}\n"
                 f"{_bare_calls(called)}")
    elif choice.mode == "auto":  # a text answer cannot start with "<" (the call's first character)
        start = "start: TEXT | calls\nTEXT: /[^<](.|\\n)*/\n"
    else:
        start = "start: calls\n"
    return lark_grammar(start + calls + call)


_WS = LOOSE_WS  # between a bare call's tokens, as inside its arguments


def callable_tools(tools: ToolSet, choice: ToolChoice) -> ToolSet:
    """The tools a turn under ``choice`` may call: the named one, else the bound ones not ``spent`` (none for
    ``none``). ``required`` with every tool spent is refused by name."""
    if choice.mode == "none":
        return ToolSet()
    if choice.mode == "tool" and choice.name:
        return tools.only([choice.name])
    left = tools.only([n for n in tools.names if n not in choice.spent])
    if not left and choice.mode == "required":
        raise ToolChoiceError(f"tool_choice required, but every bound tool ({', '.join(tools.names)}) was called since "
                              "the last user message: bind another tool or use auto")
    return left


def _text(tools: ToolSet, choice: ToolChoice) -> str:
    """``TEXT`` for a format whose model also writes bare-JSON calls: it may not open a JSON object with a bound tool's
    name (bare or in a ```json fence), so that such a reply is either a valid call or no reply at all. Once a tool is
    ``spent``, the text holds no ``{`` at all (measured on Qwen2.5-Coder-0.5B: kept from repeating its call, it writes
    the call as text, with a stray character in the name, a key spelled ``"name}``, or behind a second fence)."""
    if choice.spent:
        return "TEXT: /[^<{][^{]*/"
    names = "|".join(t.name for t in tools)
    return f'TEXT: /[^<](.|\\n)*/ & ~/\\s*(```(json)?\\s*)?\\{{{_WS}"name"{_WS}:{_WS}"({names})"(.|\\n)*/'


def _bare_calls(tools: ToolSet) -> str:
    """Lark rules for ``auto`` where the model also writes its calls as bare JSON (Qwen2.5-Coder does), beside
    :func:`_text`: a reply that opens a JSON object with the name of one of ``tools``, bare or in a ```json fence, is
    that call with valid arguments. A near miss (an extra or missing key) is decoded as the call it starts instead of
    failing to parse into text; any other name leaves the reply free text, so the grammar never turns a made-up tool
    into a real one.

    Each call's head (``{"name": "<tool>", "arguments":``) is one terminal, so that it outlives ``TEXT`` (which ends at
    the bound name's closing quote) in llguidance's lexer; the arguments are the tool's schema."""
    rules = ["bare: plain | fenced"]
    plain, fenced = [], []
    for i, t in enumerate(tools):
        head = f'\\{{{_WS}"name"{_WS}:{_WS}"{t.name}"{_WS},{_WS}"(arguments|parameters)"{_WS}:{_WS}'
        rules += [f"args{i}: {json_lark(t.parameters, LOOSE_JSON_OPTIONS)}",
                  f"HEAD{i}: /\\s{{0,2}}{head}/", f"FHEAD{i}: /\\s{{0,2}}```json\\s{{0,2}}{head}/"]
        plain.append(f"HEAD{i} args{i} TAIL")
        fenced.append(f"FHEAD{i} args{i} FTAIL")
    rules += [f"plain: {' | '.join(plain)}", f"fenced: {' | '.join(fenced)}",
              f"TAIL: /{_WS}\\}}\\s{{0,2}}/", f"FTAIL: /{_WS}\\}}\\s{{0,2}}```\\s{{0,2}}/"]
    return "\n".join(rules) + "\n"


def spent_tools(messages: Sequence[Message], tools: ToolSet) -> frozenset[str]:
    """The tools of ``tools`` called since the last user message (their results are in the prompt; a call to a tool no
    longer bound is left out): the ``once`` decoding of ``tool_choice="auto"`` (``ToolChoice(spent=...)``). Measured on Qwen2.5-Coder-0.5B-Instruct: with the template's
    own rendering of the call and its result, it writes the same call again, free as under the grammar, and an
    agent loop never ends."""
    since = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1) + 1
    return frozenset(c.name for m in messages[since:] if m.role == "assistant" for c in m.tool_calls if c.name in tools)


def each_tool_once(messages: Sequence[Message], tools: ToolSet) -> tuple[str, ToolSet]:
    """The ``each_once`` decoding of ``tool_choice="auto"`` for models too small to choose a call on their own
    (measured: under free ``auto`` neither shipped model ever starts a call, 0 of 8 requests each): after the
    last user message, the turn must call one of the tools not called since; once each was called, it answers
    in text. Returns (tool_choice, the tools the turn may call)."""
    since = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1) + 1
    called = {c.name for m in messages[since:] if m.role == "assistant" for c in m.tool_calls}
    left = [t for t in tools if t.name not in called]
    return ("required", ToolSet(left)) if left else ("none", tools)


__all__ = ["ToolChoice", "callable_tools", "each_tool_once", "spent_tools", "turn_grammar"]
