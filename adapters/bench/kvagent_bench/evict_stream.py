"""One sequence fed in chunks with eviction cycles, for the eviction benchmark (``kvagent bench evict``).

A :class:`Stream` drives an :class:`~kvagent.eviction.Evictor` the way a session does (decode ``chunk``
tokens, prune to the budget once a cycle is due) but lets the benchmark read every row of logits and pin
chosen positions. Every policy sees the same cells until its first cycle, so that prefix is decoded once
(:meth:`Stream.fork`): the fork gets the cells by ``seq_cp`` and the recorded hidden states by
:meth:`~kvagent.eviction.Evictor.adopt`, and then behaves as a stream that decoded them itself.

Invariant: ``tokens`` holds exactly the positions the sequence caches (with their tokens), ``next_pos`` is
the position the next token is decoded at, and ``pinned`` lists positions no cycle may evict. With an evictor
whose ``Eviction(compact=True)``, the stream compacts as a session does: after each cycle the kept cells move to
``0..k-1`` (its own copy of them first, at its first compaction: a fork shares its cells), ``cell`` maps each
cached position to where llama.cpp holds it and ``next_cell`` is where the next token goes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def prefix_length(budget: int, chunk: int, total: int) -> int:
    """How many of ``total`` prompt tokens a :class:`Stream` decodes before its first cycle: the first token,
    then whole chunks until ``budget + chunk`` cells are cached (or the prompt ends)."""
    return min(1 + chunk * math.ceil(max(budget + chunk - 1, 0) / chunk), total)


def greedy(backend: Any, logits: np.ndarray) -> int:
    """The most likely token of one row of logits that does not end generation (timed runs go on)."""
    token = int(np.argmax(logits))
    if not backend.is_eog(token):
        return token
    masked = np.array(logits, dtype=np.float32, copy=True)
    while backend.is_eog(token) and np.isfinite(masked[token]):
        masked[token] = -np.inf
        token = int(np.argmax(masked))
    return token


class Stream:
    """One sequence fed in chunks; ``evictor=None`` is the full cache. ``cycles=False`` records (decodes
    through the evictor, capturing what its policy needs) but never prunes: the shared prefix."""

    def __init__(self, backend: Any, seq: int, evictor: Any, chunk: int, cycles: bool = True) -> None:
        self.backend, self.seq, self.evictor, self.chunk, self.cycles = backend, seq, evictor, chunk, cycles
        self.tokens: dict[int, int] = {}
        self.pinned: set[int] = set()
        self.labels: dict[int, str] = {}  # segment label per position (per-segment budgets); "" where unknown
        self.cycle_ms: list[float] = []
        self.kept: list[tuple[int, ...]] = []  # the positions left after each cycle
        self.next_pos = 0
        self.cell: dict[int, int] = {}  # cached position -> its cell (the position itself until a compaction)
        self.next_cell = 0
        self._owned = True  # the cells are this sequence's alone (a fork's are shared until it copies them)

    def feed(self, ids: list[int], outputs: bool, pin: bool = False) -> np.ndarray:
        """Decode ``ids`` after what was fed, ``chunk`` at a time, each chunk followed by a cycle when one is
        due; returns the logits of every token (``outputs``) or of the last one (``[1, n_vocab]``)."""
        rows = []
        for s in range(0, len(ids), self.chunk):
            part = ids[s : s + self.chunk]
            pos = list(range(self.next_pos, self.next_pos + len(part)))
            at = list(range(self.next_cell, self.next_cell + len(part)))
            flags = [outputs] * (len(part) - 1) + [True]
            if self.evictor is not None:
                logits = self.evictor.decode(part, pos, [self.seq] * len(part), flags, cells=None if at == pos else at)
            else:
                logits = self.backend.decode(part, at, [self.seq] * len(part), flags)
            rows.append(logits)
            self.tokens.update(zip(pos, part))
            self.cell.update(zip(pos, at))
            if pin:
                self.pinned.update(pos)
            self.next_pos += len(part)
            self.next_cell += len(part)
            self.cycle_if_due()
        return np.vstack(rows) if outputs else rows[-1][-1:]

    def cycle_if_due(self) -> None:
        """Run the evictor's cycle if one is due (never for the full cache or a recording stream)."""
        if self.evictor is None or not self.cycles or not self.evictor.due(len(self.tokens)):
            return
        cells = sorted(self.tokens)
        at = [self.cell[p] for p in cells]
        report = self.evictor.cycle(self.seq, [self.tokens[p] for p in cells], cells, [p in self.pinned for p in cells],
                                    labels=[self.labels.get(p, "") for p in cells], cells=None if at == cells else at)
        for p in report.evicted:
            del self.tokens[p]
            del self.cell[p]
        if self.evictor.config.compact and report.evicted and self.backend.capabilities.shift:
            from kvagent.kv.compact import compact_positions

            if not self._owned:  # a shift would move the cells for every sequence sharing them
                self.backend.seq_restore(self.seq, self.backend.seq_save(self.seq))
                self._owned = True
            kept = sorted(self.tokens)
            self.next_cell = compact_positions(self.backend, self.seq, [self.cell[p] for p in kept])
            self.cell = {p: i for i, p in enumerate(kept)}
        self.cycle_ms.append(report.cycle_ms)
        self.kept.append(tuple(sorted(self.tokens)))

    def fork(self, seq: int, evictor: Any) -> Stream:
        """A stream on the empty sequence ``seq`` holding this one's cells (``seq_cp``, shared cells) and
        what its evictor recorded, run by ``evictor``; the cycle due at this point (if any) runs at once, as
        it would have after the last chunk in a stream that decoded the prefix itself."""
        self.backend.seq_cp(self.seq, seq, 0, -1)
        if self.evictor is not None:
            evictor.adopt(self.evictor)
        other = Stream(self.backend, seq, evictor, self.chunk)
        other.tokens, other.pinned, other.next_pos = dict(self.tokens), set(self.pinned), self.next_pos
        other.cell, other.next_cell, other._owned = dict(self.cell), self.next_cell, False
        other.labels = self.labels
        other.cycle_if_due()
        return other
