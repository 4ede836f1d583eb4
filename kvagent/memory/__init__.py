"""Agent memory that edits without busting the cache: memory blocks (``blocks``), the tools the model edits them
with (``tools``), and one session's memory with its placement, head or tail (``memory``)."""

from kvagent.memory.blocks import MemoryBlock
from kvagent.memory.memory import Memory, MemoryEdit
from kvagent.memory.tools import memory_tools

__all__ = ["Memory", "MemoryBlock", "MemoryEdit", "memory_tools"]
