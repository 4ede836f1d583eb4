"""A model's tool format read off its chat template (``tokenizer.chat_template``), by rendering sentinel
conversations with tools, calls and results and cutting around the sentinels, as ``kvagent.chat_format`` reads the
role wrappers.

What it reads: where the tools go (the end of the first system message, as Qwen2.5 / Qwen3 templates put them, or
the start of the first user message, as Llama-3.1 / 3.2 / 3.3's do by default; the text before, between and after
the tools' JSON and its indent), the system text the template writes when a prompt has none and the system
header it writes when tools are bound (Llama-3.x's ``Environment: ipython``), how a call is written (the text around
``{"name": ..., "arguments": ...}`` or the bare object with ``"parameters"``, between two calls, or one call per
turn where the template refuses two, or the name before its arguments as Mistral's ``[TOOL_CALLS]name[ARGS]{...}``),
and how a tool's result is written (in a user turn, joined to the next, or as a turn of its own role such as
Llama-3.x's ``ipython`` or Mistral's ``[TOOL_RESULTS]``, its content maybe as a JSON string). The tools may also be a
message of their own between the system message and the first user message (Devstral's and Ministral-3's
``[AVAILABLE_TOOLS]``). A template that puts tools elsewhere (a system message of their own before the caller's, as
Hermes-2/3's; before the last user message, as Mistral-Nemo's and Small-3.2's), writes them in another shape, or
writes calls in another grammar yields None, and kvagent's own Hermes-style format is used (a warning names the
template).

The tools of a template format are prefilled where they stand, not transplanted: measured on Qwen2.5-Coder-0.5B
(the held-out agent set's first request per tool, ``tool_choice="auto"``), transplanted tool descriptions left 1 of
8 requests with a call against 6 of 8 prefilled; re-rotated or shifted by ``seq_add`` alike (0 of 8), the block
transplanted whole 3 of 8, compiled behind the system message's opening 0 of 8, a quarter recomputed 0 of 8. A
tool-trained model reads its tools in context.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvagent.chat_format import ChatFormat, compile_template
from kvagent.tools.format import ToolFormat

log = logging.getLogger(__name__)

_SYS, _USER, _RES1, _RES2 = "KVASYSX", "KVAUSERX", "KVARES1X", "KVARES2X"
_TOOLS = [{"type": "function", "function": {"name": f"kvafn{i}x", "description": f"KVADESC{i}X",
                                            "parameters": {"type": "object", "properties": {f"kvarg{i}x": {
                                                "type": "string"}}, "required": [f"kvarg{i}x"]}}} for i in (1, 2)]
_CALLS = [{"id": f"call_kva{i}", "type": "function", "function": {"name": f"kvafn{i}x", "arguments": {
    f"kvarg{i}x": f"KVAVAL{i}X"}}} for i in (1, 2)]


def tool_format_of(template: str, chat: ChatFormat, name: str = "model") -> ToolFormat | None:
    """The tool format ``template`` renders, or None where it has none kvagent can read (see the module).
    ``chat``: the role wrappers read off the same template (:meth:`ChatFormat.from_template`)."""
    try:
        compiled = compile_template(template)
    except Exception as exc:  # jinja syntax errors: ChatFormat reports them
        log.debug("%s: the chat template does not compile (%s)", name, exc)
        return None

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool = False) -> str:
        return str(compiled.render(messages=messages, tools=tools, add_generation_prompt=gen, bos_token="",
                                   eos_token=chat.eos_token))

    try:
        return _read(render, chat)
    except Exception as exc:  # a template that renders tools some other way, or refuses these conversations
        log.debug("%s: no tool format read from the chat template (%s)", name, exc)
        return None


def _read(render: Any, chat: ChatFormat) -> ToolFormat | None:
    user_open, user_close, asst_close = chat.user.open, chat.user.close, chat.assistant.close
    system, user = {"role": "system", "content": _SYS}, {"role": "user", "content": _USER}
    with_tools = render([system, user], _TOOLS)
    indent = next((i for i in (None, 4, 2) if all(json.dumps(t, ensure_ascii=False, indent=i) in with_tools
                                                   for t in _TOOLS)), -1)
    if indent == -1:
        return None  # tools not written as their JSON: not a shape kvagent reads
    one, two = (json.dumps(t, ensure_ascii=False, indent=indent) for t in _TOOLS)
    plain = render([system, user], None)
    if _SYS not in with_tools or _SYS not in plain:
        return None
    sys_open, sys_open_tools = plain[: plain.index(_SYS)], with_tools[: with_tools.index(_SYS)]
    sys_close_and_user = plain[plain.index(_SYS) + len(_SYS): plain.index(_USER)]
    after_sys = with_tools[with_tools.index(_SYS) + len(_SYS): with_tools.index(_USER)]
    sys_close = chat.system.close
    in_user = after_sys.startswith(sys_close_and_user) and one in after_sys  # the tools open the user message
    # a message of their own between the system message and the first user message (Devstral's, Ministral-3's)
    own_message = (not in_user and bool(sys_close) and bool(user_open) and sys_close_and_user == sys_close + user_open
                   and after_sys.startswith(sys_close) and after_sys.endswith(user_open) and one in after_sys)
    if in_user:
        if not sys_close_and_user.endswith(user_open) or not user_open:
            return None
        block = after_sys[len(sys_close_and_user):]
    elif own_message:
        block = after_sys[len(sys_close): len(after_sys) - len(user_open)]
    elif sys_open_tools == sys_open and one in after_sys:  # the tools continue the system message
        block = after_sys
    else:
        return None  # elsewhere (before the last user message, as Mistral-Nemo's and Small-3.2's templates)
    header = block[: block.index(one)]
    between = block[block.index(one) + len(one): block.index(two)]
    after = block[block.index(two) + len(two):]
    if own_message:  # the tools joined by ``between``, the message's wrappers around them
        footer = after
    elif not after.startswith(between):
        return None
    elif in_user:
        footer = after[len(between):]
    elif after.endswith(sys_close_and_user):
        footer = after[len(between): len(after) - len(sys_close_and_user)]
    else:
        return None
    default_system = ""
    if not in_user and not own_message:  # the default system text, where a prompt has none: the block follows it
        bare = render([user], _TOOLS)
        default_system = bare[len(sys_open): bare.index(header)] if bare.startswith(sys_open) and header in bare else ""

    # calls and results read off conversations whose call turn is followed by its results: a template may open
    # the last assistant turn with more (Qwen3's empty think block), which a call turn followed by results has not
    gen = render([system, user], _TOOLS, gen=True)
    result1 = {"role": "tool", "tool_call_id": "call_kva1", "name": "kvafn1x", "content": _RES1}
    result2 = {"role": "tool", "tool_call_id": "call_kva2", "name": "kvafn2x", "content": _RES2}

    def answered(calls: list[dict[str, Any]], results: list[dict[str, Any]]) -> tuple[str, str]:
        """(the call turn after the generation prompt, closed; the results' text after it)"""
        text = render([system, user, {"role": "assistant", "content": "", "tool_calls": calls}, *results], _TOOLS)
        if not asst_close or not text.startswith(gen):
            raise ValueError("the call turn does not follow the generation prompt")
        last = calls[-1]["function"]
        cut = text.index(asst_close, text.index(json.dumps(last["arguments"], ensure_ascii=False), len(gen)))
        return text[len(gen): cut + len(asst_close)], text[cut + len(asst_close):]

    turn, message = answered(_CALLS[:1], [result1])
    try:
        turn2, _ = answered(_CALLS, [result1])
        _, joined = answered(_CALLS, [result1, result2])
    except Exception:  # the template refuses two calls in a turn (Llama-3.x)
        turn2 = joined = None
    key = next((k for k in ("arguments", "parameters") if _body(_CALLS[0], k) in turn), None)
    name_close = None if key is not None else _name_close(turn, _CALLS[0])
    if key is None and not name_close:
        return None  # calls neither {"name": ..., "arguments": ...} nor a name and its arguments
    first_call, second_call = _span(turn, _CALLS[0], key, name_close), None
    if first_call is None:
        return None
    call_open = turn[: first_call[0]]
    ending = turn[first_call[1]:]  # the call's closing text, then the assistant message's
    if turn2 is None:
        call_close, call_separator = ending[: len(ending) - len(asst_close)], ""
    else:
        first_call, second_call = _span(turn2, _CALLS[0], key, name_close), _span(turn2, _CALLS[1], key, name_close)
        if first_call is None or second_call is None or \
                turn2[second_call[0] - len(call_open): second_call[0]] != call_open or not turn2.endswith(ending):
            return None  # a second call not written as the first
        separated = turn2[first_call[1]: second_call[0] - len(call_open)]  # close + separator
        call_close = separated[: _common_prefix(separated, ending)]
        call_separator = separated[len(call_close):]
    if name_close is None and bool(call_open.strip()) != bool(call_close.strip()):
        return None  # a call opened and not closed by tags (or the other way round): not a shape kvagent reads

    result_turn = result_json = False
    if message.startswith(user_open) and message.endswith(user_close) and _RES1 in message:
        result_open = message[len(user_open): message.index(_RES1)]
        result_close = message[message.index(_RES1) + len(_RES1): len(message) - len(user_close)]
    else:  # a turn of its own role (Llama-3.x's ``ipython``), its content maybe written as JSON
        result_turn, content = True, _RES1
        if json.dumps(_RES1) in message:
            result_json, content = True, json.dumps(_RES1)
        if content not in message:
            return None
        result_open = message[: message.index(content)]
        result_close = message[message.index(content) + len(content):]
        if not result_close.endswith(asst_close) and not result_close.strip():
            return None
        if joined is not None and joined.count(result_open + _RES2 + result_close) != 1:
            return None  # two results not written as two such turns
    result_separator = None
    if joined is not None and not result_turn:
        between_results = joined[joined.index(_RES1) + len(_RES1): joined.index(_RES2)]
        separate = result_close + user_close + user_open + result_open
        if between_results != separate:
            if not (between_results.startswith(result_close) and between_results.endswith(result_open)):
                return None
            result_separator = between_results[len(result_close): len(between_results) - len(result_open)]
    return ToolFormat(
        "the model's chat template", header=header, tool_open="", tool_close=between, footer=footer,
        call_open=call_open, call_close=call_close, call_separator=call_separator, result_open=result_open,
        result_close=result_close, result_separator=result_separator, inline=not in_user,
        default_system=default_system, wrap_tool=True, untagged=True, transplant=False, in_user=in_user,
        system_open=sys_open_tools if sys_open_tools != sys_open else None, tool_indent=indent,
        arguments_key=key or "arguments", single_call=turn2 is None, result_turn=result_turn, result_json=result_json,
        own_message=own_message, tool_joiner=between if own_message else "", call_name_close=name_close,
    )


def _name_close(turn: str, call: dict[str, Any]) -> str | None:
    """The text between a call's name and its arguments' JSON, where a turn writes them so (Mistral's ``[ARGS]``)."""
    name, arguments = call["function"]["name"], json.dumps(call["function"]["arguments"], ensure_ascii=False)
    at = turn.find(name)
    end = turn.find(arguments, at + len(name)) if at >= 0 else -1
    return turn[at + len(name): end] if end > at and turn[at + len(name): end].strip() else None


def _span(turn: str, call: dict[str, Any], key: str | None, name_close: str | None) -> tuple[int, int] | None:
    """Where a call's own text (its JSON object, or its name, ``name_close`` and arguments) is in a turn."""
    text = (_body(call, key) if key is not None else
            call["function"]["name"] + str(name_close) + json.dumps(call["function"]["arguments"], ensure_ascii=False))
    at = turn.find(text)
    return (at, at + len(text)) if at >= 0 else None


def _body(call: dict[str, Any], key: str) -> str:
    """A call's JSON as templates write it: ``{"name": ..., <key>: <arguments>}``."""
    return json.dumps({"name": call["function"]["name"], key: call["function"]["arguments"]}, ensure_ascii=False)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


__all__ = ["tool_format_of"]
