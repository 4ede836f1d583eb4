"""How tools, tool calls and tool results are written in a prompt: a model's tool format.

A tool-trained model reads tools, writes calls and reads results in the format its chat template renders them
(Qwen2.5 / Qwen3 / Hermes: the tools as JSON lines inside ``<tools></tools>`` at the end of the system message, a
call as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, results in ``<tool_response>`` inside a
user turn). :mod:`kvagent.tools.template` reads a :class:`ToolFormat` off the template's own rendering, so the
prompt is the one the model was trained on. Where the template has no tool format (SmolLM2's ChatML template,
Gemma-3's built-in turns), kvagent writes its own Hermes-style text, :data:`HERMES`: the tool descriptions as JSON
lines in system messages of their own, a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a
result as ``<tool_response name="..." id="...">...</tool_response>`` in a user turn.

Every tool is its own SKILL segment: compiled once per model, transplanted into any prompt, and a changed tool
recompiles only its own segment. A format whose tools continue the system message (``inline``) writes them as
parts of that message (``Segment.opens``/``closes``): the instructions, one segment per tool, the closing text,
cut where the tokenizer splits anyway (a tool's segment ends with the newline after its JSON), so the tools'
tokens are those of a cold render of the whole prompt.

Calls are decoded under a grammar (``kvagent.tools.choice``) that takes the format's special tokens as tokens;
parsing a call of a constrained turn cannot fail. A model may also write a call as bare JSON
(``{"name": ..., "arguments": ...}``, as Qwen2.5-Coder does): :meth:`ToolFormat.untagged_calls` reads those the way
llama.cpp's generic handler does, and only when the whole reply is such a call to a bound tool.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from kvagent.chat_format import RoleWrap
from kvagent.errors import SegmentOrderError, ToolCallError
from kvagent.segments import Segment, SegmentKind
from kvagent.tools.grammar import ITEM_SEPARATOR, KEY_SEPARATOR
from kvagent.tools.spec import ToolSet, ToolSpec

INSTRUCTIONS = (
    "You can call tools. To call one, answer with exactly one line per call: "
    '<tool_call>{"name": "<tool name>", "arguments": {<the arguments as JSON>}}</tool_call>. '
    "Call a tool when the answer needs it; otherwise answer in plain text. The tools are:"
)
TOOLS_ID = "tools"
"""The id of a prompt's tool instructions segment; each tool's is ``tool-<name>``, the closing text's ``tools-end``."""


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


def call_schema(tools: ToolSet, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call to one of ``tools``: ``{"name": <const>, "arguments": <its parameters>}`` (the
    arguments under ``arguments_key``: Llama-3.x's templates write ``"parameters"``). An
    arguments object that does not say otherwise takes no keys beyond its properties (``additionalProperties:
    false``, as OpenAI's strict mode): measured on both shipped models, an open object makes them append
    schema-like keys until ``max_tokens`` (the grammar closes nested objects too: :func:`grammar.closed_objects`)."""
    return {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.name}, arguments_key: {"additionalProperties": False, **dict(t.parameters)}},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for t in tools]}


def openai_tool(tool: ToolSpec) -> dict[str, Any]:
    """A tool as chat templates take it (``tools``): OpenAI's ``{"type": "function", "function": {...}}``."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": dict(tool.parameters)}}


def describe(tool: ToolSpec) -> str:
    """A tool as kvagent's own format writes it: one JSON line with its name, description and parameters."""
    return dumps({"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)})


@dataclass(frozen=True)
class ToolFormat:
    """How one model's prompt holds tools, calls and results.

    Tools: ``header`` text, then per tool ``tool_open + <its JSON> + tool_close``, then ``footer``; ``inline``: they
    continue the system message before them (that message is kept open, :meth:`attach`), else ``header`` and each
    tool are system messages of their own; ``in_user``: they open the first user message, which continues them
    (Llama-3.x). ``default_system``: the system text the template writes when a prompt has none (an inline block
    needs a system message to continue). ``system_open``: the system message's opening when tools are bound, where
    the template writes another one then (Llama-3.x's ``Environment: ipython``; the renderer uses it). ``wrap_tool``:
    the tool's JSON is OpenAI's ``{"type": "function", "function": ...}`` (as templates are given tools), else
    :func:`describe`'s flat object; ``tool_indent``: its ``tojson`` indent.
    Calls: ``call_open + {"name": ..., "arguments": ...} + call_close`` (the arguments under ``arguments_key``), several
    joined by ``call_separator``; no ``call_open``: calls are bare JSON only (Llama-3.x); ``single_call``: the
    template takes one call per turn. Results: a user turn ``result_open + content + result_close`` (``result_attrs``:
    the open tag names the tool and the call, kvagent's own format); consecutive results share one user message,
    joined by ``result_separator``; ``result_turn``: a result is a turn of its own role, whose wrappers
    ``result_open``/``result_close`` hold (Llama-3.x's ``ipython``), ``result_json``: its content written as a JSON
    string. ``own_message``: the tools are a message of their own between the system message and the first user
    message, ``header`` and ``footer`` its wrappers (special tokens, Mistral's ``[AVAILABLE_TOOLS]``), the tools
    joined by ``tool_joiner``. ``call_name_close``: a call is ``call_open + <name> + call_name_close + <arguments
    JSON> + call_close`` (Mistral's ``[TOOL_CALLS]name[ARGS]{...}``). ``untagged``: read a reply that is only a bare-JSON call as that call. ``transplant``: the tools are SKILL
    segments (compiled once, transplanted), else prefilled where they stand (MEMORY segments: the template formats,
    see :mod:`kvagent.tools.template`)."""

    name: str
    header: str
    tool_open: str
    tool_close: str
    footer: str
    call_open: str
    call_close: str
    call_separator: str
    result_open: str
    result_close: str
    result_separator: str | None = None
    inline: bool = False
    default_system: str = ""
    wrap_tool: bool = False
    result_attrs: bool = False
    untagged: bool = False
    transplant: bool = True
    in_user: bool = False
    system_open: str | None = None
    tool_indent: int | None = None
    arguments_key: str = "arguments"
    single_call: bool = False
    result_turn: bool = False
    result_json: bool = False
    own_message: bool = False
    tool_joiner: str = ""
    call_name_close: str | None = None

    @property
    def tagged(self) -> bool:
        """Whether a call opens with a tag (else calls are bare JSON, read by :meth:`untagged_calls`)."""
        return bool(self.call_open.strip())

    # -- tools ------------------------------------------------------------------------------------
    def tool_json(self, tool: ToolSpec) -> str:
        if self.wrap_tool:
            # as the template's ``tojson`` writes it
            return json.dumps(openai_tool(tool), ensure_ascii=False, indent=self.tool_indent)
        return describe(tool)

    def segments(self, tools: ToolSet) -> list[Segment]:
        """The instructions, one SKILL segment per tool and (inline) the closing text; ``in_user``: user-role parts
        that open a user message and leave it open for the first user turn (:meth:`attach`)."""
        if not tools:
            return []
        if self.own_message:  # the header and footer are the message's wrappers (tools_wrap)
            parts: dict[str, Any] = {"opens": False, "closes": False, "role": "tools", "kind": SegmentKind.MEMORY}
            return [replace(Segment.skill("tools", "", id=TOOLS_ID), **{**parts, "opens": True}),
                    *(replace(Segment.skill(f"tool:{t.name}", f"{self.tool_joiner if i else ''}{self.tool_json(t)}",
                                            id=f"tool-{t.name}"), **parts) for i, t in enumerate(tools)),
                    replace(Segment.skill("tools-end", "", id="tools-end"), **{**parts, "closes": True})]
        more: dict[str, Any] = {"opens": False, "closes": False} if self.inline or self.in_user else {}
        if self.in_user:
            more["role"] = "user"
        if not self.transplant:
            more["kind"] = SegmentKind.MEMORY
        first = {**more, "opens": True} if self.in_user else more  # an in_user block opens the user message
        out = [replace(Segment.skill("tools", self.header, id=TOOLS_ID), **first),
               *(replace(Segment.skill(f"tool:{t.name}", f"{self.tool_open}{self.tool_json(t)}{self.tool_close}",
                                       id=f"tool-{t.name}"), **more) for t in tools)]
        if self.footer:
            out.append(replace(Segment.skill("tools-end", self.footer, id="tools-end"),
                               **{**more, "closes": not self.in_user}))
        return out

    def attach(self, segments: Sequence[Segment]) -> list[Segment]:
        """``segments`` with an inline tool block joined to the system message before it: that message left open
        (it closes after the block), or, where no system message precedes the block, the template's default system
        text opening it (a POLICY at the front, a MEMORY elsewhere); an ``in_user`` block continued by the first user
        turn after it (closed where none follows). Idempotent; other prompts are returned as they are."""
        out = list(segments)
        if self.in_user:
            return _join_user(out)
        at = next((i for i, s in enumerate(out) if s.id == TOOLS_ID and not s.opens), None)
        if at is None:
            return out
        before = out[at - 1] if at else None
        if before is not None and not before.closes:
            return out
        if before is not None and before.role == "system" and before.complete and before.kind is not SegmentKind.SKILL:
            out[at - 1] = replace(before, closes=False)
            return out
        kind = SegmentKind.POLICY if at == 0 else SegmentKind.MEMORY
        out.insert(at, Segment(kind, self.default_system, id="tools-system", closes=False))
        return out

    def opening_with(self, segments: Sequence[Segment]) -> str | None:
        """The opening of a prompt's leading system message where tools change it (:attr:`system_open`: the prompt
        binds tools), else None: its role's own."""
        if self.system_open is None or not any(s.id == TOOLS_ID for s in segments):
            return None
        return self.system_open

    def tools_wrap(self) -> RoleWrap:
        """The wrappers of a ``tools``-role message: the tools as a message of their own (:attr:`own_message`)."""
        if not self.own_message:
            raise SegmentOrderError(f"the {self.name} format writes tools inside another message, not as a tools-role "
                                    "one: build them with ToolFormat.segments")
        return RoleWrap(self.header, self.footer)

    def result_wrap(self) -> RoleWrap:
        """The wrappers of a ``tool``-role segment: a result that is a turn of its own (:attr:`result_turn`)."""
        if not self.result_turn:
            raise SegmentOrderError(f"the {self.name} format writes tool results in user turns, not as tool-role "
                                    "segments: build them with ToolFormat.result_segment")
        return RoleWrap(self.result_open, self.result_close)

    # -- calls ------------------------------------------------------------------------------------
    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """The text of an assistant turn that makes ``calls`` (what the grammar lets the model write)."""
        if self.call_name_close is not None:
            return self.call_separator.join(f"{self.call_open}{c.name}{self.call_name_close}"
                                            f"{dumps(dict(c.arguments))}{self.call_close}" for c in calls)
        return self.call_separator.join(
            f"{self.call_open}{dumps({'name': c.name, self.arguments_key: dict(c.arguments)})}{self.call_close}"
            for c in calls)

    def starts_call(self, text: str) -> bool:
        """Whether a reply opens with a tagged call (a text reply never does under the turn's grammar; a format of
        bare calls has none: :meth:`untagged_calls` reads those)."""
        return self.tagged and text.lstrip().startswith(self.call_open.strip())

    def writes_calls(self, text: str) -> bool:
        """Whether an assistant turn's text holds calls written in this format (a tag, or a bare call's opening)."""
        if self.tagged:
            return self.call_open.strip() in text
        return text.lstrip().startswith('{"name"')

    def parse_calls(self, text: str, tools: ToolSet | None = None, *, complete: bool = True) -> list[ToolCall]:
        """The calls in an assistant turn's text (none: a text answer); ``complete=False`` (the turn was cut by
        ``max_tokens``): the last call may be cut short, and is then no call. :class:`ToolCallError` names the format
        and a call that does not parse or names a tool not in ``tools`` (an unconstrained turn; a constrained one
        always parses). JSON-aware (an argument may contain the closing tag's text); whitespace around the JSON
        is read as the model wrote it."""
        opener, closer = self.call_open.strip(), self.call_close.strip()
        calls, decoder, at = [], json.JSONDecoder(), 0
        while (start := text.find(opener, at)) >= 0:
            begin = _skip_space(text, start + len(opener))
            name = None
            if self.call_name_close is not None:  # the name, then its arguments
                split = text.find(self.call_name_close, begin)
                if split < 0:
                    if not complete:
                        break
                    raise ToolCallError(f"a tool call in the {self.name} format has no {self.call_name_close} after "
                                        f"its name: {text[start:start + 200]!r}")
                name, begin = text[begin:split].strip(), _skip_space(text, split + len(self.call_name_close))
            try:
                data, end = decoder.raw_decode(text, begin)
            except ValueError as exc:
                if not complete:  # cut short: the turn ended inside the call
                    break
                raise ToolCallError(f"a tool call in the {self.name} format does not parse as JSON ({exc}): "
                                    f"{text[begin:begin + 200]!r}") from None
            after = _skip_space(text, end)
            if not text.startswith(closer, after):
                if not complete and closer.startswith(text[after:]):
                    break
                raise ToolCallError(f"a tool call in the {self.name} format is not closed by {closer}: "
                                    f"{text[start:end + 40]!r}")
            calls.append(_call_of({"name": name, "arguments": data} if name is not None else data, tools, self.name,
                                  text[begin:end]))
            at = after + len(closer)
        return calls

    def untagged_calls(self, text: str, tools: ToolSet) -> list[ToolCall]:
        """The calls of a reply that is nothing but bare JSON calls: one object ``{"name": <a bound tool>,
        "arguments" (or "parameters"): {...}}`` or a list of them, optionally in a ```json fence. Anything else
        (prose, JSON with other keys or naming an unbound tool) is no call: an ordinary JSON reply stays text."""
        if not self.untagged or not tools:
            return []
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
        if fenced:
            body = fenced.group(1)
        if not body.startswith(("{", "[")):
            return []
        try:
            data = json.loads(body)
        except ValueError:
            return []
        items = data if isinstance(data, list) else [data]
        calls = []
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"] in tools
                    and set(item) <= {"name", "arguments", "parameters"} and len(item) == 2):
                return []
            arguments = item.get("arguments", item.get("parameters"))
            if not isinstance(arguments, dict):
                return []
            calls.append(ToolCall(item["name"], arguments))
        return calls

    # -- results ----------------------------------------------------------------------------------
    def result_text(self, name: str, call_id: str | None, content: str) -> str:
        if self.result_attrs:
            attrs = f' name="{name}"' + (f' id="{call_id}"' if call_id else "")
            tag = self.result_open.rstrip("\n")
            return f"{tag[:-1]}{attrs}>{self.result_open[len(tag):]}{content}{self.result_close}"
        return f"{self.result_open}{content}{self.result_close}"

    def result_segment(self, name: str, call_id: str | None, content: str, *, id: str = "", opens: bool = True,
                       then_result: bool = False) -> Segment:
        """A tool's result as the turn after the call (a user turn; ``then_result``: another result follows in the
        same message, where the format joins them). The content is written as it is."""
        if self.result_turn:  # a turn of its own role, wrapped as :meth:`result_wrap` says
            body = json.dumps(content, ensure_ascii=False) if self.result_json else content
            return Segment(SegmentKind.TURN, body, role="tool", **({"id": id} if id else {}))
        text = self.result_text(name, call_id, content)
        joined = then_result and self.result_separator is not None
        seg = Segment.user(text + (self.result_separator if joined else ""), **({"id": id} if id else {}))
        return replace(seg, opens=opens, closes=not joined)


PYTHON_TAG = "<|python_tag|>"
"""What Llama-3.x models write before a call to a built-in tool (and some before any call): read past it."""


def _join_user(segments: list[Segment]) -> list[Segment]:
    """An ``in_user`` tool block continued by the user turn right after it (the template writes the tools at the
    start of the first user message), or closed where the prompt goes on otherwise or ends there."""
    block = [i for i, s in enumerate(segments) if s.role == "user" and s.kind is not SegmentKind.TURN
             and (s.id == TOOLS_ID or s.id.startswith("tool-") or s.id == "tools-end")]
    if not block:
        return segments
    last = block[-1]
    after = segments[last + 1] if last + 1 < len(segments) else None
    if after is not None and after.role == "user" and after.kind is SegmentKind.TURN:
        segments[last] = replace(segments[last], closes=False)
        segments[last + 1] = replace(after, opens=False)
    else:
        segments[last] = replace(segments[last], closes=True)
    return segments


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _call_of(data: Any, tools: ToolSet | None, format_name: str, shown: str) -> ToolCall:
    arguments = data.get("arguments", data.get("parameters", {})) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(arguments, dict):
        raise ToolCallError(f"a tool call in the {format_name} format needs a name and an arguments object: "
                            f"{shown[:200]!r}")
    if tools is not None and data["name"] not in tools:
        raise ToolCallError(f"the model called {data['name']!r}, which is not bound (bound: "
                            f"{', '.join(tools.names) or 'none'})")
    return ToolCall(data["name"], arguments)


HERMES = ToolFormat(
    "kvagent (Hermes-style)", header=INSTRUCTIONS, tool_open="", tool_close="", footer="",
    call_open="<tool_call>", call_close="</tool_call>", call_separator="\n",
    result_open="<tool_response>\n", result_close="\n</tool_response>", result_attrs=True,
)
"""kvagent's own format, for templates without one."""

OPEN, CLOSE, SEPARATOR = HERMES.call_open, HERMES.call_close, HERMES.call_separator


def format_of(renderer: Any) -> ToolFormat:
    """The tool format a renderer writes (its chat template's, read by ``kvagent.tools.template``), else :data:`HERMES`."""
    found = getattr(renderer, "tools", None)
    return found if isinstance(found, ToolFormat) else HERMES


def attach(renderer: Any, segments: Sequence[Segment]) -> list[Segment]:
    """``segments`` with a tool block that continues the system message joined to it (:meth:`ToolFormat.attach`:
    idempotent; every prompt a session takes passes here)."""
    return format_of(renderer).attach(segments)


# kvagent's own format as functions (a model's format: ``format_of(engine.renderer(True))``'s methods)
tool_segments, render_calls, parse_calls, result_segment = (HERMES.segments, HERMES.render_calls, HERMES.parse_calls,
                                                            HERMES.result_segment)


__all__ = ["CLOSE", "HERMES", "INSTRUCTIONS", "OPEN", "SEPARATOR", "ToolCall", "ToolFormat", "attach", "call_schema",
           "describe", "dumps", "format_of", "openai_tool", "parse_calls", "render_calls", "result_segment", "tool_segments"]
