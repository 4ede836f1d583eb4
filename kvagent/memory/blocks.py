"""Memory blocks: labelled, size-limited pieces of an agent's memory kept in its prompt (Letta's blocks).

A block is a ``label``, its ``value`` (text), a ``description`` (what the block is for, shown to the model by the
memory tools), a ``limit`` in characters and ``read_only``. Where the application puts it decides how an edit
reaches the KV:

- ``head`` (the default, as Letta pins blocks in the system prompt): the block is a field (``FieldSpec``) after the
  policy, and an edit is a kvagent edit (``session.set``: ``auto`` and its ``EditReport``), so the prefix after it
  stays cached instead of being prefilled again.
- ``tail`` (after the trajectory, as "Models Take Notes at Prefill", arXiv:2606.17107, places user memory): the block
  is a SKILL segment at the end of the prompt, compiled once per model and value and transplanted into any
  conversation; an edit recomputes only the block itself, since nothing follows it.

The edits (:func:`edited`) check everything before anything changes: an unknown or read-only label, a value over
the limit, a text to replace that is not there are refused with :class:`~kvagent.errors.MemoryEditError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal, Sequence

from kvagent.errors import MemoryEditError
from kvagent.fields import FieldSpec
from kvagent.segments import Segment

LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
TEMPLATE = "<memory {name}>\n{value}\n</memory>"
"""How a block renders (as a field at the head, as a skill at the tail)."""
Position = Literal["head", "tail"]


@dataclass(frozen=True)
class MemoryBlock:
    """One block (see the module docstring). ``limit``: most characters the value may hold (Letta's default 5,000)."""

    label: str
    value: str = ""
    description: str = ""
    limit: int = 5000
    read_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not LABEL.match(self.label):
            raise MemoryEditError(f"memory label {self.label!r} is not valid: use letters, digits and '_' (a field "
                                  "name), starting with a letter")
        if self.limit < 1:
            raise MemoryEditError(f"memory block {self.label!r}: limit must be >= 1 character, got {self.limit}")
        check_limit(self, self.value)

    def field(self) -> FieldSpec:
        """The block as a declared field (``head`` placement)."""
        return FieldSpec(name=self.label, type="str", initial=self.value, template=TEMPLATE)

    def skill_segment(self, value: str | None = None) -> Segment:
        """The block as a SKILL segment (``tail`` placement), holding ``value`` (default: its own)."""
        text = TEMPLATE.format(name=self.label, value=self.value if value is None else value)
        return Segment.skill(f"memory:{self.label}", text, id=f"memory-{self.label}")


def check_limit(block: MemoryBlock, value: str) -> None:
    if len(value) > block.limit:
        raise MemoryEditError(f"memory block {block.label!r} holds at most {block.limit} characters; the new value has "
                              f"{len(value)}: shorten it (memory_rethink with a summary) or raise the block's limit")


def find(blocks: Sequence[MemoryBlock], label: str) -> MemoryBlock:
    for block in blocks:
        if block.label == label:
            return block
    raise MemoryEditError(f"no memory block {label!r} (blocks: {', '.join(b.label for b in blocks) or 'none'})")


def edited(block: MemoryBlock, current: str, op: str, **args: str) -> str:
    """The block's value after ``op`` on its ``current`` value (nothing changes; the caller applies it):

    - ``replace`` (``old``, ``new``): every occurrence of ``old`` replaced (Letta's ``memory_replace``);
    - ``append`` (``text``): ``text`` on a new line at the end (Letta's ``core_memory_append``);
    - ``rethink`` (``new_value``): the whole value rewritten (Letta's ``memory_rethink``).
    """
    if block.read_only:
        raise MemoryEditError(f"memory block {block.label!r} is read-only")
    if op == "replace":
        old, new = str(args.get("old", "")), str(args.get("new", ""))
        if not old:
            raise MemoryEditError("memory_replace needs the text to replace (old), not an empty string")
        if old not in current:
            raise MemoryEditError(f"memory block {block.label!r} does not contain {old!r}: copy the exact text to "
                                  "replace from the block")
        value = current.replace(old, new)
    elif op == "append":
        text = str(args.get("text", ""))
        if not text.strip():
            raise MemoryEditError("memory_append needs a non-empty text")
        value = f"{current}\n{text}" if current else text
    elif op == "rethink":
        value = str(args.get("new_value", ""))
    else:
        raise MemoryEditError(f"unknown memory edit {op!r}: use replace, append or rethink")
    check_limit(block, value)
    return value


def with_value(block: MemoryBlock, value: str) -> MemoryBlock:
    """``block`` holding ``value`` (checked against its limit)."""
    check_limit(block, value)
    return replace(block, value=value)


__all__ = ["LABEL", "TEMPLATE", "MemoryBlock", "Position", "check_limit", "edited", "find", "with_value"]
