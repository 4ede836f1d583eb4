"""SequencePool: the backend's sequences, who holds them, and which cells they share.

The pool owns the backend's sequence ids (a free list), lends scratch sequences for KV surgery, keeps
the :class:`PrefixIndex` of every live and retained sequence's shareable prefix, and records which sequences
share cells (``seq_cp`` in a unified KV pool shares cells instead of copying them: a shift of one sharer moves
the others' too). ``lock`` serialises every native call on the backend; whoever calls the
backend directly (benchmarks, tests) takes it.

**Retained sequences.** A closed session's sequence is not emptied: :meth:`retain` keeps its cells and its
indexed prefix, so a later session of the same scope starts from them (as vLLM's automatic prefix caching
keeps freed blocks and SGLang's radix cache keeps every prefix). Retained cells are only ever given back, never
competed for: the least recently used retained sequence is emptied when a sequence id is wanted and none is free
(:meth:`take`), and when the backend finds no room in the KV pool for a decode or a restore (the backend's
``reclaim`` hook, installed here). A live sequence's cells are never touched by that.

Invariant: a sequence id is either free (empty in the backend), held by exactly one owner, or retained (its cells
kept for reuse, owned by the pool).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from kvagent.backends.base import Backend, RopeLayout
from kvagent.errors import KVAgentError
from kvagent.kv.prefix import PrefixIndex
from kvagent.kv.rotate import MoveCollision, shift_saved
from kvagent.kv.tiers import Tier
from kvagent.kvblob import KVBlob

log = logging.getLogger(__name__)
_UNSET = object()
TIER_MIN_TOKENS = 64
"""A retained prefix shorter than this is not stored in the tiers (computing it again costs about as much)."""


@dataclass(frozen=True)
class Retained:
    """A closed sequence kept for reuse: its cached ``tokens`` (positions ``0..len-1``, every one held), the
    ``stale`` positions among them (KV kept across an upstream splice: fine for the conversation that made them,
    never indexed for another), its index ``scope``, and ``memo``: what its last owner left for a later one to
    resume from (a session's rendered prompt)."""

    seq: int
    tokens: tuple[int, ...]
    scope: str
    stale: frozenset[int] = frozenset()
    memo: Any = None


class SequencePool:
    """Sequence ids of one backend: take / release / retain, scratch sequences, the prefix index, shared cells.

    ``retain``: whether :meth:`retain` keeps a closed sequence's cells (False: it releases them)."""

    def __init__(self, backend: Backend, *, retain: bool = True, tiers: Tier | None = None,
                 fingerprint: str = "") -> None:
        self.backend = backend
        self.lock = threading.RLock()
        self.index = PrefixIndex()
        self.retains = retain
        self.tiers = tiers  # where a retained sequence's clean prefix goes when its cells are given back
        self.fingerprint = fingerprint  # the model's, in every blob a tier keeps
        self._free = list(range(backend.n_seq_max - 1, -1, -1))
        self._held: set[int] = set()
        self._retained: OrderedDict[int, Retained] = OrderedDict()  # least recently used first
        self.reclaimed = 0  # retained sequences given back (for tests, benchmarks and metrics)
        if hasattr(backend, "reclaim"):  # the backend asks before it refuses a decode or a restore for room
            backend.reclaim = self.reclaim
        # (a, b) with a < b -> cells at positions < upto are shared by both sequences
        self._shared: dict[tuple[int, int], int] = {}
        self._rope: RopeLayout | None | object = _UNSET  # the backend's, asked once (moved_state)

    # -- ids --------------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """How many sequences can be taken now: the free ones and the retained ones (given back on demand)."""
        return len(self._free) + len(self._retained)

    def can_take(self, *, excluding: int | None = None) -> bool:
        """Whether :meth:`take` would succeed without giving back the retained sequence ``excluding``."""
        with self.lock:
            return bool(self._free) or any(seq != excluding for seq in self._retained)

    @property
    def held(self) -> int:
        return len(self._held)

    def take(self, purpose: str) -> int:
        """A free sequence id, emptied; refused with the fix when every sequence is in use."""
        with self.lock:
            if not self._free:
                self.reclaim()
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

    def retain(self, seq: int, tokens: Sequence[int], scope: str, *, stale: frozenset[int] = frozenset(),
               memo: Any = None) -> None:
        """Keep held ``seq``'s cells of ``tokens`` (its cached positions ``0..len-1``, every one held; later cells
        are removed) for reuse after its owner is done, its indexed prefix staying in the index (see the module
        docstring), with ``memo`` for a later owner. Released instead when ``tokens`` is empty or the pool does not
        retain."""
        with self.lock:
            if seq not in self._held:
                return
            if not self.retains or not tokens:
                self.release(seq)
                return
            self._trim(seq, len(tokens))  # cells past them: never reused
            self._held.discard(seq)
            self._retained[seq] = Retained(seq, tuple(tokens), scope, frozenset(stale), memo)
            log.debug("seq %d retained: %d tokens", seq, len(tokens))

    @property
    def retained(self) -> tuple[Retained, ...]:
        """The retained sequences, least recently used first."""
        with self.lock:
            return tuple(self._retained.values())

    def touch(self, seq: int) -> None:
        """``seq``'s cells were reused: a retained sequence becomes the most recently used."""
        with self.lock:
            if seq in self._retained:
                self._retained.move_to_end(seq)

    def reclaim(self, *, store: bool = True) -> bool:
        """Empty the least recently used retained sequence and free its id, its clean prefix saved into the tiers
        first (``store``, where the pool has tiers); False when none is retained. Cells it shares with a live
        sequence stay (they are that sequence's)."""
        with self.lock:
            if not self._retained:
                return False
            seq, retained = self._retained.popitem(last=False)
            self._held.add(seq)
            if store and self.tiers is not None:
                self._store(seq, retained)
            self.release(seq)
            self.reclaimed += 1
            log.debug("retained seq %d given back", seq)
            return True

    def _store(self, seq: int, retained: Retained) -> None:
        """Save ``seq``'s clean prefix (what the index offers) into the tiers before its cells go."""
        n = len(self.index.indexed(seq))
        if n < TIER_MIN_TOKENS or not self.backend.capabilities.state_save:
            return
        self._trim(seq, n)
        self._put(seq, retained, n)

    def store_copy(self, retained: Retained) -> bool:
        """Save ``retained``'s clean prefix into the tiers while its cells stay where they are: before another prompt
        takes the conversation over, so that its own can come back to it. A conversation clean to its end is saved
        as it is; one with cells past its clean prefix, through a copy in a free sequence. False where there is no
        tier, too little to keep, or no free sequence for a copy."""
        with self.lock:
            n = len(self.index.indexed(retained.seq))
            if (self.tiers is None or n < TIER_MIN_TOKENS or not self.backend.capabilities.state_save
                    or self._retained.get(retained.seq) is not retained):
                return False
            if n == len(retained.tokens) and self.backend.seq_pos_range(retained.seq)[1] < n:
                return self._put(retained.seq, retained, n)
            if not self._free:
                return False
            seq = self.take("a copy for the tiers")
            try:
                self.share(retained.seq, seq, 0, n)
                return self._put(seq, retained, n)
            finally:
                self.release(seq)

    def _put(self, seq: int, retained: Retained, n: int) -> bool:
        """``seq``'s cells (``retained``'s first ``n`` tokens) as a checked blob into the tiers."""
        try:
            blob = KVBlob(self.fingerprint, self.backend.format, retained.tokens[:n], self.backend.seq_save(seq))
            self.tiers.put(blob.tokens, retained.scope, blob.to_bytes())  # type: ignore[union-attr]
            return True
        except Exception as exc:  # noqa: BLE001 - a tier is a cache: failing to fill it loses nothing live
            log.warning("retained seq %d could not be stored in the tiers (%s): dropped", retained.seq, exc)
            return False

    def _trim(self, seq: int, n: int) -> None:
        """Remove ``seq``'s cells at positions ``n`` and later (it shares nothing from there)."""
        if self.backend.seq_pos_range(seq)[1] >= n:
            self.backend.seq_rm(seq, n, -1)
            self.cut(seq, n)

    def clear_retained(self) -> int:
        """Give back every retained sequence, storing none in the tiers; returns how many."""
        with self.lock:
            n = 0
            while self.reclaim(store=False):
                n += 1
            return n

    def adopt(self, retained: Retained, seq: int) -> None:
        """Move ``retained``'s cells into held, empty ``seq`` (the cells change owner, nothing is copied or
        computed) and free the retained id."""
        with self.lock:
            if self._retained.get(retained.seq) is not retained or seq not in self._held:
                raise KVAgentError("adopt: the retained sequence was given back, or the target is not held "
                                   "(internal error)")
            del self._retained[retained.seq]
            self._held.add(retained.seq)
            self.share(retained.seq, seq, 0, len(retained.tokens))
            self.release(retained.seq)

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
            self.touch(src)
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
