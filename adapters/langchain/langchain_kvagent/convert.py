"""LangChain messages to kvagent's chat messages and back, and usage as LangChain reports it."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage,
                                     UsageMetadata)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from kvagent.errors import KVAgentError
from kvagent.generation import Generation
from kvagent.messages import ChatMessage
from kvagent.tools import ToolCall, ToolSet
from kvagent.tools.format import OPEN
from kvagent.tools.choice import each_tool_once
from kvagent.tools.stream import CallDelta, CallSplitter

from langchain_kvagent.registry import SessionEntry, Turn

DEFAULT_SESSION = "default"

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool", "function": "tool"}
_CHAT_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "ai": "assistant",
               "tool": "tool"}
_MEDIA = {"image", "image_url", "audio", "input_audio", "video", "file", "document"}


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[ChatMessage]:
    """LangChain messages as kvagent chat messages (text only; a media block is refused by name). An AI message's
    tool calls and a tool message's call id come along; a tool message without a name takes the name of the call
    it answers."""
    out: list[ChatMessage] = []
    called: dict[str, str] = {}  # call id -> tool name
    for index, message in enumerate(messages):
        if message.type == "chat":
            role = _CHAT_ROLES.get(str(getattr(message, "role", "")))
        else:
            role = _ROLES.get(message.type)
        if role is None:
            raise KVAgentError(f"message {index} is a {type(message).__name__} ({message.type!r}): ChatKVAgent takes "
                               "system, human, AI and tool messages")
        text = _text(message, index)
        if role == "assistant":
            calls = tuple(ToolCall(c["name"], c.get("args") or {}, c.get("id") or f"call_{index}_{i}")
                          for i, c in enumerate(getattr(message, "tool_calls", None) or []))
            called.update({c.id: c.name for c in calls})
            out.append(ChatMessage("assistant", text, tool_calls=calls))
        elif role == "tool":
            call_id = getattr(message, "tool_call_id", None)
            name = message.name or called.get(str(call_id)) or "tool"
            out.append(ChatMessage("tool", text, name, tool_call_id=call_id))
        else:
            out.append(ChatMessage(role, text))  # type: ignore[arg-type]
    return out


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


def _text(message: BaseMessage, index: int) -> str:
    if isinstance(message.content, str):
        return message.content
    parts: list[str] = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif block.get("type") in _MEDIA:
            raise KVAgentError(f"message {index} has a {block.get('type')!r} block: ChatKVAgent reads text only "
                               "(a 135M-270M text model); send the text, or describe the media in words")
    return "".join(parts)


def usage_metadata(turn: Turn) -> UsageMetadata:
    """``input_tokens``: the whole prompt; ``cache_read``: its tokens that were not computed (reused from the
    cache, or transplanted from a compiled skill)."""
    return UsageMetadata(input_tokens=turn.input_tokens, output_tokens=turn.output_tokens,
                         total_tokens=turn.input_tokens + turn.output_tokens,
                         input_token_details={"cache_read": turn.cache_read})


SAMPLING = ("temperature", "top_p", "top_k", "seed", "max_tokens")


TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "ls_structured_output_format")


@dataclass(frozen=True)
class Call:
    """One call's session key, messages and generation options; ``tools`` bound to it (None: none), which the
    prompt describes and the grammar holds its calls to (``options`` carries the choice and a reply schema)."""

    key: str
    messages: list[ChatMessage]
    max_tokens: int
    options: dict[str, Any]
    tools: ToolSet | None = None


@functools.lru_cache(maxsize=64)
def _toolset(tools_json: str) -> ToolSet:
    """Tools bound by ``bind_tools`` (OpenAI dicts), checked once per distinct set."""
    return ToolSet(json.loads(tools_json))


def response_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema a reply follows: OpenAI's ``response_format`` (``json_object``, ``json_schema``), a JSON
    schema, or a pydantic model class."""
    if response_format is None:
        return None
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return dict(response_format.model_json_schema())
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            inner = response_format.get("json_schema") or {}
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise KVAgentError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
            return dict(schema)
        if kind == "text":
            return None
        return dict(response_format)  # a JSON schema itself
    raise KVAgentError(f"response_format {response_format!r}: give json_object, json_schema, a JSON schema or a "
                       "pydantic model class")


def parse_call(model: Any, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> Call:
    """A ``ChatKVAgent`` call's options (the chat model's ``model``'s defaults where the call gives none); unknown
    options and another model are refused by name."""
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
    tools = _toolset(json.dumps(kwargs["tools"], sort_keys=True)) if kwargs.get("tools") else None
    if tools is not None:
        choice, callable_ = kwargs.get("tool_choice") or "auto", tools
        if choice == "auto" and getattr(model, "auto_tools", "free") == "each_once":
            choice, callable_ = each_tool_once(chat, tools)
        options.update(tools=callable_, tool_choice=choice, parallel_tool_calls=kwargs.get("parallel_tool_calls"))
    schema = response_schema(kwargs.get("response_format"))
    if schema is not None:
        options["response_schema"] = schema
    return Call(key, chat, int(kwargs.get("max_tokens", model.max_tokens)), options, tools)


def metadata(model_name: str, gen: Generation, turn: Turn, key: str) -> dict[str, Any]:
    return {"model_name": model_name, "finish_reason": gen.finish_reason, "session_id": key,
            "reused": turn.reused, "computed": turn.computed, "transplanted": turn.transplanted,
            "ttft_s": round(turn.ttft_s, 6), "edits": [e.as_dict() for e in gen.edits]}


def chat_result(model_name: str, gen: Generation, turn: Turn, key: str) -> ChatResult:
    """A generation as LangChain's result: the reply, its usage (``cache_read``: tokens not computed) and metadata."""
    cut = _cut_calls(gen)
    message = AIMessage(content="" if gen.tool_calls or cut else gen.text, usage_metadata=usage_metadata(turn),
                        response_metadata=metadata(model_name, gen, turn, key),
                        tool_calls=[lc_tool_call(c) for c in gen.tool_calls], invalid_tool_calls=cut)
    info = {"finish_reason": gen.finish_reason}
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])


def _cut_calls(gen: Generation) -> list[dict[str, Any]]:
    """A call the turn began and ``max_tokens`` cut short, as LangChain's invalid tool call (its partial
    arguments and why): never as text."""
    if gen.finish_reason != "length" or not gen.text.lstrip().startswith(OPEN):
        return []
    splitter = CallSplitter()
    deltas = [*splitter.feed(gen.text)[1], *splitter.finish()[1]]
    calls = {d.index: {"name": d.name, "args": "", "id": d.id} for d in deltas if d.name is not None}
    for d in deltas:
        calls[d.index]["args"] += d.arguments
    done = len(gen.tool_calls)
    return [{**c, "error": "cut short by max_tokens: raise max_tokens", "type": "invalid_tool_call"}
            for i, c in sorted(calls.items()) if i >= done] or [
        {"name": None, "args": gen.text, "id": None, "error": "cut short by max_tokens: raise max_tokens",
         "type": "invalid_tool_call"}]


def last_chunk(model_name: str, call: Call, result: Generation | None, entry: SessionEntry) -> ChatGenerationChunk:
    """The stream's last chunk: no text, the usage and metadata (once); the turn is committed to ``entry``."""
    if result is None:  # pragma: no cover - a stream that ended without error always has its result
        raise KVAgentError("the stream ended without a result (internal error)")
    turn = entry.commit(call.messages, result)
    message = AIMessageChunk(content="", usage_metadata=usage_metadata(turn),
                             response_metadata=metadata(model_name, result, turn, call.key), chunk_position="last")
    return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})


class Chunks:
    """A streamed turn's pieces as LangChain chunks: text as content, tool calls (with ``tools`` bound) as
    ``tool_call_chunks`` (index, id, name, argument pieces; ``kvagent.tools.stream.CallSplitter``)."""

    def __init__(self, tools: bool) -> None:
        self._splitter = CallSplitter() if tools else None

    def feed(self, piece: str) -> Iterator[ChatGenerationChunk]:
        if self._splitter is None:
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
            return
        yield from self._chunks(*self._splitter.feed(piece))

    def finish(self) -> Iterator[ChatGenerationChunk]:
        if self._splitter is not None:
            yield from self._chunks(*self._splitter.finish())

    @staticmethod
    def _chunks(text: str, deltas: list[CallDelta]) -> Iterator[ChatGenerationChunk]:
        if text:
            yield ChatGenerationChunk(message=AIMessageChunk(content=text))
        for d in deltas:
            chunk = {"name": d.name, "args": d.arguments, "id": d.id, "index": d.index, "type": "tool_call_chunk"}
            yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[chunk]))


__all__ = ["Call", "Chunks", "chat_result", "last_chunk", "parse_call", "to_chat_messages", "to_langchain", "usage_metadata"]
