"""Memory blocks on ``ChatKVAgent`` (``kvagent.memory``): the blocks of a chat model's sessions, the memory tools as
LangChain tools an agent runs, and how a session's prompt holds them.

``head`` blocks are declared fields of every session (after the policy): an edit is ``set_fields`` (the chat
model's ``edit_strategy``, ``auto`` by default), so the conversation after the block stays cached. ``tail`` blocks
are skills at the end of the prompt, after the trajectory (compiled once per model and value, transplanted into
new conversations): an edit changes the session's memory, and the next turn recomputes only the tail.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from langchain_core.tools import BaseTool, StructuredTool

from kvagent.errors import MemoryEditError
from kvagent.fields import FieldSpec
from kvagent.memory import MemoryBlock, memory_tools
from kvagent.memory.blocks import edited, find
from kvagent.memory.tools import describe
from kvagent.skills.spec import SkillSpec

if TYPE_CHECKING:
    from langchain_kvagent.registry import SessionEntry


def declared_fields(fields: Sequence[FieldSpec], blocks: Sequence[MemoryBlock], position: str) -> list[FieldSpec]:
    """The chat model's fields, and its head memory blocks as fields (one name space: refused when they clash)."""
    head = [b.field() for b in blocks] if position == "head" else []
    clash = {f.name for f in fields} & {f.name for f in head}
    if clash:
        raise MemoryEditError(f"memory labels {', '.join(sorted(clash))} are also field names: rename one")
    return [*fields, *head]


def edit(entry: SessionEntry, label: str, op: str, args: dict[str, str]) -> tuple[str, dict[str, object] | None]:
    """The edit of block ``label`` planned on ``entry``: (the tool result text, the field change a head block needs,
    None for the tail, whose memory is updated here and reaches the KV on the next turn)."""
    memory = entry.memory
    if memory is None:
        raise MemoryEditError("this ChatKVAgent has no memory blocks: construct it with memory=[MemoryBlock(...)]")
    block = find(memory.blocks, label)
    before = str(entry.field_values().get(label, block.value)) if memory.position == "head" else memory.values()[label]
    after = edited(block, before, op, **args)
    if memory.position == "tail":
        memory.set(label, after)
        return describe(label, before, after), None
    return describe(label, before, after), ({label: after} if after != before else {})


def langchain_tools(blocks: Sequence[MemoryBlock], run: Any) -> list[BaseTool]:
    """The memory tools as LangChain tools whose calls ``run(name, arguments)`` (the chat model's memory edit on one
    session); a refused edit returns its reason to the model, nothing changed."""
    def tool(spec: Any) -> BaseTool:
        def call(**arguments: Any) -> str:
            try:
                return str(run(spec.name, arguments))
            except MemoryEditError as exc:
                return f"error: {exc}"

        return StructuredTool.from_function(func=call, name=spec.name, description=spec.description,
                                            args_schema=dict(spec.parameters))

    return [tool(spec) for spec in memory_tools(blocks)]


def recall_tools(pages: Sequence[SkillSpec], recall: Any, drop: Any) -> list[BaseTool]:
    """``memory_recall(page)`` and ``memory_drop(page)`` over ``pages`` (compiled skills: long memory such as past
    conversations and notes): the model brings a page into its prompt when it needs it (transplanted, not
    prefilled) and takes it out again; ``recall(spec)`` / ``drop(name)`` do it on one session."""
    by_name = {p.name: p for p in pages}
    page = {"type": "string", "enum": list(by_name),
            "description": "; ".join(f"{p.name}: {p.description}" if p.description else p.name for p in pages)}
    schema = {"type": "object", "properties": {"page": page}, "required": ["page"], "additionalProperties": False}

    def bring(page: str) -> str:
        spec = by_name.get(page)
        if spec is None:
            return f"error: no memory page {page!r} (pages: {', '.join(by_name)})"
        return f"memory page {page!r} " + ("is now in your context" if recall(spec) else "was already in your context")

    def forget(page: str) -> str:
        return f"memory page {page!r} " + ("taken out of your context" if drop(page) else "was not in your context")

    return [StructuredTool.from_function(func=bring, name="memory_recall", args_schema=schema,
                                         description="Bring a page of long memory into your context."),
            StructuredTool.from_function(func=forget, name="memory_drop", args_schema=schema,
                                         description="Take a page of long memory out of your context again.")]


__all__ = ["declared_fields", "edit", "langchain_tools", "recall_tools"]
