"""LangChain messages to kvagent's chat messages and back, and usage as LangChain reports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage,
                                     UsageMetadata, convert_to_openai_messages)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from kvagent import openai_shape as shape
from kvagent.conversation import Cost
from kvagent.errors import KVAgentError
from kvagent.generation import Generation
from kvagent.messages import ChatMessage
from kvagent.tools.format import HERMES, ToolFormat
from kvagent.tools.sets import ToolSets
from kvagent.segments import Segment
from kvagent.tools import ToolCall, ToolSet
from kvagent.tools.choice import ToolChoice, each_tool_once, spent_tools

DEFAULT_SESSION = "default"
_TYPES = {"system", "human", "ai", "tool", "function", "chat"}


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[ChatMessage]:
    """LangChain messages as kvagent chat messages, through OpenAI's shape (``kvagent.openai_shape``): text only (a
    media block is refused by name); an AI message's tool calls and a tool message's call id come along, and a tool
    message takes the name of the call it answers."""
    for index, message in enumerate(messages):
        if message.type not in _TYPES:
            raise KVAgentError(f"message {index} is a {type(message).__name__} ({message.type!r}): ChatKVAgent takes "
                               "system, human, AI and tool messages")
    return shape.chat_messages(convert_to_openai_messages(list(messages)), strict_ids=False)


def to_langchain(message: ChatMessage) -> BaseMessage:
    """A kvagent chat message as the LangChain message it came from."""
    if message.role == "system":
        return SystemMessage(message.content)
    if message.role == "user":
        return HumanMessage(message.content)
    if message.role == "assistant":
        return AIMessage(message.content, tool_calls=[lc_tool_call(c) for c in message.tool_calls])
    name = message.name or "tool"
    return ToolMessage(message.content, tool_call_id=message.tool_call_id or name, name=name)


def lc_tool_call(call: ToolCall) -> dict[str, Any]:
    """A kvagent call as LangChain's ``ToolCall`` dict."""
    return {"name": call.name, "args": dict(call.arguments), "id": call.id, "type": "tool_call"}


def usage_metadata(cost: Cost) -> UsageMetadata:
    """``input_tokens``: the whole prompt; ``cache_read``: its tokens that were not computed (reused from the
    cache, moved by an implicit edit, or transplanted from a compiled skill)."""
    return UsageMetadata(input_tokens=cost.input_tokens, output_tokens=cost.output_tokens,
                         total_tokens=cost.input_tokens + cost.output_tokens,
                         input_token_details={"cache_read": cost.cache_read})


SAMPLING = ("temperature", "top_p", "top_k", "seed", "max_tokens")


TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "ls_structured_output_format",
                "tool_universe")


@dataclass(frozen=True)
class Call:
    """One call's session key, messages and generation options; ``tools`` bound to it (None: none) and the
    ``segments`` that describe them, which the prompt holds and the grammar holds its calls to (``options``
    carries the choice and a reply schema)."""

    key: str
    messages: list[ChatMessage]
    max_tokens: int
    options: dict[str, Any]
    tools: ToolSet | None = None
    segments: tuple[Segment, ...] = ()


def response_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema a reply follows: OpenAI's ``response_format`` (``kvagent.openai_shape.response_schema``),
    a JSON schema, or a pydantic model class."""
    if response_format is None:
        return None
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return dict(response_format.model_json_schema())
    if isinstance(response_format, dict):
        if response_format.get("type") in ("text", "json_object", "json_schema"):
            return shape.response_schema(response_format)
        return dict(response_format)  # a JSON schema itself
    raise KVAgentError(f"response_format {response_format!r}: give json_object, json_schema, a JSON schema or a "
                       "pydantic model class")


def parse_call(model: Any, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any],
               toolsets: ToolSets) -> Call:
    """A ``ChatKVAgent`` call's options (the chat model's ``model``'s defaults where the call gives none); unknown
    options and another model are refused by name. Bound tools are checked and compiled once per distinct set
    (``toolsets``: the engine's, by content)."""
    kwargs = dict(kwargs)
    key = str(kwargs.pop("session_id", None) or DEFAULT_SESSION)
    kwargs.pop("stream", None)
    name = kwargs.pop("model", None)
    if name is not None and name != model.model:
        raise KVAgentError(f"ChatKVAgent does not switch models per call (got model={name!r}, this one runs "
                           f"{model.model!r}): construct another ChatKVAgent(model={name!r})")
    unknown = sorted(set(kwargs) - set(SAMPLING) - set(TOOL_OPTIONS))
    if unknown:
        raise KVAgentError(f"unknown call options {', '.join(unknown)}: ChatKVAgent takes session_id, stop, "
                           f"{', '.join(SAMPLING + TOOL_OPTIONS[:4])}")
    options = {k: kwargs.get(k, getattr(model, k)) for k in ("temperature", "top_p", "top_k", "seed")}
    options["stop"] = list(stop if stop is not None else model.stop or [])
    chat = to_chat_messages(messages)
    tools, segments = shown_tools(kwargs.get("tools"), kwargs.get("tool_universe"), toolsets)
    if tools is not None:
        choice, callable_ = kwargs.get("tool_choice") or "auto", tools
        policy = getattr(model, "auto_tools", "free")
        if choice == "auto" and policy == "each_once":
            choice, callable_ = each_tool_once(chat, tools)
        elif choice == "auto" and policy == "once":
            choice = ToolChoice("auto", spent=spent_tools(chat, tools))
        options.update(tools=callable_, tool_choice=choice, parallel_tool_calls=kwargs.get("parallel_tool_calls"))
    schema = response_schema(kwargs.get("response_format"))
    if schema is not None:
        options["response_schema"] = schema
    return Call(key, chat, int(kwargs.get("max_tokens", model.max_tokens)), options, tools, segments)


def shown_tools(bound: Sequence[dict[str, Any]] | None, universe: Sequence[dict[str, Any]] | None,
                toolsets: ToolSets) -> tuple[ToolSet | None, tuple[Segment, ...]]:
    """The tools a call may call (None: none) and the segments that describe tools to the model. Without a
    ``universe`` those are the bound tools'; with one (OpenAI tool dicts, e.g. every tool of an agent whose
    middleware binds a different subset each call) the prompt describes the universe (and any bound tool it lacks),
    so a changed subset leaves the prompt as it was, and the grammar holds calls to the bound ones."""
    if not universe:
        return toolsets.get(bound) if bound else (None, ())
    names = {t["function"]["name"] for t in universe}
    extra = [t for t in bound or () if t["function"]["name"] not in names]
    _, segments = toolsets.get([*universe, *extra])
    return (ToolSet([dict(t) for t in bound]) if bound else None), segments


def metadata(model_name: str, gen: Generation, cost: Cost, key: str) -> dict[str, Any]:
    return {"model_name": model_name, "finish_reason": gen.finish_reason, "session_id": key,
            "reused": cost.reused, "computed": cost.computed, "transplanted": cost.transplanted,
            "ttft_s": round(cost.ttft_s, 6), "edits": [e.as_dict() for e in gen.edits]}


def chat_result(model_name: str, gen: Generation, cost: Cost, key: str, tool_format: ToolFormat = HERMES) -> ChatResult:
    """A generation as LangChain's result: the reply, its usage (``cache_read``: tokens not computed) and metadata.
    A call ``max_tokens`` cut short is an invalid tool call (its partial arguments and why), never text."""
    cut = [{"name": c["name"], "args": c["arguments"], "id": c["id"], "error": c["error"], "type": "invalid_tool_call"}
           for c in shape.cut_calls(gen, tool_format)]
    message = AIMessage(content="" if gen.tool_calls or cut else gen.text, usage_metadata=usage_metadata(cost),
                        response_metadata=metadata(model_name, gen, cost, key),
                        tool_calls=[lc_tool_call(c) for c in gen.tool_calls], invalid_tool_calls=cut)
    info = {"finish_reason": gen.finish_reason}
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])


def last_chunk(model_name: str, call: Call, gen: Generation, cost: Cost) -> ChatGenerationChunk:
    """The stream's last chunk: no text, the usage and metadata (once)."""
    message = AIMessageChunk(content="", usage_metadata=usage_metadata(cost),
                             response_metadata=metadata(model_name, gen, cost, call.key), chunk_position="last")
    return ChatGenerationChunk(message=message, generation_info={"finish_reason": gen.finish_reason})


class Chunks:
    """A streamed turn's pieces as LangChain chunks: text as content, tool calls (with ``tools`` bound) as
    ``tool_call_chunks`` (index, id, name, argument pieces), read from OpenAI's deltas
    (``kvagent.openai_shape.StreamedCalls``)."""

    def __init__(self, tools: bool, tool_format: ToolFormat = HERMES) -> None:
        self._calls = shape.StreamedCalls(tool_format) if tools else None

    def feed(self, piece: str) -> Iterator[ChatGenerationChunk]:
        if self._calls is None:
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
            return
        yield from self._chunks(self._calls.feed(piece))

    def finish(self, gen: Generation | None = None) -> Iterator[ChatGenerationChunk]:
        """The chunks left at the end of the turn (``gen``: the turn, whose calls a held bare-JSON reply becomes)."""
        if self._calls is not None:
            yield from self._chunks(self._calls.finish(gen.tool_calls if gen is not None else ()))

    @staticmethod
    def _chunks(deltas: list[dict[str, Any]]) -> Iterator[ChatGenerationChunk]:
        for delta in deltas:
            if delta.get("content"):
                yield ChatGenerationChunk(message=AIMessageChunk(content=delta["content"]))
            for item in delta.get("tool_calls", ()):
                chunk = {"name": item["function"].get("name"), "args": item["function"]["arguments"],
                         "id": item.get("id"), "index": item["index"], "type": "tool_call_chunk"}
                yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[chunk]))


__all__ = ["Call", "Chunks", "chat_result", "last_chunk", "parse_call", "to_chat_messages", "to_langchain", "usage_metadata"]
