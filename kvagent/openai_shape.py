"""OpenAI's chat shapes, once for every adapter: messages with call ids in, replies, usage, streamed call deltas
and cut-off calls out, reply schemas; and an engine's answer back in (a reply whole or streamed, its usage).

The server reads requests in this shape; ``ChatKVAgent`` converts LangChain's messages to it
(``langchain_core.messages.convert_to_openai_messages``) and reads the same deltas as tool-call chunks. Errors
are :class:`MessageError` with the ``param`` they concern (``messages.3.tool_call_id``), so the server answers a
422 naming it and the chat model raises with the same words.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvagent.errors import KVAgentError
from kvagent.messages import ChatMessage
from kvagent.tools import ToolCall
from kvagent.tools.format import HERMES, ToolFormat
from kvagent.tools.grammar import check_schema
from kvagent.tools.stream import CallDelta, CallSplitter

if TYPE_CHECKING:
    from kvagent.conversation import Cost
    from kvagent.generation import Generation
    from kvagent.kv.sync import ImplicitEdit

ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
         "ai": "assistant", "tool": "tool", "function": "tool"}
MEDIA = {"image", "image_url", "audio", "input_audio", "video", "file", "document"}
JSON_OBJECT: dict[str, Any] = {"type": "object"}
CUT = "cut short by max_tokens: raise max_tokens"


class MessageError(KVAgentError):
    """A message or option in OpenAI's shape that kvagent refuses; ``param`` names where (``messages.2.content``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# -- messages in ------------------------------------------------------------------------------------
def text_of(content: Any, where: str = "content") -> str | None:
    """A message's text: a string, or text parts joined; None when absent. A media part is refused by name
    (``where``: the param it is reported under)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        return str(content)
    parts: list[str] = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, Mapping) and part.get("type") in MEDIA:
            raise MessageError(f"{where} has a {part.get('type')!r} part: kvagent's models read text only; send "
                               "the text, or describe the media in words", param=where)
    return "".join(parts)


def chat_messages(raw: Sequence[Mapping[str, Any]], *, strict_ids: bool = True) -> list[ChatMessage]:
    """OpenAI chat messages as kvagent's: an assistant message's tool calls (arguments parsed from their JSON), a
    tool message named after the call it answers (``tool_call_id``; without one, its ``name``). ``strict_ids``: a
    result whose ``tool_call_id`` answers no earlier call is refused (else it keeps its own name)."""
    out: list[ChatMessage] = []
    called: dict[str, str] = {}  # call id -> tool name, from the assistant messages so far
    for i, m in enumerate(raw):
        role = ROLES.get(str(m.get("role")))
        if role is None:
            raise MessageError(f"messages.{i}.role {m.get('role')!r}: use system, developer, user, assistant or "
                               "tool", param=f"messages.{i}.role")
        raw_calls = m.get("tool_calls") or []
        if raw_calls and role != "assistant":
            raise MessageError(f"messages.{i}.tool_calls: only assistant messages make tool calls",
                               param=f"messages.{i}.tool_calls")
        text = text_of(m.get("content"), f"messages.{i}.content")
        if role == "assistant" and raw_calls:
            calls = tuple(_call(i, j, c) for j, c in enumerate(raw_calls))
            called.update({c.id: c.name for c in calls})
            out.append(ChatMessage("assistant", text or "", m.get("name"), tool_calls=calls))
            continue
        if text is None:
            raise MessageError(f"messages.{i}.content: a message needs text content (an assistant message may "
                               "carry tool_calls instead)", param=f"messages.{i}.content")
        if role == "tool":
            call_id = m.get("tool_call_id")
            name = m.get("name") or "tool"
            if call_id is not None and call_id in called:
                name = called[call_id]
            elif call_id is not None and strict_ids:
                raise MessageError(f"messages.{i}.tool_call_id {call_id!r} answers no tool call of an earlier "
                                   "assistant message: send that message (with its tool_calls) before the result",
                                   param=f"messages.{i}.tool_call_id")
            out.append(ChatMessage("tool", text, name, tool_call_id=call_id))
        else:
            out.append(ChatMessage(role, text, m.get("name")))  # type: ignore[arg-type]
    return out


def _call(i: int, j: int, call: Mapping[str, Any]) -> ToolCall:
    fn = call.get("function") or {}
    where = f"messages.{i}.tool_calls.{j}.function.arguments"
    arguments = fn.get("arguments") or ""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise MessageError(f"{where}: not JSON ({exc}); send the arguments object as a JSON string",
                               param=where) from None
    if not isinstance(arguments, dict):
        raise MessageError(f"{where}: the arguments must be a JSON object, got {type(arguments).__name__}",
                           param=where)
    return ToolCall(str(fn.get("name")), arguments, call.get("id") or f"call_{i}_{j}")


def response_schema(fmt: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema the reply follows (None: free text) for OpenAI's ``response_format`` (``text``,
    ``json_object``, ``json_schema``; its ``schema`` absent: any JSON object), checked against what the grammar
    can express (``ToolSpecError``)."""
    if fmt is None or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return dict(JSON_OBJECT)
    if fmt.get("type") != "json_schema":
        raise MessageError(f"response_format type {fmt.get('type')!r}: use text, json_object or json_schema",
                           param="response_format.type")
    inner = fmt.get("json_schema")
    if not isinstance(inner, Mapping):
        raise MessageError('response_format.json_schema: a json_schema format needs {"name": ..., "schema": {...}}',
                           param="response_format.json_schema")
    schema = inner.get("schema")
    schema = dict(schema) if isinstance(schema, Mapping) else dict(JSON_OBJECT)
    check_schema(f"response_format {inner.get('name')!r}", schema)
    return schema


# -- the reply out ----------------------------------------------------------------------------------
def openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}


def reply_message(gen: Generation) -> dict[str, Any]:
    """The turn as ``choices[0].message``: its calls (``content`` null), else its text."""
    if gen.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": [openai_call(c) for c in gen.tool_calls]}
    return {"role": "assistant", "content": gen.text}


def usage(cost: Cost, edits: Sequence[ImplicitEdit] | None = None) -> dict[str, Any]:
    """OpenAI's usage: ``cached_tokens`` are the prompt tokens whose KV was not computed for this call (reused in
    place, moved by an implicit edit, or transplanted). ``edits`` (asked for): the extension ``kvagent_edits``,
    what the resent prompt's changes became."""
    out: dict[str, Any] = {"prompt_tokens": cost.input_tokens, "completion_tokens": cost.output_tokens,
                           "total_tokens": cost.input_tokens + cost.output_tokens,
                           "prompt_tokens_details": {"cached_tokens": cost.cache_read}}
    if edits is not None:
        out["kvagent_edits"] = [e.as_dict() for e in edits]
    return out


class StreamedCalls:
    """A streamed turn's pieces as chat-completion deltas: text as ``content``, calls as ``tool_calls`` items
    (``index``; the first piece of a call with ``id``, ``type`` and ``function.name``; then argument pieces)."""

    def __init__(self, tool_format: ToolFormat = HERMES) -> None:
        self.splitter = CallSplitter(tool_format)

    @property
    def ids(self) -> list[str]:
        """The ids given to the calls so far, in order."""
        return self.splitter.ids

    def feed(self, piece: str) -> list[dict[str, Any]]:
        return self._deltas(*self.splitter.feed(piece))

    def finish(self, calls: Sequence[ToolCall] = ()) -> list[dict[str, Any]]:
        """The deltas left at the end of the turn; ``calls``: the calls it made (a reply held back as possibly
        bare-JSON calls is streamed as those, else as its text)."""
        return self._deltas(*self.splitter.finish(calls))

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


def cut_calls(gen: Generation, tool_format: ToolFormat = HERMES) -> list[dict[str, Any]]:
    """The calls a turn began that ``max_tokens`` cut short, each as ``{"index", "id", "name", "arguments",
    "error"}`` (its partial arguments); none when the turn was not cut inside a call, or every call it began was
    closed. A cut turn whose call cannot be read at all is one entry with the whole text as arguments."""
    if gen.finish_reason != "length" or not tool_format.starts_call(gen.text):
        return []
    splitter = CallSplitter(tool_format)
    deltas = [*splitter.feed(gen.text)[1], *splitter.finish()[1]]
    begun = {d.index: {"index": d.index, "id": d.id, "name": d.name, "arguments": "", "error": CUT}
             for d in deltas if d.name is not None}
    if not begun:
        return [{"index": 0, "id": None, "name": None, "arguments": gen.text, "error": CUT}]
    for d in deltas:
        begun[d.index]["arguments"] += d.arguments
    return [c for i, c in sorted(begun.items()) if i >= len(gen.tool_calls)]


# -- an engine's reply in ---------------------------------------------------------------------------
class EngineStreamError(KVAgentError):
    """An engine's stream carried an ``error`` event: its reply is not whole."""


@dataclass(frozen=True)
class Used:
    """An engine's ``usage``: prompt and reply tokens (None where it did not say), and the prompt tokens it reused
    from its cache (``prompt_tokens_details.cached_tokens``)."""

    prompt: int | None = None
    completion: int | None = None
    cached: int = 0

    @property
    def total(self) -> int | None:
        """Prompt and reply tokens, the length of the sequence the engine holds; None where either is unknown."""
        return self.prompt + self.completion if self.prompt is not None and self.completion is not None else None


def used(usage: Any) -> Used:
    """An answer's ``usage`` object read leniently (an engine may leave out any part)."""
    if not isinstance(usage, Mapping):
        return Used()
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return Used(prompt if isinstance(prompt, int) else None, completion if isinstance(completion, int) else None,
                cached if isinstance(cached, int) else 0)


def _assistant(content: Any, calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": (c.get("function") or {}).get("name"),
                                           "arguments": (c.get("function") or {}).get("arguments")}} for c in calls]
    return out


def reply_of(answer: Any) -> dict[str, Any] | None:
    """The reply of a chat completion (``choices[0].message``) as an assistant message: its content and its calls
    (``id``, ``function.name``, ``function.arguments``, nothing an engine added); None for an answer without one."""
    try:
        message = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(message, Mapping):
        return None
    calls = message.get("tool_calls")
    return _assistant(message.get("content"), [c for c in calls if isinstance(c, Mapping)]
                      if isinstance(calls, list) else ())


@dataclass
class ReplyStream:
    """A streamed chat completion put back together, one event's data at a time (:meth:`add`): its text, its calls
    (their deltas joined by ``index``), its finish reason and usage, and whether ``[DONE]`` came."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish: str | None = None
    usage: Any = None
    done: bool = False

    def add(self, data: str) -> None:
        """One event's ``data``; one that is not a JSON object is skipped. ``EngineStreamError`` for an ``error``
        event."""
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            raise EngineStreamError("the engine sent an error event")
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.text.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                slot = self.calls.setdefault(int(call.get("index", 0)), {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            self.finish = choice.get("finish_reason") or self.finish

    def message(self) -> dict[str, Any]:
        """The reply as :func:`reply_of` gives a whole answer's."""
        calls = [{"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for _, c in sorted(self.calls.items())]
        return _assistant("".join(self.text) or None, calls)


__all__ = ["EngineStreamError", "MessageError", "ReplyStream", "StreamedCalls", "Used", "chat_messages", "cut_calls",
           "openai_call", "reply_message", "reply_of", "response_schema", "text_of", "usage", "used"]
