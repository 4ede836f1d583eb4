"""The tool sets a client resends with every call, bound to an engine: checked and compiled to the segments that
describe them once, then found by the tools' JSON (both adapters keep one per engine or tenant)."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from cachetools import LRUCache

from kvagent.errors import ContextOverflowError
from kvagent.tools.format import format_of
from kvagent.tools.spec import ToolSet

if TYPE_CHECKING:
    from kvagent.engine import Engine
    from kvagent.segments import Segment


class ToolSets:
    """Tool sets and the segments that describe them to the model, by the tools' JSON (a client resends them with
    every call), least recently used dropped beyond ``limit``. ``scope`` and ``library``: the renderer and skill
    library of a tenant, so one tenant's hit says nothing of another's tools. Safe from several threads.

    A miss checks the tools (``ToolSet``: names, duplicates, schemas the grammar can express; ``ToolSpecError``
    names the tool) and compiles their segments as skills on the engine's worker (once per model). A refused set
    is not kept."""

    def __init__(self, engine: Engine, limit: int = 64, *, scope: str = "", library: Any = None) -> None:
        self.engine, self.limit, self.scope, self.library = engine, limit, scope, library
        self._done: LRUCache[str, tuple[ToolSet, tuple[Segment, ...]]] = LRUCache(maxsize=limit)
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key(tools: Sequence[Mapping[str, Any]]) -> str:
        return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))

    def get(self, tools: Sequence[Mapping[str, Any]]) -> tuple[ToolSet, tuple[Segment, ...]]:
        key = self.key(tools)
        found = self.lookup(key)
        if found is None:
            with self._lock:
                self.misses += 1
            found = self.put(key, self.build(tools))
        return found

    def lookup(self, key: str) -> tuple[ToolSet, tuple[Segment, ...]] | None:
        with self._lock:
            found = self._done.get(key)  # a hit becomes the most recent
            if found is not None:
                self.hits += 1
            return found

    def put(self, key: str, built: tuple[ToolSet, tuple[Segment, ...]]) -> tuple[ToolSet, tuple[Segment, ...]]:
        with self._lock:
            # limit 0 keeps nothing (cachetools refuses any store into it); a set a concurrent miss put first keeps
            # its place (only a lookup is a use)
            if self.limit and key not in self._done:
                self._done[key] = built
        return built

    def build(self, tools: Sequence[Mapping[str, Any]]) -> tuple[ToolSet, tuple[Segment, ...]]:
        toolset = ToolSet([dict(t) for t in tools])
        renderer = self.engine.renderer(True, self.scope)
        n = sum(len(renderer.segment_tokens(s)) for s in format_of(renderer).segments(toolset))
        if n >= self.engine.backend.n_ctx:  # checked before anything is compiled
            raise ContextOverflowError(f"tools: their descriptions are {n} tokens, the context "
                                       f"{self.engine.backend.n_ctx}: send fewer or shorter tools")
        return toolset, tuple(self.engine.tool_segments(toolset, library=self.library, scope=self.scope))


__all__ = ["ToolSets"]
