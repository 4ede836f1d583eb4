"""Memory: one session's memory blocks, where they stand in its prompt, and how an edit reaches its KV.

``head`` blocks are fields of the session (the application declares ``memory.fields()`` with the session and
places ``memory.segments()`` after its policy): an edit is ``session.set_many`` with the block's new value (the
session's edit strategy, ``auto`` by default), so the prompt after the block stays cached (a splice or an
erratum) instead of being prefilled again. ``tail`` blocks are SKILL segments the application places at the end
of the prompt (``memory.segments()`` after the trajectory): compiled once per model and value by
``engine.skills`` (transplanted into any later conversation with the same memory), and an edit changes only the
tail (nothing follows it). Every edit is checked before anything changes and returns a :class:`MemoryEdit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvagent.errors import MemoryEditError
from kvagent.memory.blocks import MemoryBlock, Position, check_limit, edited, find
from kvagent.memory.tools import describe, memory_edit
from kvagent.segments import Segment

if TYPE_CHECKING:
    from kvagent.edits.base import EditReport
    from kvagent.fields import FieldSpec
    from kvagent.kv.sync import PrefillReport
    from kvagent.kv.work import Work
    from kvagent.session import Session
    from kvagent.tools.format import ToolCall


@dataclass(frozen=True)
class MemoryEdit:
    """What an edit did: the block, its value before and after, and what reaching the KV cost (the head's
    ``EditReport``, or the tail's ``PrefillReport``)."""

    label: str
    before: str
    after: str
    report: EditReport | PrefillReport | None

    @property
    def result(self) -> str:
        """The text a memory tool call returns to the model."""
        return describe(self.label, self.before, self.after)


class Memory:
    """The blocks of one session (see the module docstring); ``position``: ``head`` or ``tail``."""

    def __init__(self, blocks: Sequence[MemoryBlock], position: Position = "head") -> None:
        labels = [b.label for b in blocks]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise MemoryEditError(f"memory labels must be unique: {', '.join(twice)} given twice")
        if position not in ("head", "tail"):
            raise MemoryEditError(f"memory position {position!r}: use head (after the policy) or tail (after the "
                                  "trajectory)")
        self.blocks, self.position = tuple(blocks), position
        self._values = {b.label: b.value for b in blocks}  # the tail's current values (the head's are the fields')

    def fields(self) -> list[FieldSpec]:
        """The blocks as fields to declare with the session (``head``; none for ``tail``)."""
        return [b.field() for b in self.blocks] if self.position == "head" else []

    def segments(self) -> list[Segment]:
        """The blocks' segments, with their current values (``tail``) or initial ones (``head``)."""
        if self.position == "head":
            return [b.field().segment() for b in self.blocks]
        return [b.skill_segment(self._values[b.label]) for b in self.blocks]

    def is_memory(self, segment: Segment) -> bool:
        """Whether ``segment`` is one of this memory's tail segments (the adapters move them to the end)."""
        return self.position == "tail" and segment.id in {f"memory-{b.label}" for b in self.blocks}

    def values(self, session: Session | None = None) -> dict[str, str]:
        """Every block's current value (the head's read from ``session``'s fields when given)."""
        if self.position == "head" and session is not None:
            current = session.field_values
            return {b.label: str(current.get(b.label, b.value)) for b in self.blocks}
        return dict(self._values)

    def set(self, label: str, value: str) -> None:
        """Hold ``value`` for tail block ``label`` (placed by the next ``segments()``; checked against its limit)."""
        check_limit(find(self.blocks, label), value)
        self._values[label] = value

    def edit_work(self, session: Session, label: str, op: str, **args: str) -> Work[MemoryEdit]:
        """Edit block ``label`` (``op``: replace / append / rethink, as :func:`kvagent.memory.blocks.edited`) in
        ``session``: a unit of work (run it with ``session.run``). Refused before anything changes."""
        block = find(self.blocks, label)
        before = self.values(session)[label]
        after = edited(block, before, op, **args)
        if after == before:
            return MemoryEdit(label, before, after, None)
        if self.position == "head":
            report: EditReport | PrefillReport = yield from session.set_many_work({label: after})
        else:
            old = block.skill_segment(before)
            segments = [block.skill_segment(after) if s.id == old.id else s for s in session.segments]
            report = yield from session.replace_work(segments)
        self._values[label] = after
        return MemoryEdit(label, before, after, report)

    def apply_work(self, session: Session, call: ToolCall) -> Work[str]:
        """A memory tool call applied to ``session``; its result text (a refused edit's reason, nothing changed)."""
        try:
            label, op, args = memory_edit(call)
            done = yield from self.edit_work(session, label, op, **args)
        except MemoryEditError as exc:
            return f"error: {exc}"
        return done.result


__all__ = ["Memory", "MemoryEdit"]
