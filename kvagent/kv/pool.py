"""SequencePool: the backend's sequences, who holds them, and which cells they share.

The pool owns the backend's sequence ids (a free list), lends scratch sequences for KV surgery, keeps
the :class:`PrefixIndex` of every live sequence's shareable prefix, and records which sequences share
cells (``seq_cp`` in a unified KV pool shares cells instead of copying them: a shift of one sharer moves
the others' too). ``lock`` serialises every native call on the backend; whoever calls the
backend directly (benchmarks, tests) takes it.

Invariant: a sequence id is either free (empty in the backend) or held by exactly one owner.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

from kvagent.backends.base import Backend, RopeLayout
from kvagent.errors import KVAgentError
from kvagent.kv.prefix import PrefixIndex
from kvagent.kv.rotate import MoveCollision, shift_saved

log = logging.getLogger(__name__)
_UNSET = object()


class SequencePool:
    """Sequence ids of one backend: take / release, scratch sequences, the prefix index, shared cells."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.lock = threading.RLock()
        self.index = PrefixIndex()
        self._free = list(range(backend.n_seq_max - 1, -1, -1))
        self._held: set[int] = set()
        # (a, b) with a < b -> cells at positions < upto are shared by both sequences
        self._shared: dict[tuple[int, int], int] = {}
        self._rope: RopeLayout | None | object = _UNSET  # the backend's, asked once (moved_state)

    # -- ids --------------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """How many sequences are free now."""
        return len(self._free)

    @property
    def held(self) -> int:
        return len(self._held)

    def take(self, purpose: str) -> int:
        """A free sequence id, emptied; refused with the fix when every sequence is in use."""
        with self.lock:
            if not self._free:
                raise KVAgentError(
                    f"no free sequence for {purpose}: all {self.backend.n_seq_max} are in use; close a session or "
                    "load the engine with a larger n_seq_max"
                )
            seq = self._free.pop()
            self.backend.seq_rm(seq, -1, -1)
            self._held.add(seq)
            return seq

    def release(self, seq: int) -> None:
        """Empty ``seq`` and make it free again (idempotent)."""
        with self.lock:
            if seq not in self._held:
                return
            self.index.remove(seq)
            self.cut(seq, 0)
            self.backend.seq_rm(seq, -1, -1)
            self._held.discard(seq)
            self._free.append(seq)

    @contextmanager
    def scratch(self) -> Iterator[int]:
        """A temporary sequence (for splicing KV left to right), emptied and freed on exit."""
        with self.lock:
            seq = self.take("a scratch copy")
            try:
                yield seq
            finally:
                self.release(seq)

    def moved_state(self, payload: bytes | bytearray, start: int, delta: int, *,
                    in_place: bool = False) -> bytearray | None:
        """``payload`` (a saved sequence) with its cells from position ``start`` on moved by ``delta`` and their
        keys re-rotated in the bytes (``kvagent.kv.rotate``; ``in_place``: a bytearray the caller owns, rewritten
        where it lies); None where the backend's RoPE is not known, a move back would land on kept cells, or the
        bytes are not in the layout it expects (the caller then uses ``seq_add``; an ``in_place`` payload may then
        be partly rewritten: save again)."""
        if self._rope is _UNSET:
            self._rope = self.backend.rope_layout()
        if self._rope is None:
            return None
        try:
            return shift_saved(payload, start, delta, self._rope, in_place=in_place)
        except MoveCollision:  # this payload only: the layout is fine
            return None
        except ValueError as exc:
            log.warning("re-rotating a saved sequence in its bytes failed (%s): shifting it with seq_add", exc)
            self._rope = None
            return None

    def prefill_saved(self, tokens: Sequence[int]) -> bytes:
        """``tokens`` decoded at positions ``0..n-1`` in a scratch sequence, saved (``seq_save``): a compiled
        skill's blob payload."""
        with self.lock, self.scratch() as seq:
            n = len(tokens)
            self.backend.decode(tokens, range(n), [seq] * n, [False] * n)
            return self.backend.seq_save(seq)

    # -- shared cells -----------------------------------------------------------------------------
    def share(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``seq_cp`` of ``src``'s cells ``[p0, p1)`` into ``dst``, recording that both now hold them."""
        with self.lock:
            self.backend.seq_cp(src, dst, p0, p1)
            self._note(src, dst, p1)
            for (a, b), upto in list(self._shared.items()):  # dst now also shares what src shares
                other = b if a == src else a if b == src else -1
                if other >= 0 and other != dst:
                    self._note(other, dst, min(upto, p1))

    def shares_beyond(self, seq: int, position: int) -> bool:
        """Whether another sequence may hold ``seq``'s cells at ``position`` or later (conservative)."""
        return any(upto > position and seq in pair for pair, upto in self._shared.items())

    def shared_upto(self, a: int, b: int) -> int:
        """Sequences ``a`` and ``b`` share their cells at positions below this (0: none)."""
        return self._shared.get((min(a, b), max(a, b)), 0)

    def cut(self, seq: int, position: int) -> None:
        """``seq`` dropped its cells from ``position`` on: it shares nothing from there."""
        for pair, upto in list(self._shared.items()):
            if seq in pair:
                if position <= 0:
                    del self._shared[pair]
                elif upto > position:
                    self._shared[pair] = position

    def _note(self, a: int, b: int, upto: int) -> None:
        pair = (min(a, b), max(a, b))
        self._shared[pair] = max(self._shared.get(pair, 0), upto)
