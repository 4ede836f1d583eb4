"""Tool calling and structured output for ``/v1/chat/completions``, in OpenAI's shapes over kvagent's tools.

What a request asks (``tools``, ``tool_choice``, ``parallel_tool_calls``, ``response_format``) is checked before
any session changes, each refusal a 422 naming the field and the fix (:func:`turn_tools`). The tools become a
``kvagent.tools.ToolSet`` and the segments that describe them (``Engine.tool_segments``: one SKILL segment per
tool, compiled once per model on the engine's worker, then transplanted). A client resends its tools with every
request, so :class:`ToolCache` (``kvagent.tools.sets.ToolSets``, awaited) keeps both by the tools' JSON: a tool
set seen before costs a dictionary lookup.

Messages, replies and streamed call deltas are in OpenAI's shape in the core (``kvagent.openai_shape``); here its
refusals become 422s naming the field.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvagent import openai_shape as shape
from kvagent.errors import ToolChoiceError, ToolSpecError
from kvagent.messages import ChatMessage
from kvagent.tools.sets import ToolSets
from kvagent.segments import Segment
from kvagent.tools import ToolSet
from kvagent.tools.choice import ToolChoice, spent_tools

from kvagent_server.errors import InvalidRequest
from kvagent_server.front import ChatRequest
from kvagent_server.schemas import MessageIn, ResponseFormat

if TYPE_CHECKING:
    from kvagent.engine import Engine

MAX_TOOLS = 128
"""OpenAI's limit on the tools of one request."""
CHOICES = ("auto", "none", "required")


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


class ToolCache(ToolSets):
    """:class:`~kvagent.tools.sets.ToolSets` for the event loop: a miss is built in a thread, so the loop keeps
    serving, and concurrent requests with the same new tools share that one build."""

    def __init__(self, engine: Engine, limit: int = 64, *, scope: str = "", library: Any = None) -> None:
        super().__init__(engine, limit, scope=scope, library=library)
        self._pending: dict[str, asyncio.Future[tuple[ToolSet, tuple[Segment, ...]]]] = {}

    async def aget(self, tools: list[dict[str, Any]]) -> tuple[ToolSet, tuple[Segment, ...]]:
        key = self.key(tools)
        found = self.lookup(key)
        if found is not None:
            return found
        task = self._pending.get(key)
        if task is None:
            self.misses += 1
            task = asyncio.ensure_future(asyncio.to_thread(self.build, tools))
            self._pending[key] = task
            task.add_done_callback(lambda _: self._pending.pop(key, None))
        # a client that leaves does not cancel a build others wait for
        return self.put(key, await asyncio.shield(task))


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
        ToolChoice.of(choice, tools)
    except ToolChoiceError as exc:
        raise InvalidRequest(f"tool_choice: {exc}", param="tool_choice", code="ToolChoiceError") from None


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema the reply follows (None: free text), checked against what the grammar can express."""
    try:
        return shape.response_schema(fmt.model_dump(by_alias=True) if fmt is not None else None)
    except shape.MessageError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None
    except ToolSpecError as exc:
        raise InvalidRequest(str(exc), param="response_format.json_schema.schema", code=type(exc).__name__) from None


async def turn_tools(cache: ToolCache, body: ChatRequest, once: Sequence[ChatMessage] | None = None) -> TurnTools:
    """The request's tools, choice and reply schema, checked (422 naming the field) and resolved: the tool set and
    its segments come from ``cache`` (compiled on first sight). ``once``: the request's messages, where ``auto`` is
    decoded so that no tool called since the last user message is called again (the server's ``auto_tools``).
    Runs before the request takes its session."""
    schema = response_schema(body.response_format)
    toolset: ToolSet | None = None
    segments: tuple[Segment, ...] = ()
    if body.tools:
        try:
            toolset, segments = await cache.aget(check_tools(body.tools))
        except ToolSpecError as exc:
            raise InvalidRequest(f"tools: {exc}", param="tools", code=type(exc).__name__) from None
    check_choice(body.tool_choice, toolset)
    if toolset is None:
        return TurnTools(options={"response_schema": schema} if schema is not None else {})
    choice: Any = body.tool_choice if body.tool_choice is not None else "auto"
    if choice == "auto" and once is not None:
        choice = ToolChoice("auto", spent=spent_tools(once, toolset))
    options: dict[str, Any] = {"tools": toolset, "tool_choice": choice,
                               "parallel_tool_calls": body.parallel_tool_calls}
    if schema is not None and choice != "required" and not isinstance(choice, dict):
        options["response_schema"] = schema  # a turn that must call has no reply to hold to the schema
    return TurnTools(toolset, segments, options)


def chat_messages(messages: Sequence[MessageIn]) -> list[ChatMessage]:
    """The request's messages as kvagent's (``kvagent.openai_shape.chat_messages``; a result must answer a call of an
    earlier assistant message)."""
    try:
        return shape.chat_messages([m.model_dump() for m in messages])
    except shape.MessageError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None


__all__ = ["NO_TOOLS", "ToolCache", "TurnTools", "chat_messages", "check_choice", "check_tools", "response_schema",
           "turn_tools"]
