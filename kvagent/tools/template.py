"""A model's tool format read off its chat template (``tokenizer.chat_template``), by rendering sentinel
conversations with tools, calls and results and cutting around the sentinels, as ``kvagent.chat_format`` reads the
role wrappers.

What it reads: where the tools go (the end of the first system message, as Qwen2.5 / Qwen3 / Hermes templates put
them; the text before, between and after the tools' JSON), the system text the template writes when a prompt has
none, how a call is written (the text around ``{"name": ..., "arguments": ...}``, and between two calls), and how
a tool's result is written (the text around it in its user turn, and between two results). A template that puts
tools elsewhere (in a user message, as Llama-3.1's and Mistral's do), writes them in another shape, or writes calls
in another grammar yields None, and kvagent's own Hermes-style format is used (a warning names the template).

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

from kvagent.tools.format import ToolFormat

log = logging.getLogger(__name__)

_SYS, _USER, _RES1, _RES2 = "KVASYSX", "KVAUSERX", "KVARES1X", "KVARES2X"
_TOOLS = [{"type": "function", "function": {"name": f"kvafn{i}x", "description": f"KVADESC{i}X",
                                            "parameters": {"type": "object", "properties": {f"kvarg{i}x": {
                                                "type": "string"}}, "required": [f"kvarg{i}x"]}}} for i in (1, 2)]
_CALLS = [{"id": f"call_kva{i}", "type": "function", "function": {"name": f"kvafn{i}x", "arguments": {
    f"kvarg{i}x": f"KVAVAL{i}X"}}} for i in (1, 2)]


def tool_format_of(template: str, user_open: str, user_close: str, name: str = "model") -> ToolFormat | None:
    """The tool format ``template`` renders, or None where it has none kvagent can read (see the module).
    ``user_open``/``user_close``: the chat format's user message tags (a result is a user turn)."""
    from kvagent.chat_format import compile_template

    try:
        compiled = compile_template(template)
    except Exception as exc:  # jinja syntax errors: ChatFormat reports them
        log.debug("%s: the chat template does not compile (%s)", name, exc)
        return None

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool = False) -> str:
        return str(compiled.render(messages=messages, tools=tools, add_generation_prompt=gen, bos_token="",
                                   eos_token=""))

    try:
        return _read(render, user_open, user_close)
    except Exception as exc:  # a template that renders tools some other way, or refuses these conversations
        log.debug("%s: no tool format read from the chat template (%s)", name, exc)
        return None


def _read(render: Any, user_open: str, user_close: str) -> ToolFormat | None:
    system, user = {"role": "system", "content": _SYS}, {"role": "user", "content": _USER}
    one, two = (json.dumps(t, ensure_ascii=False) for t in _TOOLS)
    with_tools = render([system, user], _TOOLS)
    if one not in with_tools or two not in with_tools:
        return None  # tools not written as their JSON: not a shape kvagent reads
    plain = render([system, user], None)
    sys_open = plain[: plain.index(_SYS)]
    sys_close_and_user = plain[plain.index(_SYS) + len(_SYS): plain.index(_USER)]
    if not with_tools.startswith(sys_open + _SYS) or with_tools.index(one) > with_tools.index(_USER):
        return None  # the tools are not in the system message (Llama-3.1 and Mistral put them in a user message)
    block = with_tools[len(sys_open) + len(_SYS): with_tools.index(_USER)]
    header = block[: block.index(one)]
    between = block[block.index(one) + len(one): block.index(two)]
    after = block[block.index(two) + len(two):]
    if not after.endswith(sys_close_and_user) or not after.startswith(between):
        return None
    footer = after[len(between): len(after) - len(sys_close_and_user)]
    # the default system text, where a prompt has none: the block follows it
    bare = render([user], _TOOLS)
    default_system = bare[len(sys_open): bare.index(header)] if bare.startswith(sys_open) and header in bare else ""

    gen = render([system, user], _TOOLS, gen=True)
    made = render([system, user, {"role": "assistant", "content": "", "tool_calls": _CALLS[:1]}], _TOOLS)
    both = render([system, user, {"role": "assistant", "content": "", "tool_calls": _CALLS}], _TOOLS)
    body1, body2 = (json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                               ensure_ascii=False) for c in _CALLS)
    if not made.startswith(gen) or not both.startswith(gen) or body1 not in made or body2 not in both:
        return None  # calls not written as {"name": ..., "arguments": ...} after the generation prompt
    turn, turn2 = made[len(gen):], both[len(gen):]
    call_open = turn[: turn.index(body1)]
    ending = turn[turn.index(body1) + len(body1):]  # the call's closing text, then the assistant message's
    second = turn2.index(body2)
    if not call_open.strip() or turn2[second - len(call_open): second] != call_open or not turn2.endswith(ending):
        return None  # untagged calls, or a second call not written as the first
    separated = turn2[turn2.index(body1) + len(body1): second - len(call_open)]  # close + separator
    call_close = separated[: _common_prefix(separated, ending)]
    call_separator = separated[len(call_close):]
    if not call_close.strip():
        return None

    asked = [system, user, {"role": "assistant", "content": "", "tool_calls": _CALLS}]
    result1 = {"role": "tool", "tool_call_id": "call_kva1", "name": "kvafn1x", "content": _RES1}
    result2 = {"role": "tool", "tool_call_id": "call_kva2", "name": "kvafn2x", "content": _RES2}
    one_result, two_results = render([*asked, result1], _TOOLS), render([*asked, result1, result2], _TOOLS)
    if not one_result.startswith(both) or not two_results.startswith(both):
        return None
    message = one_result[len(both):]
    if not message.startswith(user_open) or not message.endswith(user_close):
        return None  # results are not user turns of this chat format
    result_open = message[len(user_open): message.index(_RES1)]
    result_close = message[message.index(_RES1) + len(_RES1): len(message) - len(user_close)]
    joined = two_results[len(both):]
    between_results = joined[joined.index(_RES1) + len(_RES1): joined.index(_RES2)]
    separate = result_close + user_close + user_open + result_open
    if between_results == separate:
        result_separator = None
    elif between_results.startswith(result_close) and between_results.endswith(result_open):
        result_separator = between_results[len(result_close): len(between_results) - len(result_open)]
    else:
        return None
    return ToolFormat(
        "the model's chat template", header=header, tool_open="", tool_close=between, footer=footer,
        call_open=call_open, call_close=call_close, call_separator=call_separator, result_open=result_open,
        result_close=result_close, result_separator=result_separator, inline=True, default_system=default_system,
        wrap_tool=True, untagged=True, transplant=False,
    )


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


__all__ = ["tool_format_of"]
