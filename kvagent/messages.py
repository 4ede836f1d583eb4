"""Chat messages to segments: one mapping for every adapter (LangChain, the OpenAI-compatible server).

Leading system messages become the POLICY, later system messages MEMORY, user messages user turns,
assistant messages assistant turns (their tool calls written as the tool format writes them, so the session
re-renders a turn it generated to the tokens it cached), tool results a user-role turn that names the tool and
the call (``kvagent.tools.format``). A client that resends the whole history each call is
served by :class:`MessageLog`: when the messages already in the prompt are a prefix of the new list, only
the new ones are appended (errata and skills stay where they are, so the cached prefix is reused);
otherwise the prompt is rebuilt with the current field values folded into the fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from kvagent.errors import SegmentOrderError
from kvagent.segments import Segment, SegmentKind, field_values, fresh_id
from kvagent.tools.format import HERMES, ToolCall, ToolFormat

if TYPE_CHECKING:
    from kvagent.generation import Generation

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
_PREFIX = "msg-"


@dataclass(frozen=True)
class ChatMessage:
    """One message as clients send it; ``name`` is the tool's name for tool results, ``tool_call_id`` the call
    a result answers; ``tool_calls`` the calls an assistant message made."""

    role: Role
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise SegmentOrderError(f"unknown message role {self.role!r}: use one of {', '.join(ROLES)}")


def to_segment(message: ChatMessage, *, leading: bool, tool_format: ToolFormat = HERMES, opens: bool = True,
               then_result: bool = False) -> Segment:
    """The segment of one message; ``leading``: a system message before any other message (the policy); calls and
    results in ``tool_format``; a tool result ``opens`` its user message unless it follows another result the format
    joins it to, and is joined to the next where ``then_result``."""
    sid = fresh_id(_PREFIX)  # unique beside the ids of a snapshot another process saved
    if message.role == "system":
        return Segment.policy(message.content, id=sid) if leading else Segment.memory(message.content, id=sid)
    if message.role == "user":
        return Segment.user(message.content, id=sid)
    if message.role == "assistant":
        calls = tool_format.render_calls(message.tool_calls)
        return Segment.assistant("\n".join(p for p in (message.content, calls) if p), id=sid)
    return tool_format.result_segment(message.name or "tool", message.tool_call_id, message.content, id=sid,
                                      opens=opens, then_result=then_result)


def to_segments(messages: Sequence[ChatMessage], *, after_start: bool = False,
                tool_format: ToolFormat = HERMES) -> list[Segment]:
    """Segments of ``messages``; ``after_start``: other messages precede them (no leading system run). Consecutive
    tool results share one user message where ``tool_format`` joins them (as the chat template does)."""
    out: list[Segment] = []
    leading = not after_start
    joins = tool_format.result_separator is not None
    for i, m in enumerate(messages):
        leading = leading and m.role == "system"
        follows = joins and m.role == "tool" and i > 0 and messages[i - 1].role == "tool"
        then = joins and m.role == "tool" and i + 1 < len(messages) and messages[i + 1].role == "tool"
        out.append(to_segment(m, leading=leading, tool_format=tool_format, opens=not follows, then_result=then))
    return out


def is_message_segment(segment: Segment) -> bool:
    return segment.id.startswith(_PREFIX)


def logged_reply(gen: Generation, ids: Sequence[str] = ()) -> ChatMessage:
    """A generated turn as the client will send it back: its calls (with the ``ids`` it was given, in order) and no
    text, else its text; what the log holds, so the resent history matches it."""
    if gen.tool_calls:
        calls = tuple(dataclasses.replace(c, id=ids[k]) if k < len(ids) else c for k, c in enumerate(gen.tool_calls))
        return ChatMessage("assistant", "", tool_calls=calls)
    return ChatMessage("assistant", gen.prefix + gen.text)


def _described(segments: Sequence[Segment]) -> list[tuple[str, str]]:
    return [(s.id, s.text) for s in segments]


class MessageLog:
    """The messages a session's prompt holds, and how to bring that prompt to a new message list: the one place
    both adapters (the server, LangChain) plan a turn and log its reply.

    ``static`` are the segments an adapter adds itself (skills, declared fields, the bound tools): they follow the
    leading system messages and precede the turns. A prompt that changed inside (a clock line, a cleared tool
    result) is planned like any other; the session edits it in place when the turn syncs (``Session.resend``).
    """

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.tools: list[Segment] = []

    def bind_tools(self, tools: Sequence[Segment]) -> None:
        """Take the call's tool segments; where they differ from the last call's (by id and text) the prompt's static
        part changes, so the next plan rebuilds from the messages instead of extending the old prompt."""
        if _described(tools) != _described(self.tools):
            self.commit([])
            self.tools = list(tools)

    def plan(self, current: Sequence[Segment], messages: Sequence[ChatMessage], static: Sequence[Segment],
             tool_format: ToolFormat = HERMES) -> list[Segment]:
        """The prompt for ``messages`` given the session's ``current`` segments, calls and results written in
        ``tool_format`` (call :meth:`commit` or :meth:`record` once the session holds it)."""
        messages = list(messages)
        held = self.messages
        if held and messages[: len(held)] == held and any(is_message_segment(s) for s in current):
            return [*current, *to_segments(messages[len(held):], after_start=True, tool_format=tool_format)]
        if not held and current and messages and messages[0].role != "system" and not any(
            is_message_segment(s) for s in current
        ) and {s.id for s in static} <= {s.id for s in current}:
            # a prompt of the adapter's own segments (policy, fields, errata, skills) and no message yet:
            # the messages follow it, errata included
            return [*current, *to_segments(messages, after_start=bool(current), tool_format=tool_format)]
        values = field_values(current)
        lead = 0
        while lead < len(messages) and messages[lead].role == "system":
            lead += 1
        fixed = [s.with_value(values[str(s.name)]) if s.kind is SegmentKind.FIELD and str(s.name) in values else s
                 for s in static]
        return [*to_segments(messages[:lead]), *fixed,
                *to_segments(messages[lead:], after_start=True, tool_format=tool_format)]

    def commit(self, messages: Sequence[ChatMessage]) -> None:
        self.messages = list(messages)

    def record(self, messages: Sequence[ChatMessage], gen: Generation, call_ids: Sequence[str] = ()) -> ChatMessage:
        """The turn is in the session: ``messages`` and the generated reply (:func:`logged_reply`) are what its prompt
        holds. Returns the logged reply."""
        reply = logged_reply(gen, call_ids)
        self.commit([*messages, reply])
        return reply
