"""CachedSequence: one backend sequence and exactly what it caches.

Invariant (checked by the integration tests against the backend): the sequence holds a cell for every
position ``0..len(tokens)-1`` except ``evicted``, each computed from ``tokens``; ``logits`` are the
next-token logits after the last position, or None when unknown. ``stale`` positions hold KV computed
before an upstream edit (field-only / selective splices). ``floor``: on sliding-window models whose backend
drops cells behind the window (``Capabilities.swa_keeps_all`` false: llama.cpp without kvagent's patch) a
restored or transplanted cache lacks the SWA cells outside the window, so the cache may not be cut below ``floor``
and extended again (a cut below it recomputes from 0). Every change of those fields goes through this
class, which also keeps the pool's prefix index and shared-cell record in step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvagent.kv.pool import SequencePool
from kvagent.kv.steps import PAUSE, Work
from kvagent.segments import Rendered

if TYPE_CHECKING:
    from kvagent.eviction import CycleReport, Evictor

log = logging.getLogger(__name__)


class CachedSequence:
    """The KV state of one sequence id of ``pool``; ``chunk`` bounds the tokens decoded between pauses."""

    def __init__(self, pool: SequencePool, seq: int, *, evictor: Evictor | None = None, chunk: int = 64) -> None:
        self.pool = pool
        self.backend = pool.backend
        self.seq = seq
        self.evictor = evictor
        self.chunk = max(1, chunk)
        self.tokens: tuple[int, ...] = ()
        self.logits: np.ndarray | None = None
        self.stale: frozenset[int] = frozenset()
        self.evicted: frozenset[int] = frozenset()
        self.floor = 0

    # -- reading ----------------------------------------------------------------------------------
    @property
    def cells(self) -> int:
        return len(self.tokens) - len(self.evicted)

    @property
    def cached_positions(self) -> tuple[int, ...]:
        return tuple(p for p in range(len(self.tokens)) if p not in self.evicted)

    @property
    def clean_prefix(self) -> int:
        """Length of the prefix other sequences may share: no stale or evicted cell, no missing window."""
        if self.floor:
            return 0
        dirty = self.stale | self.evicted
        return min(dirty) if dirty else len(self.tokens)

    @property
    def batchable(self) -> bool:
        """Whether this sequence's decode steps may share a batch (not when eviction records hidden states)."""
        return self.evictor is None or not self.evictor.policy.needs_hidden

    # -- changing ---------------------------------------------------------------------------------
    def cut(self, position: int) -> None:
        """Remove every cell from ``position`` on, and what was recorded about them."""
        self.backend.seq_rm(self.seq, position, -1)
        self.pool.cut(self.seq, position)
        self.tokens, self.logits = self.tokens[:position], None
        self.stale = frozenset(p for p in self.stale if p < position)
        if self.evicted:
            self.evicted = frozenset(p for p in self.evicted if p < position)
        if position == 0:
            self.floor = 0
        if self.evictor is not None:
            self.evictor.forget_from(position)
        if len(self.pool.index.indexed(self.seq)) > position:
            self.pool.index.insert(self.seq, self.tokens[: self.clean_prefix])

    def share_from(self, src: int, upto: int) -> None:
        """Take ``src``'s cells for positions ``len(tokens)..upto-1`` (shared, not copied); tokens must agree."""
        self.pool.share(src, self.seq, len(self.tokens), upto)

    def decode_run(self, tokens: Sequence[int], first: int, end: int, rendered: Rendered) -> Work[np.ndarray]:
        """Decode ``tokens[first:end]`` at their positions, pausing every ``chunk`` tokens.

        Returns the logits of the last token when it ends ``tokens`` (``[1, n_vocab]``), else ``[0,
        n_vocab]``. With an eviction policy a cycle runs whenever one falls due, so the cells never exceed
        budget + chunk. ``self.tokens`` follows each chunk, so a failure leaves it exact.
        """
        want_last = end == len(tokens)
        ev = self.evictor
        logits = np.zeros((0, self.backend.n_vocab), np.float32)
        s = first
        while s < end:
            e = min(end, s + self.chunk)
            if ev is not None:  # a chunk stops where a cycle falls due
                e = min(e, s + ev.chunk, s + max(ev.budget + ev.chunk - self.cells, 1))
            outputs = [False] * (e - s - 1) + [want_last and e == end]
            logits = self._decode(tokens[s:e], range(s, e), outputs)
            self.tokens = tuple(tokens[:e])
            self.maybe_cycle(rendered)
            s = e
            if s < end:
                yield PAUSE
        return logits

    def _decode(self, tokens: Sequence[int], positions: Sequence[int], outputs: Sequence[bool]) -> np.ndarray:
        if self.evictor is not None:
            return self.evictor.decode(tokens, positions, self.seq, outputs)
        return self.backend.decode(tokens, positions, [self.seq] * len(tokens), outputs)

    def decode_token(self, token: int, rendered: Rendered) -> np.ndarray:
        """Decode one token at the next position alone (sequences that cannot share a batch)."""
        logits = self._decode([token], [len(self.tokens)], [True])[0]
        self.append(token, logits, rendered)
        return logits

    def append(self, token: int, logits: np.ndarray, rendered: Rendered) -> None:
        """Record ``token`` as decoded at the next position with its ``logits`` (``[n_vocab]``)."""
        self.tokens = (*self.tokens, token)
        self.logits = logits
        self.maybe_cycle(rendered)

    def maybe_cycle(self, rendered: Rendered) -> CycleReport | None:
        """Run an eviction cycle when one is due; pinned spans of ``rendered`` are never evicted, and spans of a
        lower priority go before those of a higher one."""
        ev = self.evictor
        if ev is None or not ev.due(self.cells):
            return None
        pinned_at = {p for span in rendered.spans if span.pinned for p in range(span.first, span.last + 1)}
        priority_at = {p: span.priority for span in rendered.spans if span.priority for p in range(span.first, span.last + 1)}
        positions = self.cached_positions
        report = ev.cycle(self.seq, [self.tokens[p] for p in positions], positions, [p in pinned_at for p in positions],
                          [priority_at.get(p, 0) for p in positions] if priority_at else None)
        self.evicted = self.evicted | frozenset(report.evicted)
        self.publish()
        return report

    def publish(self) -> None:
        """Index this sequence's clean prefix so other sessions can start from it."""
        self.pool.index.insert(self.seq, self.tokens[: self.clean_prefix])

    def resync_from_backend(self, tokens: Sequence[int]) -> None:
        """After a failed decode: record exactly the prefix of ``tokens`` the backend now holds."""
        _, pos_max = self.backend.seq_pos_range(self.seq)
        self.tokens, self.logits = tuple(tokens[: pos_max + 1]), None
        self.publish()

    # -- save / restore ---------------------------------------------------------------------------
    def save(self) -> bytes:
        return self.backend.seq_save(self.seq)

    def restore(self, payload: bytes, tokens: tuple[int, ...], logits: np.ndarray | None,
                evicted: frozenset[int] = frozenset()) -> None:
        """Replace the cache by saved bytes holding ``tokens`` less the ``evicted`` positions (checked by
        the caller against the backend's cells)."""
        self.pool.cut(self.seq, 0)
        try:
            self.backend.seq_restore(self.seq, payload)
        except Exception:  # llama.cpp empties the sequence before it refuses: record that
            self.tokens, self.logits, self.evicted, self.stale, self.floor = (), None, frozenset(), frozenset(), 0
            self.publish()
            raise
        self.tokens, self.logits = tokens, logits
        self.evicted, self.stale = frozenset(evicted), frozenset()
        if self.evictor is not None:
            self.evictor.forget_from(0)  # restored cells come without captured hidden states
        keeps_all = self.backend.capabilities.swa_keeps_all  # always true without sliding-window layers
        self.floor = len(tokens) if not keeps_all and len(tokens) > self.backend.n_swa else 0
        self.publish()
