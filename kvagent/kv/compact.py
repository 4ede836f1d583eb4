"""Runs of consecutive cell positions, and closing a sequence's holes: after an eviction cycle (``kvagent.eviction``)
removed cells, the kept ones are renumbered ``0..k-1`` in order, one ``seq_add`` per run (llama.cpp re-rotates their
keys, its K-shift), so that a token's cell is its position less the evicted positions before it.
"""

from __future__ import annotations

from typing import Sequence

from kvagent.backends.base import Backend


def position_runs(positions: list[int]) -> list[tuple[int, int]]:
    """Ascending positions -> inclusive ``(first, last)`` runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


def compact_positions(backend: Backend, seq: int, kept: Sequence[int]) -> int:
    """Renumber ``seq``'s cells at ``kept`` (ascending) to ``0..len(kept)-1`` in order, one ``seq_add`` per run of
    consecutive positions (llama.cpp re-rotates the keys at the next decode); returns ``len(kept)``, the position the
    next token takes. ``seq`` must hold its own cells: a shift moves a shared cell for every sequence holding it."""
    at = 0
    for first, last in position_runs(list(kept)):
        if first != at:
            backend.seq_add(seq, first, last + 1, at - first)
        at += last - first + 1
    return at


__all__ = ["compact_positions", "position_runs"]
