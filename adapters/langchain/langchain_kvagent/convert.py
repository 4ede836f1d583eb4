"""LangChain messages to kvagent's chat messages and back, and usage as LangChain reports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage,
                                     UsageMetadata)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from kvagent.errors import KVAgentError
from kvagent.generation import Generation
from kvagent.messages import ChatMessage

from langchain_kvagent.registry import SessionEntry, Turn

DEFAULT_SESSION = "default"

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool", "function": "tool"}
_CHAT_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "ai": "assistant",
               "tool": "tool"}
_MEDIA = {"image", "image_url", "audio", "input_audio", "video", "file", "document"}


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[ChatMessage]:
    """LangChain messages as kvagent chat messages (text only; a media block is refused by name)."""
    out: list[ChatMessage] = []
    for index, message in enumerate(messages):
        if message.type == "chat":
            role = _CHAT_ROLES.get(str(getattr(message, "role", "")))
        else:
            role = _ROLES.get(message.type)
        if role is None:
            raise KVAgentError(f"message {index} is a {type(message).__name__} ({message.type!r}): ChatKVAgent takes "
                               "system, human, AI and tool messages")
        name = (message.name or getattr(message, "tool_call_id", None)) if role == "tool" else None
        out.append(ChatMessage(role, _text(message, index), name))  # type: ignore[arg-type]
    return out


def to_langchain(message: ChatMessage) -> BaseMessage:
    """A kvagent chat message as the LangChain message it came from."""
    if message.role == "system":
        return SystemMessage(message.content)
    if message.role == "user":
        return HumanMessage(message.content)
    if message.role == "assistant":
        return AIMessage(message.content)
    name = message.name or "tool"
    return ToolMessage(message.content, tool_call_id=name, name=name)


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


@dataclass(frozen=True)
class Call:
    """One call's session key, messages and generation options."""

    key: str
    messages: list[ChatMessage]
    max_tokens: int
    options: dict[str, Any]


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
    unknown = sorted(set(kwargs) - set(SAMPLING))
    if unknown:
        raise KVAgentError(f"unknown call options {', '.join(unknown)}: ChatKVAgent takes session_id, stop, "
                           f"{', '.join(SAMPLING)}")
    options = {k: kwargs.get(k, getattr(model, k)) for k in ("temperature", "top_p", "top_k", "seed")}
    options["stop"] = list(stop if stop is not None else model.stop or [])
    return Call(key, to_chat_messages(messages), int(kwargs.get("max_tokens", model.max_tokens)), options)


def metadata(model_name: str, gen: Generation, turn: Turn, key: str) -> dict[str, Any]:
    return {"model_name": model_name, "finish_reason": gen.finish_reason, "session_id": key,
            "reused": turn.reused, "computed": turn.computed, "transplanted": turn.transplanted,
            "ttft_s": round(turn.ttft_s, 6)}


def chat_result(model_name: str, gen: Generation, turn: Turn, key: str) -> ChatResult:
    """A generation as LangChain's result: the reply, its usage (``cache_read``: tokens not computed) and metadata."""
    message = AIMessage(content=gen.text, usage_metadata=usage_metadata(turn),
                        response_metadata=metadata(model_name, gen, turn, key))
    info = {"finish_reason": gen.finish_reason}
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])


def last_chunk(model_name: str, call: Call, result: Generation | None, entry: SessionEntry) -> ChatGenerationChunk:
    """The stream's last chunk: no text, the usage and metadata (once); the turn is committed to ``entry``."""
    if result is None:  # pragma: no cover - a stream that ended without error always has its result
        raise KVAgentError("the stream ended without a result (internal error)")
    turn = entry.commit(call.messages, result)
    message = AIMessageChunk(content="", usage_metadata=usage_metadata(turn),
                             response_metadata=metadata(model_name, result, turn, call.key), chunk_position="last")
    return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})


__all__ = ["Call", "chat_result", "last_chunk", "parse_call", "to_chat_messages", "to_langchain", "usage_metadata"]
