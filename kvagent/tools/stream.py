"""CallSplitter: a streamed turn's text pieces as text deltas or tool-call deltas (id, name, argument pieces).

Adapters stream a turn that may call tools the way their ecosystem does (OpenAI's ``delta.tool_calls``,
LangChain's ``tool_call_chunks``). Under the turn's grammar (``kvagent.tools.choice``) a turn is either text
or calls written in the model's tool format (``call_open{"name": "...", "arguments": {...}}call_close``, joined
by its separator): so the start decides, and a call's name and arguments can be cut from the text as it grows.
The arguments' end is found by tracking JSON strings and braces (an argument may contain ``}`` or the closing
tag's text), so an argument piece is never taken back. A format that reads bare-JSON calls
(``ToolFormat.untagged``) holds back a reply that starts like JSON until the turn ends: :meth:`CallSplitter.finish`
is told the calls the turn made, and streams them, or the held text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Sequence

from kvagent.tools.format import HERMES, ToolCall, ToolFormat, dumps


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index``: the first one of a call carries its ``id`` and ``name``, every one a piece of
    its arguments' JSON (possibly empty)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class CallSplitter:
    """Feed the pieces in order; each :meth:`feed` returns the text and the call deltas now known."""

    def __init__(self, tool_format: ToolFormat = HERMES) -> None:
        self.format = tool_format
        if tool_format.call_name_close is not None:  # the name, then its arguments (Mistral's [ARGS])
            self._head = re.compile(re.escape(tool_format.call_open) + r"([A-Za-z0-9_.-]+)"
                                    + re.escape(tool_format.call_name_close))
            self._tail = tool_format.call_close
        else:
            self._head = re.compile(re.escape(tool_format.call_open) + r'\{"name": "((?:[^"\\]|\\.)*)", "'
                                    + re.escape(tool_format.arguments_key) + '": ')
            self._tail = "}" + tool_format.call_close  # after the arguments object: the call object's brace, the tag
        self.mode: str | None = None  # "text", "calls" or "held" (maybe bare-JSON calls), once the start is known
        self._buffer = ""  # call mode: text not yet turned into deltas
        self._state = "head"  # head (waiting for a call's head), args (in its arguments), tail (after them)
        self._depth, self._string, self._escape = 0, False, False
        self.ids: list[str] = []

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        if self.mode is None:
            start = (self._buffer + piece).lstrip()
            opener = self.format.call_open.strip()
            if not start or opener and opener.startswith(start[: len(opener)]) and len(start) < len(opener):
                self._buffer += piece
                return "", []
            if opener and start.startswith(opener):
                self.mode = "calls"
            elif self.format.untagged and start[0] in "{[`":
                self.mode = "held"
            else:
                self.mode = "text"
            piece, self._buffer = self._buffer + piece, ""
        if self.mode == "text":
            return piece, []
        if self.mode == "held":
            self._buffer += piece
            return "", []
        self._buffer += piece
        return "", self._deltas()

    def finish(self, calls: Sequence[ToolCall] = ()) -> tuple[str, list[CallDelta]]:
        """What is left at the end of the turn (a call cut short keeps the argument pieces it had); ``calls``: the
        calls the turn made, which a held reply (bare JSON) is streamed as, else as its text."""
        if self.mode == "held" and calls:
            self._buffer = ""
            out = []
            for call in calls:
                self.ids.append(f"call_{uuid.uuid4().hex[:8]}")
                out.append(CallDelta(len(self.ids) - 1, dumps(dict(call.arguments)), self.ids[-1], call.name))
            return "", out
        if self.mode != "calls":
            rest, self._buffer = self._buffer, ""
            return rest, []
        return "", self._deltas()

    def _deltas(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        while self._buffer:
            if self._state == "head":
                self._buffer = self._buffer.lstrip(self.format.call_separator or " ")
                head = self._head.match(self._buffer)
                if head is None:
                    return out  # the head is not complete yet
                self.ids.append(f"call_{uuid.uuid4().hex[:8]}")
                out.append(CallDelta(len(self.ids) - 1, "", self.ids[-1], json.loads(f'"{head.group(1)}"')))
                self._buffer, self._state, self._depth = self._buffer[head.end():], "args", 0
            elif self._state == "args":
                end = self._scan()
                taken = self._buffer[:end]
                if taken:
                    out.append(CallDelta(len(self.ids) - 1, taken))
                self._buffer = self._buffer[end:]
                if self._depth or not taken and not self._buffer:
                    return out
                self._state = "tail"
            else:
                if len(self._buffer) < len(self._tail):
                    return out
                self._buffer, self._state = self._buffer[len(self._tail):], "head"
        return out

    def _scan(self) -> int:
        """How much of the buffer belongs to the arguments object (all of it while it is still open)."""
        for i, ch in enumerate(self._buffer):
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(self._buffer)


__all__ = ["CallDelta", "CallSplitter"]
