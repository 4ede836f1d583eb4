"""The memory tools the model calls to edit its own memory (Letta's names and semantics):
``memory_replace(label, old, new)``, ``memory_append(label, text)``, ``memory_rethink(label, new_value)``.

:func:`memory_tools` gives their specs for the editable blocks (the label an enum of those blocks, so under the
turn's grammar a call can only name one of them); :func:`memory_edit` reads a call as the edit it asks for. The
adapters apply the edit (``kvagent.memory.Memory``) and give the model the result text :func:`describe` writes.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvagent.errors import MemoryEditError
from kvagent.memory.blocks import MemoryBlock
from kvagent.tools.format import ToolCall
from kvagent.tools.spec import ToolSet, ToolSpec

OPS = {"memory_replace": "replace", "memory_append": "append", "memory_rethink": "rethink"}


def memory_tools(blocks: Sequence[MemoryBlock]) -> ToolSet:
    """The three memory tools over the blocks that are not read-only (none if all are)."""
    editable = [b for b in blocks if not b.read_only]
    if not editable:
        return ToolSet()
    label = {"type": "string", "enum": [b.label for b in editable],
             "description": "; ".join(f"{b.label}: {b.description}" if b.description else b.label for b in editable)}

    def spec(name: str, description: str, **props: Any) -> ToolSpec:
        return ToolSpec(name, description, {"type": "object", "properties": {"label": label, **props},
                                            "required": ["label", *props], "additionalProperties": False})

    text = {"type": "string"}
    return ToolSet([
        spec("memory_replace", "Replace a piece of text in a memory block with new text (an update of a fact).",
             old=text, new=text),
        spec("memory_append", "Add a line of new information at the end of a memory block.", text=text),
        spec("memory_rethink", "Rewrite a whole memory block (to reorganise or condense it).", new_value=text),
    ])


def memory_edit(call: ToolCall) -> tuple[str, str, dict[str, str]]:
    """(label, op, arguments) of a memory tool call; :class:`MemoryEditError` for another tool or no label."""
    op = OPS.get(call.name)
    if op is None:
        raise MemoryEditError(f"{call.name!r} is not a memory tool (use {', '.join(OPS)})")
    args = {k: str(v) for k, v in call.arguments.items()}
    label = args.pop("label", "")
    if not label:
        raise MemoryEditError(f"{call.name} needs the label of the block to edit")
    return label, op, args


def describe(label: str, before: str, after: str) -> str:
    """The tool result the model reads after an edit: what the block holds now."""
    if before == after:
        return f"memory block {label!r} unchanged"
    return f"memory block {label!r} updated; it now reads:\n{after}"


__all__ = ["OPS", "describe", "memory_edit", "memory_tools"]
