"""Tool calling and structured output for ``/v1/chat/completions``, in OpenAI's shapes over kvagent's tools.

What a request asks (``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format``) is checked before
any session changes, each refusal a 422 naming the field and the fix (:func:`turn_tools`). The tools become a
``kvagent.tools.ToolSet`` and the segments that describe them (``Engine.tool_segments``: one SKILL segment per
tool, compiled once per model on the engine's worker, then transplanted). A client resends its tools with every
request, so :class:`ToolCache` keeps both by the tools' JSON: a tool set seen before costs a dictionary lookup.

Messages carry calls both ways: an assistant message's ``tool_calls`` and a ``tool`` message's ``tool_call_id``
become kvagent's :class:`~kvagent.messages.ChatMessage` (:func:`chat_messages`); a turn's calls become
``message.tool_calls`` (:func:`reply_message`) or, streamed, ``delta.tool_calls`` (:class:`StreamedCalls`, over
``kvagent.tools.stream.CallSplitter``).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvagent.errors import ContextOverflowError, ToolChoiceError, ToolSpecError
from kvagent.generation import Generation
from kvagent.messages import ChatMessage
from kvagent.segments import Segment
from kvagent.tools import ToolCall, ToolSet
from kvagent.tools.stream import CallDelta, CallSplitter

from kvagent_server.errors import InvalidRequest
from kvagent_server.schemas import ChatRequest, MessageIn, ResponseFormat

if TYPE_CHECKING:
    from kvagent.engine import Engine

MAX_TOOLS = 128
"""OpenAI's limit on the tools of one request."""
CHOICES = ("auto", "none", "required")
JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class TurnTools:
    """What a request asks of its turn: ``tools`` bound (None: none), the ``segments`` that describe them to the
    model (placed after the server's own segments), and the decoder's options (``tools``, ``tool_choice``,
    ``parallel_tool_calls``, ``response_schema``) as ``Session.decoder`` takes them."""

    tools: ToolSet | None = None
    segments: tuple[Segment, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def calls(self) -> bool:
        """The turn may call a tool (its text is read for calls, its stream split into call deltas)."""
        return self.options.get("tools") is not None and self.options.get("tool_choice") != "none"


NO_TOOLS = TurnTools()


class ToolCache:
    """Tool sets and their segments by the tools' JSON, least recently used dropped beyond ``limit``; one cache per
    tenant (``scope``, ``library``: its renderer and skill library), so a hit says nothing of another tenant's tools.

    A miss checks the tools (``ToolSet``: names, duplicates, schemas the grammar can express) and compiles their
    segments as skills on the engine's worker, in a thread so the event loop keeps serving; concurrent requests
    with the same new tools share that one build. A refused tool set is not kept (each request gets the error)."""

    def __init__(self, engine: Engine, limit: int = 64, *, scope: str = "", library: Any = None) -> None:
        self.engine, self.limit, self.scope, self.library = engine, limit, scope, library
        self._done: OrderedDict[str, tuple[ToolSet, tuple[Segment, ...]]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[tuple[ToolSet, tuple[Segment, ...]]]] = {}
        self.hits = self.misses = 0

    async def get(self, tools: list[dict[str, Any]]) -> tuple[ToolSet, tuple[Segment, ...]]:
        key = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
        found = self._done.get(key)
        if found is not None:
            self._done.move_to_end(key)
            self.hits += 1
            return found
        task = self._pending.get(key)
        if task is None:
            self.misses += 1
            task = asyncio.ensure_future(asyncio.to_thread(self._build, tools))
            self._pending[key] = task
            task.add_done_callback(lambda _: self._pending.pop(key, None))
        result = await asyncio.shield(task)  # a client that leaves does not cancel a build others wait for
        self._done[key] = result
        while len(self._done) > self.limit:
            self._done.popitem(last=False)
        return result

    def _build(self, tools: list[dict[str, Any]]) -> tuple[ToolSet, tuple[Segment, ...]]:
        toolset = ToolSet(tools)  # ToolSpecError / ToolSchemaError name the tool
        from kvagent.tools.format import tool_segments

        renderer = self.engine.renderer(True, self.scope)
        n = sum(len(renderer.segment_tokens(s)) for s in tool_segments(toolset))
        if n >= self.engine.backend.n_ctx:  # checked before anything is compiled
            raise ContextOverflowError(f"tools: their descriptions are {n} tokens, the context "
                                       f"{self.engine.backend.n_ctx}: send fewer or shorter tools")
        return toolset, tuple(self.engine.tool_segments(toolset, library=self.library, scope=self.scope))


# -- the request ----------------------------------------------------------------------------------
def check_tools(raw: list[Any]) -> list[dict[str, Any]]:
    """The request's tools as OpenAI function dicts; anything else is refused, naming the entry."""
    if len(raw) > MAX_TOOLS:
        raise InvalidRequest(f"tools: at most {MAX_TOOLS} tools per request, got {len(raw)}", param="tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools.{i}: a tool is an object "
                                 '{"type": "function", "function": {"name": ..., "parameters": {...}}}',
                                 param=f"tools.{i}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise InvalidRequest(f"tools.{i}: tools of type {kind!r} are not supported: kvagent serve calls "
                                 'function tools only ({"type": "function", "function": {...}})',
                                 param=f"tools.{i}.type", code="unsupported_tool_type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"tools.{i}.function: a function tool needs a function object with a name "
                                 "(and description, parameters)", param=f"tools.{i}.function")
    return raw


def check_choice(choice: Any, tools: ToolSet | None) -> None:
    """``tool_choice`` is one of OpenAI's: auto, none, required, or a bound function by name."""
    if choice is None or choice in ("auto", "none"):
        return
    if isinstance(choice, str) and choice not in CHOICES:
        raise InvalidRequest(f"tool_choice {choice!r}: use auto, none, required or "
                             '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise InvalidRequest(f"tool_choice of type {choice.get('type')!r} is not supported: use auto, none, required "
                             'or {"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not isinstance(choice, (str, dict)):
        raise InvalidRequest("tool_choice: use auto, none, required or "
                             '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if tools is None:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools: send the tools, or drop tool_choice",
                             param="tool_choice")
    try:
        from kvagent.tools.choice import ToolChoice

        ToolChoice.of(choice, tools)
    except ToolChoiceError as exc:
        raise InvalidRequest(f"tool_choice: {exc}", param="tool_choice", code="ToolChoiceError") from None


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema the reply follows (None: free text), checked against what the grammar can express."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return dict(JSON_OBJECT)
    if fmt.json_schema is None:
        raise InvalidRequest('response_format.json_schema: a json_schema format needs {"name": ..., "schema": {...}}',
                             param="response_format.json_schema")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else dict(JSON_OBJECT)
    from kvagent.tools.grammar import check_schema  # llguidance loads only where it is needed

    try:
        check_schema(f"response_format {fmt.json_schema.name!r}", schema)
    except ToolSpecError as exc:
        raise InvalidRequest(str(exc), param="response_format.json_schema.schema", code=type(exc).__name__) from None
    return schema


async def turn_tools(cache: ToolCache, body: ChatRequest) -> TurnTools:
    """The request's tools, choice and reply schema, checked (422 naming the field) and resolved: the tool set and
    its segments come from ``cache`` (compiled on first sight). Runs before the request takes its session."""
    schema = response_schema(body.response_format)
    toolset: ToolSet | None = None
    segments: tuple[Segment, ...] = ()
    if body.tools:
        try:
            toolset, segments = await cache.get(check_tools(body.tools))
        except ToolSpecError as exc:
            raise InvalidRequest(f"tools: {exc}", param="tools", code=type(exc).__name__) from None
    check_choice(body.tool_choice, toolset)
    if toolset is None:
        return TurnTools(options={"response_schema": schema} if schema is not None else {})
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    options: dict[str, Any] = {"tools": toolset, "tool_choice": choice,
                               "parallel_tool_calls": body.parallel_tool_calls}
    if schema is not None and choice != "required" and not isinstance(choice, dict):
        options["response_schema"] = schema  # a turn that must call has no reply to hold to the schema
    return TurnTools(toolset, segments, options)


def chat_messages(messages: Sequence[MessageIn]) -> list[ChatMessage]:
    """The request's messages as kvagent's: an assistant message's tool calls (arguments parsed from their JSON), a
    tool message named after the call it answers (``tool_call_id``; without one, its ``name``)."""
    out: list[ChatMessage] = []
    called: dict[str, str] = {}  # call id -> tool name, from the assistant messages so far
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls and role != "assistant":
            raise InvalidRequest(f"messages.{i}.tool_calls: only assistant messages make tool calls",
                                 param=f"messages.{i}.tool_calls")
        text = m.text()
        if role == "assistant" and m.tool_calls:
            calls = tuple(_call(i, j, c.id, c.function.name, c.function.arguments) for j, c in enumerate(m.tool_calls))
            called.update({c.id: c.name for c in calls})
            out.append(ChatMessage("assistant", text or "", m.name, tool_calls=calls))
            continue
        if text is None:
            raise InvalidRequest(f"messages.{i}.content: a message needs text content (an assistant message may "
                                 "carry tool_calls instead)", param=f"messages.{i}.content")
        if role == "tool":
            name = m.name or "tool"
            if m.tool_call_id is not None:
                if m.tool_call_id not in called:
                    raise InvalidRequest(f"messages.{i}.tool_call_id {m.tool_call_id!r} answers no tool call of an "
                                         "earlier assistant message: send that message (with its tool_calls) before "
                                         "the result", param=f"messages.{i}.tool_call_id")
                name = called[m.tool_call_id]
            out.append(ChatMessage("tool", text, name, tool_call_id=m.tool_call_id))
        else:
            out.append(ChatMessage(role, text, m.name))  # type: ignore[arg-type]
    return out


def _call(i: int, j: int, call_id: str, name: str, arguments: str) -> ToolCall:
    where = f"messages.{i}.tool_calls.{j}.function.arguments"
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        raise InvalidRequest(f"{where}: not JSON ({exc}); send the arguments object as a JSON string",
                             param=where) from None
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where}: the arguments must be a JSON object, got {type(args).__name__}", param=where)
    return ToolCall(name, args, call_id)


# -- the reply ------------------------------------------------------------------------------------
def openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}


def reply_message(gen: Generation) -> dict[str, Any]:
    """The turn as ``choices[0].message``: its calls (``content`` null), else its text."""
    if gen.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": [openai_call(c) for c in gen.tool_calls]}
    return {"role": "assistant", "content": gen.text}


class StreamedCalls:
    """A streamed turn's pieces as chat-completion deltas: text as ``content``, calls as ``tool_calls`` items
    (``index``; the first piece of a call with ``id``, ``type`` and ``function.name``; then argument pieces)."""

    def __init__(self) -> None:
        self.splitter = CallSplitter()

    @property
    def ids(self) -> list[str]:
        """The ids given to the calls so far, in order."""
        return self.splitter.ids

    def feed(self, piece: str) -> list[dict[str, Any]]:
        return self._deltas(*self.splitter.feed(piece))

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(*self.splitter.finish())

    @staticmethod
    def _deltas(text: str, calls: list[CallDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"content": text}] if text else []
        items: dict[int, dict[str, Any]] = {}  # one item per call and chunk: a head and its first piece merge
        for d in calls:
            item = items.setdefault(d.index, {"index": d.index, "function": {"arguments": ""}})
            if d.id is not None:
                item.update(id=d.id, type="function")
                item["function"]["name"] = d.name
            item["function"]["arguments"] += d.arguments
        if items:
            out.append({"tool_calls": list(items.values())})
        return out


__all__ = ["NO_TOOLS", "StreamedCalls", "ToolCache", "TurnTools", "chat_messages", "check_choice", "check_tools",
           "openai_call", "reply_message", "response_schema", "turn_tools"]
