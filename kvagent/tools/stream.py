"""CallSplitter: a streamed turn's text pieces as text deltas or tool-call deltas (id, name, argument pieces).

Adapters stream a turn that may call tools the way their ecosystem does (OpenAI's ``delta.tool_calls``,
LangChain's ``tool_call_chunks``). Under the turn's grammar (``kvagent.tools.choice``) a turn is either text
(it cannot start with ``<``) or calls written ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``,
one per line: so the first character decides, and a call's name and arguments can be cut from the text as it
grows. The arguments' end is found by tracking JSON strings and braces (an argument may contain ``}`` or the
closing tag's text), so an argument piece is never taken back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvagent.tools.format import CLOSE, OPEN, SEPARATOR

_HEAD = re.compile(re.escape(OPEN) + r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
_TAIL = "}" + CLOSE  # after the arguments object: the call object's brace, then the tag


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

    def __init__(self) -> None:
        self.mode: str | None = None  # "text" or "calls", once the first character is known
        self._buffer = ""  # call mode: text not yet turned into deltas
        self._state = "head"  # head (waiting for a call's head), args (in its arguments), tail (after them)
        self._depth, self._string, self._escape = 0, False, False
        self.ids: list[str] = []

    def feed(self, piece: str) -> tuple[str, list[CallDelta]]:
        if self.mode is None:
            start = piece.lstrip()
            if not start:
                self._buffer += piece
                return "", []
            self.mode = "calls" if start.startswith("<") else "text"
            piece, self._buffer = self._buffer + piece, ""
        if self.mode == "text":
            return piece, []
        self._buffer += piece
        return "", self._deltas()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left at the end of the turn (a call cut short keeps the argument pieces it had)."""
        if self.mode != "calls":
            rest, self._buffer = self._buffer, ""
            return rest, []
        return "", self._deltas()

    def _deltas(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        while self._buffer:
            if self._state == "head":
                self._buffer = self._buffer.lstrip(SEPARATOR)
                head = _HEAD.match(self._buffer)
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
                if len(self._buffer) < len(_TAIL):
                    return out
                self._buffer, self._state = self._buffer[len(_TAIL):], "head"
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
