"""CachedSequence: one backend sequence and exactly what it caches.

Invariant (checked by the integration tests against the backend): the sequence holds a cell for every
position ``0..len(tokens)-1`` except ``evicted``, each computed from ``tokens``, at :meth:`cell` of its position
(the position itself, less the ``closed`` evicted positions before it: holes an ``Eviction(compact=True)`` cycle
moved the later cells into); ``logits`` are the next-token logits after the last position, or None when unknown. ``stale`` positions hold KV computed
before an upstream edit (field-only / selective splices). ``floor``: on sliding-window models whose backend
drops cells behind the window (``Capabilities.swa_keeps_all`` false: llama.cpp without kvagent's patch) a
restored or transplanted cache lacks the SWA cells outside the window, so the cache may not be cut below ``floor``
and extended again (a cut below it recomputes from 0).

This class is the one owner of those fields: they are read-only properties, and every change goes through
one of its verbs (``cut``, ``share_prefix``, ``decode_run``, ``extend_decoded``, ``place_transplant``,
``redecode_last``, ``commit``, ``adopt``, ``adopt_recompute``, ``mark_stale``, ``append``, ``restore``), which also
keep the pool's prefix index and shared-cell record in step. Only these verbs call the backend on the
sequence; scratch sequences lent by ``SequencePool.scratch`` belong to whoever borrowed them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvagent.errors import DecodeAborted, KVAgentError
from kvagent.kv.compact import compact_positions
from kvagent.kv.pool import Retained, SequencePool
from kvagent.kv.work import PAUSE, Work
from kvagent.segments import Rendered

if TYPE_CHECKING:
    from kvagent.backends.base import Backend
    from kvagent.eviction import CycleReport, Evictor

log = logging.getLogger(__name__)


class CachedSequence:
    """The KV state of one sequence id of ``pool``; ``chunk`` bounds the tokens decoded between pauses, and
    ``alone_chunk`` (when set) those decoded while ``alone()`` says no other work waits (a first prefill at the
    engine's speed: larger batches use the CPU better). Such a chunk is decoded preemptible (the backend's
    ``preemptible()``): work that arrives meanwhile aborts it, and the prefill goes on in usual chunks, so a
    short request never waits behind it. The caller enables this only on a backend that can preempt."""

    def __init__(self, pool: SequencePool, seq: int, *, evictor: Evictor | None = None, chunk: int = 64,
                 scope: str = "", alone_chunk: int | None = None, alone: Callable[[], bool] | None = None) -> None:
        self.pool = pool
        self.scope = scope
        """The prefix index scope (a tenant): this sequence's prefix is found only by sessions of the same scope."""
        self.backend = pool.backend
        self.seq = seq
        self.evictor = evictor
        self.chunk = max(1, chunk)
        self.alone_chunk = max(self.chunk, alone_chunk) if alone_chunk and alone is not None else None
        self._alone = alone
        self.preempted = 0  # larger chunks given up because other work arrived (for tests and benchmarks)
        self._tokens: tuple[int, ...] = ()
        self._logits: np.ndarray | None = None
        self._stale: frozenset[int] = frozenset()
        self._evicted: frozenset[int] = frozenset()
        self._closed: frozenset[int] = frozenset()  # evicted positions whose holes later cells were moved into
        self._holes = np.zeros(0, dtype=np.int64)  # sorted(self._closed), for cell()
        self._floor = 0
        self._restored = False  # cells loaded from saved bytes: never published until the cache is cut to 0

    # -- reading ----------------------------------------------------------------------------------
    tokens = property(lambda self: self._tokens, doc="Token ids of positions 0..len-1 (evicted ones included).")
    logits = property(lambda self: self._logits, doc="Next-token logits ``[n_vocab]`` after the last position, or None.")
    stale = property(lambda self: self._stale, doc="Positions whose KV predates an upstream splice.")
    evicted = property(lambda self: self._evicted, doc="Positions an eviction cycle removed.")
    closed = property(lambda self: self._closed, doc="Evicted positions whose holes later cells were moved into.")
    floor = property(lambda self: self._floor, doc="The cache may not be cut below this and extended (0: anywhere).")

    @property
    def cells(self) -> int:
        return len(self._tokens) - len(self._evicted)

    def cell(self, position: int) -> int:
        """Where llama.cpp holds (or will hold) ``position``: the position less the closed holes before it."""
        return position - int(np.searchsorted(self._holes, position)) if self._holes.size else position

    def cells_at(self, positions: Sequence[int]) -> list[int]:
        """:meth:`cell` of each of ``positions``."""
        if not self._holes.size:
            return list(positions)
        pos = np.asarray(positions, dtype=np.int64)
        return (pos - np.searchsorted(self._holes, pos)).tolist()

    def _set_evicted(self, evicted: frozenset[int], closed: frozenset[int]) -> None:
        self._evicted, self._closed = evicted, closed
        self._holes = np.array(sorted(closed), dtype=np.int64)

    @property
    def cached_positions(self) -> tuple[int, ...]:
        return tuple(p for p in range(len(self._tokens)) if p not in self._evicted)

    @property
    def clean_prefix(self) -> int:
        """Length of the prefix other sequences may share: no stale or evicted cell, no missing window."""
        if self._floor:
            return 0
        dirty = self._stale | self._evicted
        return min(dirty) if dirty else len(self._tokens)

    @property
    def shareable(self) -> int:
        """Length of the prefix this sequence publishes to its scope of the index: the clean prefix, or nothing
        while it holds cells restored from saved bytes (``restore(share=False)``): bytes that came from outside
        are never shared with another session."""
        return 0 if self._restored else self.clean_prefix

    @property
    def restored(self) -> bool:
        """Whether the cache holds cells restored from saved bytes without ``share`` (kept out of the index)."""
        return self._restored

    @property
    def batchable(self) -> bool:
        """Whether this sequence's decode steps may share a batch (not when eviction records hidden states)."""
        return self.evictor is None or not self.evictor.policy.needs_hidden

    # -- cutting and sharing ----------------------------------------------------------------------
    def cut(self, position: int) -> None:
        """Remove every cell from ``position`` on, and what was recorded about them."""
        at = self.cell(position)
        self.backend.seq_rm(self.seq, at, -1)
        self.pool.cut(self.seq, at)
        self._tokens, self._logits = self._tokens[:position], None
        self._stale = frozenset(p for p in self._stale if p < position)
        if self._evicted:
            self._set_evicted(frozenset(p for p in self._evicted if p < position),
                              frozenset(p for p in self._closed if p < position))
        if position == 0:
            self._floor = 0
            self._restored = False
        if self.evictor is not None:
            self.evictor.forget_from(position)
        if len(self.pool.index.indexed(self.seq)) > position:
            self.publish()

    def share_prefix(self, src: int, tokens: Sequence[int]) -> None:
        """Hold ``tokens`` by taking ``src``'s cells for positions ``len(self.tokens)..len(tokens)-1`` (shared, not
        copied). ``src`` must hold exactly those tokens there, and ``tokens`` must extend ``self.tokens``."""
        self.pool.share(src, self.seq, self.cell(len(self._tokens)), self.cell(len(tokens)))
        self._tokens, self._logits = tuple(tokens), None

    def adopt(self, retained: Retained, length: int) -> None:
        """Take ``retained``'s cells (this sequence caches nothing yet) and keep its first ``length`` tokens: the
        cells change owner, nothing is computed (``SequencePool.adopt``)."""
        if self._tokens:
            raise KVAgentError("adopt: this sequence already caches tokens (internal error)")
        self.pool.adopt(retained, self.seq)
        self._tokens, self._logits, self._stale = retained.tokens, None, retained.stale
        if length < len(self._tokens):
            self.cut(length)
        self.publish()

    def retain(self, memo: object = None) -> None:
        """This sequence's owner is done: the pool keeps its cells for reuse (``SequencePool.retain``) with ``memo``
        (what a later owner resumes from), or frees them. Evicted holes and what follows them are not kept, nor are
        cells restored from bytes that came from outside (they are never shared)."""
        if self._restored or self._floor:
            self.pool.release(self.seq)
            return
        keep = self._tokens[:min(self._evicted)] if self._evicted else self._tokens
        self.pool.retain(self.seq, keep, self.scope, stale=frozenset(p for p in self._stale if p < len(keep)),
                         memo=memo if len(keep) == len(self._tokens) else None)

    def adopt_recompute(self, src: int, start: int, logits: np.ndarray) -> None:
        """Replace the cells from ``start`` on by ``src``'s (a recompute of the same tokens in a scratch sequence,
        which holds every position): they are shared, and ``logits`` are the recompute's. Not after a cycle closed
        holes (the recompute's cells sit at the positions themselves)."""
        if self._closed:
            raise KVAgentError("a compacted cache cannot adopt a recompute's cells (internal error)")
        self.backend.seq_rm(self.seq, start, -1)
        self.pool.cut(self.seq, start)
        self.pool.share(src, self.seq, start, len(self._tokens))
        self._stale = frozenset(p for p in self._stale if p < start)
        self._logits = logits

    # -- decoding ---------------------------------------------------------------------------------
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
            big = self._big_chunk()
            e = min(end, s + (big or self.chunk))
            if ev is not None:  # a chunk stops where a cycle falls due
                e = min(e, s + ev.chunk, s + max(ev.budget + ev.chunk - self.cells, 1))
            outputs = [False] * (e - s - 1) + [want_last and e == end]
            if big:
                try:
                    with self.backend.preemptible():  # type: ignore[attr-defined]
                        logits = self._decode(tokens[s:e], range(s, e), outputs)
                except DecodeAborted:
                    # other work arrived: llama.cpp removed this chunk's positions; let it run, then go on in
                    # usual chunks (the sequence holds tokens[:s], as self.tokens says)
                    log.debug("seq %d: a %d-token prefill chunk was preempted at position %d", self.seq, e - s, s)
                    self.preempted += 1
                    yield PAUSE
                    continue
            else:
                logits = self._decode(tokens[s:e], range(s, e), outputs)
            self._tokens, self._logits = tuple(tokens[:e]), None
            self.maybe_cycle(rendered)
            s = e
            if s < end:
                yield PAUSE
        return logits

    def _big_chunk(self) -> int | None:
        """The larger chunk when it applies: set, nothing else waits, and no evictor records the decode (an
        aborted decode would leave its records half-written)."""
        if self.alone_chunk is not None and self.evictor is None and self._alone is not None and self._alone():
            return self.alone_chunk
        return None

    def extend_decoded(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens[len(self.tokens):]`` at their positions in one call, without logits, pauses or an
        eviction cycle (a splice rebuilding the sequence left to right while it holds a scratch)."""
        first = len(self._tokens)
        self._decode(tokens[first:], range(first, len(tokens)), [False] * (len(tokens) - first))
        self._tokens, self._logits = tuple(tokens), None

    def redecode_last(self) -> np.ndarray:
        """Decode the last position again, for its logits (a prompt that ends inside a transplanted skill:
        the copied cells come without logits); returns them ``[n_vocab]``."""
        last = len(self._tokens) - 1
        self.backend.seq_rm(self.seq, self.cell(last), -1)
        self._logits = self._decode([self._tokens[last]], [last], [True])[0]
        return self._logits

    def decode_token(self, token: int, rendered: Rendered) -> np.ndarray:
        """Decode one token at the next position alone (sequences that cannot share a batch)."""
        logits = self._decode([token], [len(self._tokens)], [True])[0]
        self.append(token, logits, rendered)
        return logits

    def append(self, token: int, logits: np.ndarray, rendered: Rendered) -> None:
        """Record ``token`` as decoded at the next position with its ``logits`` (``[n_vocab]``)."""
        self._tokens = (*self._tokens, token)
        self._logits = logits
        self.maybe_cycle(rendered)

    def _decode(self, tokens: Sequence[int], positions: Sequence[int], outputs: Sequence[bool]) -> np.ndarray:
        """Decode at ``positions``, held at their cells; through the evictor when there is one (it records hidden
        states on the way, by position)."""
        seqs = [self.seq] * len(tokens)
        cells = self.cells_at(positions) if self._holes.size else None
        if self.evictor is not None:
            return self.evictor.decode(tokens, positions, seqs, outputs, cells=cells)
        return self.backend.decode(tokens, positions if cells is None else cells, seqs, outputs)

    # -- transplants ------------------------------------------------------------------------------
    def place_transplant(self, payload: bytes, tokens: Sequence[int], n_sink: int, seam: int, rendered: Rendered,
                         recompute: Sequence[int] = ()) -> tuple[int, int]:
        """Append a compiled skill: its saved sequence ``payload`` holds ``n_sink`` sink tokens then ``tokens``.

        The first ``seam`` tokens are decoded fresh in context (seam repair), and so are the skill's positions
        ``recompute`` (offsets into ``tokens``: a selective recompute of the cells that deviate most from a cold
        prefill, CacheBlend's); the saved sequence is restored into a scratch sequence (its own cells), the sink
        cells removed, the rest shifted by the RoPE re-rotation ``position - n_sink``, and the span is built left
        to right (llama.cpp takes a sequence's new tokens only at ``pos_max + 1``): runs of copied cells shared
        into this sequence, fresh positions decoded in between (attending to the copied cells before them).
        The re-rotation is done on the saved bytes before the restore where the pool can
        (``SequencePool.moved_state``): ``seq_add`` would leave a K-shift that llama.cpp applies to the whole KV
        buffer at the next decode, once per skill. Returns (tokens decoded fresh, cells copied). An eviction
        cycle may run after it.
        """
        position, length = len(self._tokens), len(tokens)
        at = self.cell(position)  # where the skill's first token goes in llama.cpp (a compacted cache: below position)
        seam = min(seam, length)
        full = (*self._tokens, *tokens)
        fresh = [False] * length
        for i in (*range(seam), *recompute):
            if 0 <= i < length:
                fresh[i] = True
        n_fresh = sum(fresh)
        if n_fresh == length:
            self.extend_decoded(full)
        else:
            if seam:  # decoded before the scratch takes its cells (the cell layout of a transplant without recompute)
                self.extend_decoded(full[: position + seam])
            backend = self.backend
            moved = self.pool.moved_state(payload, n_sink + seam, at - n_sink)
            with self.pool.scratch() as scratch:
                backend.seq_restore(scratch, payload if moved is None else moved)
                backend.seq_rm(scratch, 0, n_sink + seam)  # the sink's and the seam's cells never travel
                if moved is None:
                    backend.seq_add(scratch, n_sink + seam, -1, at - n_sink)
                i = seam
                while i < length:
                    end = i
                    while end < length and fresh[end] == fresh[i]:
                        end += 1
                    if fresh[i]:
                        self.extend_decoded(full[: position + end])
                    else:
                        self.share_prefix(scratch, full[: position + end])
                    i = end
        if not self.backend.capabilities.swa_keeps_all and length - seam + n_sink > self.backend.n_swa:
            self._floor = max(self._floor, position + length)  # unpatched llama.cpp: the middle SWA cells did not travel
        self._tokens, self._logits = full, None
        self.maybe_cycle(rendered)
        return n_fresh, length - n_fresh

    # -- settling ---------------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int], logits: np.ndarray) -> None:
        """The sequence is at rest after a sync: it holds ``tokens`` (what its runs decoded, shared and
        transplanted) and ``logits`` follow the last one. Publishes the clean prefix for other sessions."""
        if tuple(tokens) != self._tokens:
            raise KVAgentError(f"sequence {self.seq} holds {len(self._tokens)} tokens that differ from the "
                               f"{len(tokens)} committed (internal error)")
        self._logits = logits
        self.publish()

    def mark_stale(self, tokens: Sequence[int], kept: frozenset[int]) -> None:
        """After a splice: the sequence holds ``tokens``, whose positions ``kept`` kept KV computed before the
        edit (stale); logits are unknown until the next sync."""
        self._tokens, self._logits = tuple(tokens), None
        self._stale = self._stale | kept
        self.publish()

    def maybe_cycle(self, rendered: Rendered) -> CycleReport | None:
        """Run an eviction cycle when one is due; pinned spans of ``rendered`` are never evicted, and spans of a
        lower priority go before those of a higher one."""
        ev = self.evictor
        if ev is None or not ev.due(self.cells):
            return None
        pinned_at = {p for span in rendered.spans if span.pinned for p in range(span.first, span.last + 1)}
        priority_at = {p: span.priority for span in rendered.spans if span.priority for p in range(span.first, span.last + 1)}
        label_at = {p: span.label for span in rendered.spans for p in range(span.first, span.last + 1)}
        positions = self.cached_positions
        cells = self.cells_at(positions)
        report = ev.cycle(self.seq, [self._tokens[p] for p in positions], positions, [p in pinned_at for p in positions],
                          [priority_at.get(p, 0) for p in positions] if priority_at else None,
                          [label_at.get(p, "") for p in positions], cells if self._holes.size else None)
        gone = frozenset(report.evicted)
        self._set_evicted(self._evicted | gone, self._closed)
        if ev.config.compact and gone and self.backend.capabilities.shift:
            self._compact([c for p, c in zip(positions, cells) if p not in gone])
        self.publish()
        return report

    def _compact(self, held: list[int]) -> None:
        """Move the cells ``held`` (every cell the sequence holds, ascending) to ``0..len(held)-1`` in order, so that
        every evicted position becomes a closed hole. A cell another sequence shares would move for it too: the
        sequence first takes its own copy of its cells (through a scratch sequence, so a refused copy loses nothing);
        without a free scratch or room for the copy, the holes stay open until a later cycle (logged)."""
        first = next((i for i, c in enumerate(held) if c != i), None)
        if first is not None:  # else nothing moves
            if self.pool.shares_beyond(self.seq, held[first]) and not self._own_cells():
                return
            compact_positions(self.backend, self.seq, held)
        self._set_evicted(self._evicted, self._evicted)

    def _own_cells(self) -> bool:
        """Replace this sequence's cells by its own copy of them (no other sequence shares them after); False when
        no scratch sequence is free or the copy was refused (nothing changed)."""
        if not self.pool.free:
            log.warning("seq %d: no free scratch sequence to copy shared cells into: its holes stay open", self.seq)
            return False
        data = self.backend.seq_save(self.seq)
        with self.pool.scratch() as copy:
            try:
                self.backend.seq_restore(copy, data)
            except Exception as exc:  # no room for the copy in the KV pool: the sequence is as it was
                log.warning("seq %d: copying its shared cells failed (%s): its holes stay open", self.seq, exc)
                return False
            self.backend.seq_rm(self.seq, -1, -1)
            self.pool.cut(self.seq, 0)
            self.backend.seq_cp(copy, self.seq, 0, -1)  # the scratch is emptied on exit: the cells are ours alone
        return True

    def publish(self) -> None:
        """Index this sequence's shareable prefix (:attr:`shareable`) in its scope, so other sessions of that
        scope can start from it."""
        self.pool.index.insert(self.seq, self._tokens[: self.shareable], self.scope)

    def resync_from_backend(self, tokens: Sequence[int]) -> None:
        """After a failed decode: record exactly the prefix of ``tokens`` the backend now holds."""
        _, cell_max = self.backend.seq_pos_range(self.seq)
        held = [p for p in range(len(tokens)) if p not in self._evicted]
        last = next((p for p in reversed(held) if self.cell(p) <= cell_max), -1)
        self._tokens, self._logits = tuple(tokens[: last + 1]), None
        self.publish()

    # -- save / restore ---------------------------------------------------------------------------
    def save(self) -> bytes:
        return self.backend.seq_save(self.seq)

    def restore(self, payload: bytes, tokens: tuple[int, ...], logits: np.ndarray | None,
                evicted: frozenset[int] = frozenset(), *, share: bool = False, recorded: bool = False,
                closed: frozenset[int] = frozenset()) -> None:
        """Replace the cache by saved bytes holding ``tokens`` less the ``evicted`` positions, at their cells after the
        ``closed`` holes (checked by the caller against the backend's cells). ``share``: the bytes are this process's own (a parked session
        it saved itself), so the prefix is published as usual; otherwise it is kept out of the prefix index
        until the cache is cut to 0. ``recorded``: the evictor already holds the state saved with these bytes
        (``Evictor.load_state``); otherwise it forgets what it recorded (the cells come without hidden states)."""
        self.pool.cut(self.seq, 0)
        try:
            self.backend.seq_restore(self.seq, payload)
        except Exception:  # llama.cpp empties the sequence before it refuses: record that
            self._tokens, self._logits, self._stale, self._floor = (), None, frozenset(), 0
            self._set_evicted(frozenset(), frozenset())
            self._restored = False
            if self.evictor is not None:
                self.evictor.forget_from(0)
            self.publish()
            raise
        self._restored = not share
        self._tokens, self._logits = tokens, logits
        self._set_evicted(frozenset(evicted), frozenset(closed) & frozenset(evicted))
        self._stale = frozenset()
        if self.evictor is not None and not recorded:
            self.evictor.forget_from(0)  # restored cells come without captured hidden states
        keeps_all = self.backend.capabilities.swa_keeps_all  # always true without sliding-window layers
        self._floor = len(tokens) if not keeps_all and len(tokens) > self.backend.n_swa else 0
        self.publish()

