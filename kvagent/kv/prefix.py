"""PrefixIndex: which sequence holds the longest cached prefix of a token list (a radix tree).

In the shape of SGLang's radix cache (``python/sglang/srt/mem_cache/radix_cache.py``): edges are token
runs, each node knows the sequences whose indexed prefix passes through it. ``match`` walks the tree once
(O(len(tokens))) instead of comparing against every open session. The index holds, per sequence, only
the prefix that other sequences may share (no stale or evicted cell): the pool keeps it up to date.

Every sequence's prefix lives in one *scope* (a tenant of a server, as vLLM's ``cache_salt``): ``match`` only
finds prefixes of the scope it is asked for, so a session never starts from, and can never time or count, the
cells of another scope. The default scope ``""`` is shared by everything that does not name one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class _Node:
    edge: tuple[int, ...] = ()
    children: dict[int, _Node] = field(default_factory=dict)  # keyed by the child's first edge token
    seqs: set[int] = field(default_factory=set)  # sequences whose indexed prefix covers this whole node


class PrefixIndex:
    """Token prefixes of live sequences. Invariant: ``indexed(seq)`` is exactly what was last inserted."""

    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}
        self._held: dict[int, tuple[int, ...]] = {}
        self._scope: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._held)

    def indexed(self, seq: int) -> tuple[int, ...]:
        """The prefix indexed for ``seq`` (empty when none)."""
        return self._held.get(seq, ())

    def scope_of(self, seq: int) -> str | None:
        """The scope ``seq``'s prefix is indexed in (None: nothing indexed)."""
        return self._scope.get(seq)

    def match(self, tokens: Sequence[int], exclude: int = -1, scope: str = "") -> tuple[int, int]:
        """``(seq, n)``: a sequence of ``scope`` (not ``exclude``) holding ``tokens[:n]`` with ``n`` maximal;
        ``(-1, 0)`` if none. Sequences of other scopes are never considered."""
        root = self._roots.get(scope)
        if root is None:
            return (-1, 0)
        node, i, best = root, 0, (-1, 0)
        tokens = tuple(tokens)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common(child.edge, tokens, i)
            holders = child.seqs - {exclude}
            if not holders:
                break
            best = (min(holders), i + n)
            if n < len(child.edge):
                break
            node, i = child, i + n
        return best

    def insert(self, seq: int, tokens: Sequence[int], scope: str = "") -> None:
        """Index ``tokens`` as ``seq``'s shareable prefix in ``scope`` (replacing what was indexed for it)."""
        tokens = tuple(tokens)
        if self._held.get(seq) == tokens and self._scope.get(seq) == scope:
            return
        self.remove(seq)
        if not tokens:
            return
        node, i = self._roots.setdefault(scope, _Node()), 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tokens[i:])
                node.children[tokens[i]] = child
            else:
                n = _common(child.edge, tokens, i)
                if n < len(child.edge):
                    _split(node, child, n)
                    child = node.children[tokens[i]]
            child.seqs.add(seq)
            node, i = child, i + len(child.edge)
        self._held[seq] = tokens
        self._scope[seq] = scope

    def remove(self, seq: int) -> None:
        """Forget ``seq`` (its sequence was freed or its shareable prefix changed); prunes empty nodes."""
        tokens = self._held.pop(seq, None)
        scope = self._scope.pop(seq, "")
        if not tokens:
            return
        path: list[tuple[_Node, _Node]] = []
        root = self._roots[scope]
        node, i = root, 0
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.seqs.discard(seq)
            path.append((node, child))
            node, i = child, i + len(child.edge)
        for parent, child in reversed(path):
            if not child.seqs and not child.children:
                del parent.children[child.edge[0]]
        if not root.children:
            del self._roots[scope]


def _common(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    n = 0
    limit = min(len(edge), len(tokens) - start)
    while n < limit and edge[n] == tokens[start + n]:
        n += 1
    return n


def _split(parent: _Node, child: _Node, at: int) -> None:
    """Cut ``child``'s edge after ``at`` tokens: a new middle node keeps the head, ``child`` the tail."""
    middle = _Node(child.edge[:at], {child.edge[at]: child}, set(child.seqs))
    child.edge = child.edge[at:]
    parent.children[middle.edge[0]] = middle
