"""The prefix-stable layout: what ``kvagent serve --upstream`` forwards for a client that rewrites its own prompt.

An engine with automatic prefix caching (vLLM, SGLang, llama.cpp's server) reuses KV only for a byte-identical
prefix, so a client that changes one line near the top of its system prompt loses the cache from that line on,
every turn. "Models Take Notes at Prefill" (arXiv:2606.17107) keeps the prefix and appends the change as an
*erratum* after the turns. :func:`plan` does that for a whole resent history: it diffs the client's messages
with those it sent last turn (:class:`Layout`) and forwards

- the session's previous request byte for byte (the reply included, as the engine answered it),
- then one erratum message for what changed inside it (a changed line: ``[STATE UPDATE] <line's label> -> <new
  line>``, as kvagent's errata render a field; a removed or inserted message likewise),
- then the client's new messages.

A change inside the last ``inplace_tail_chars`` characters (a regenerated reply, the latest tool result cleared)
is forwarded in place instead: only that tail is computed again, and the model reads the prompt as the client
wrote it. A client whose history no longer relates to the session's (no message in common, or another first
role) starts a new layout. Folding errata back in (:meth:`Layout.rebuilt`) is the caller's decision: when the
layout would not fit the engine's context, or holds ``max_errata`` errata.

Pure logic: messages are OpenAI chat messages (dicts); nothing here sends anything.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from kvagent import openai_shape as shape
from kvagent.edits.implicit import field_name
from kvagent.segments import DEFAULT_ERRATUM_TEMPLATE, render_template

Message = dict[str, Any]
Kind = Literal["new", "append", "inplace", "errata", "rebuild"]
REMOVED = "(removed)"


def _text(message: Mapping[str, Any]) -> str:
    """A message's text (``kvagent.openai_shape.text_of``), "" for none: a resent reply's null and "" are alike."""
    return shape.text_of(message.get("content")) or ""


def key(message: Mapping[str, Any]) -> str:
    """What identifies a message across resends: role, text, name, tool call id and calls (name, arguments, id).

    A client resends a reply in its own shape (``content`` None or "", extra null fields of its SDK); the key
    ignores those differences so a resent reply matches the one the engine gave."""
    calls = [(c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
             for c in message.get("tool_calls") or () if isinstance(c, Mapping)]
    return json.dumps([message.get("role"), _text(message), message.get("name"),
                       message.get("tool_call_id"), calls], ensure_ascii=False)


@dataclass
class Layout:
    """One session's state between turns.

    ``client``: the keys of the client's messages as of the last turn (its reply included); ``sent``: the messages
    forwarded (the reply included); ``where[i]``: the index in ``sent`` of client message ``i``, or -1 for one
    that stands in ``sent`` only as an erratum; ``errata``: indices in ``sent`` of the erratum messages."""

    client: list[str] = field(default_factory=list)
    sent: list[Message] = field(default_factory=list)
    where: list[int] = field(default_factory=list)
    errata: list[int] = field(default_factory=list)
    tokens: int | None = None
    """The tokens of ``sent`` (the last request's prompt and its reply) as the engine counted them, under ``tools``
    (the request's tools as JSON); None when the engine did not say."""
    tools: str = ""

    @classmethod
    def rebuilt(cls, messages: Sequence[Message]) -> Layout:
        """The layout of a request forwarded as the client wrote it (errata folded in)."""
        return cls([key(m) for m in messages], [dict(m) for m in messages], list(range(len(messages))), [])

    def commit(self, reply: Message, tokens: int | None = None, tools: str = "") -> None:
        """The engine's reply joins both sides (the client resends it next turn); ``tokens``: the request's prompt
        and reply tokens as the engine counted them (``usage``), under ``tools``."""
        self.client.append(key(reply))
        self.where.append(len(self.sent))
        self.sent.append(reply)
        self.tokens, self.tools = tokens, tools


@dataclass(frozen=True)
class Forward:
    """What to send for one request, and the layout it leaves once the reply is committed."""

    messages: list[Message]
    layout: Layout
    kind: Kind
    errata: tuple[str, ...] = ()
    """The erratum lines added by this request."""


@dataclass(frozen=True)
class Planner:
    """The policy of :func:`plan`'s module docstring. ``template``: an erratum line (``{name}``, ``{value}``);
    ``role``: the erratum message's role (``system``; ``user`` for a chat template that takes a system message
    first only); ``inplace_tail_chars``: a change this close to the end is forwarded in place."""

    template: str = DEFAULT_ERRATUM_TEMPLATE
    role: Literal["system", "user"] = "system"
    inplace_tail_chars: int = 1024

    def plan(self, layout: Layout | None, messages: Sequence[Message]) -> Forward:
        new = [key(m) for m in messages]
        if layout is None or not layout.client:
            return Forward([dict(m) for m in messages], Layout.rebuilt(messages), "new")
        old = layout.client
        if new[:len(old)] == old:
            tail = [dict(m) for m in messages[len(old):]]
            after = Layout(new, [*layout.sent, *tail], [*layout.where, *range(len(layout.sent), len(layout.sent)
                                                                                + len(tail))], list(layout.errata))
            return Forward([*layout.sent, *tail], after, "append")
        first = next(i for i, (a, b) in enumerate(zip([*old, None], [*new, None])) if a != b)
        if not set(old) & set(new) or json.loads(old[0])[0] != messages[0].get("role"):
            # no message of the session survives, or it starts otherwise: another conversation under this key
            return Forward([dict(m) for m in messages], Layout.rebuilt(messages), "new")
        inplace = self._inplace(layout, messages, new, first)
        if inplace is not None:
            return inplace
        return self._errata(layout, messages, new)

    def _inplace(self, layout: Layout, messages: Sequence[Message], new: list[str], first: int) -> Forward | None:
        """The client's tail from ``first`` on, after the sent messages before it, when that tail is short and no
        erratum stands after the cut (cutting one would lose its change)."""
        if first >= len(layout.where) or layout.where[first] < 0:
            return None
        cut = layout.where[first]
        if any(e >= cut for e in layout.errata):
            return None
        if sum(len(_text(m)) for m in layout.sent[cut:]) > self.inplace_tail_chars:
            return None
        tail = [dict(m) for m in messages[first:]]
        after = Layout(new, [*layout.sent[:cut], *tail], [*layout.where[:first], *range(cut, cut + len(tail))],
                       list(layout.errata))
        return Forward([*layout.sent[:cut], *tail], after, "inplace")

    def _errata(self, layout: Layout, messages: Sequence[Message], new: list[str]) -> Forward:
        """Errata for what changed up to the last run of messages the client resent unchanged; what follows that
        run is new and goes after the errata as it is (what it replaced is marked removed)."""
        old = layout.client
        olds = _messages_of(layout)
        ops = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        last = max(k for k, op in enumerate(ops) if op[0] == "equal")  # one exists: plan() saw a message in common
        lines: list[str] = []
        where: list[int] = [-1] * len(new)
        for op, i1, i2, j1, j2 in ops[:last + 1]:
            if op == "equal":
                where[j1:j2] = layout.where[i1:i2]
            elif op == "replace" and i2 - i1 == j2 - j1 and all(
                    olds[i].get("role") == messages[j].get("role") for i, j in zip(range(i1, i2), range(j1, j2))):
                for i, j in zip(range(i1, i2), range(j1, j2)):
                    lines += self._changed_lines(olds[i], messages[j])
            else:
                lines += [self._line(_first_line(olds[i]), REMOVED) for i in range(i1, i2)]
                lines += [self._line(f"{messages[j].get('role')} message", _text(messages[j]))
                          for j in range(j1, j2)]
        tail_start = ops[last][4]
        lines += [self._line(_first_line(olds[i]), REMOVED) for i in range(ops[last][2], len(old))]
        sent = list(layout.sent)
        errata = list(layout.errata)
        if lines:
            errata.append(len(sent))
            sent.append({"role": self.role, "content": "\n".join(lines)})
        for j in range(tail_start, len(new)):
            where[j] = len(sent)
            sent.append(dict(messages[j]))
        return Forward(sent, Layout(new, sent, where, errata), "errata", tuple(lines))

    def _changed_lines(self, before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
        a = _text(before).split("\n")
        b = _text(after).split("\n")
        out: list[str] = []
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if op == "equal":
                continue
            if op == "replace" and i2 - i1 == j2 - j1:  # lines rewritten one for one: one erratum line each
                out += [self._line(x, _value(x, y)) for x, y in zip(a[i1:i2], b[j1:j2])]
                continue
            label = a[i1] if i2 > i1 else b[j1]
            value = "\n".join(b[j1:j2]).strip() or REMOVED
            out.append(self._line(label, value))
        if not out:  # the text is the same: a tool call or name changed
            out.append(self._line(f"{after.get('role')} message", json.dumps(after, ensure_ascii=False)))
        return out

    def _line(self, label: str, value: str) -> str:
        return render_template(self.template, field_name(label), value)


def _value(before: str, after: str) -> str:
    """What a rewritten line now says: the text after its label where it keeps its label (``Current time: 10:05``
    -> ``10:05``), else the whole line."""
    label = field_name(before)
    if label == field_name(after) and label != after.strip():
        rest = after.strip()[len(label):].lstrip()
        if rest[:1] in (":", "="):
            return rest[1:].strip() or REMOVED
    return after.strip() or REMOVED


def _first_line(message: Mapping[str, Any]) -> str:
    text = _text(message).strip()
    return text.split("\n", 1)[0] if text else f"{message.get('role')} message"


def _messages_of(layout: Layout) -> list[Message]:
    """The client's previous messages as it wrote them (from their keys: role, text, name, tool call id)."""
    out: list[Message] = []
    for k in layout.client:
        role, text, name, call_id, _calls = json.loads(k)
        out.append({"role": role, "content": text, "name": name, "tool_call_id": call_id})
    return out


__all__ = ["Forward", "Layout", "Planner", "key"]
