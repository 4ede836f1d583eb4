"""Splice: rewrite one region's KV in place and keep the downstream KV (field-only and selective edits, implicit
edits of a resent prompt).

"Models Take Notes at Prefill" (arXiv:2606.17107) measures these edits against the
erratum; kvagent keeps them because on small models they often hold and cost a few tokens. llama.cpp
accepts a sequence's new tokens only at ``pos_max + 1``, so the splice is built left to right: the
downstream KV is parked in a scratch sequence, the field decoded fresh, then runs of parked cells copied
back (shifted by RoPE when the field's length changed) and the ``refresh`` positions decoded in order.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from kvagent.errors import ContextOverflowError, KVAgentError
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.work import Work
from kvagent.kv.sync import PrefillReport
from kvagent.segments import Rendered, Span, common_prefix

Refresh = Callable[[Rendered, Span], Iterable[int]]
log = logging.getLogger(__name__)


def splice_refusal(state: CachedSequence, old: Rendered, new: Rendered, index: int) -> str | None:
    """Why the field at segment ``index`` cannot be spliced exactly (the caller recomputes), or None."""
    span = old.spans[index]
    return region_refusal(state, span.first, span.last + 1, new.spans[index].last - span.last)


def region_refusal(state: CachedSequence, first: int, end: int, delta: int) -> str | None:
    """Why the cached positions ``first..end-1`` cannot be rewritten exactly, the positions after them moving by
    ``delta`` (the caller recomputes from ``first``), or None."""
    backend = state.backend
    if state.evicted:
        return "the downstream KV was partly evicted"
    if first < state.floor:
        return "the field lies in KV that was restored or transplanted"
    keeps_all = backend.capabilities.swa_keeps_all
    if not keeps_all and len(state.tokens) - first > backend.n_swa:
        # unpatched llama.cpp reuses SWA cells once they fall out of every query's reach (and saves no more),
        # so KV far behind the end cannot be spliced into exactly (measured on Gemma-3; native/patches fixes it)
        return (f"more than the sliding window ({backend.n_swa}) lies downstream and this llama.cpp build drops "
                "sliding-window cells behind it (build it with kvagent's patch: make setup)")
    if backend.n_swa and backend.seq_pos_range(state.seq)[0] > max(0, first - backend.n_swa + 1):
        # the field's tokens attend to the window before them: those cells must still be there
        return "the sliding-window cells before the field were dropped"
    if delta != 0 and not keeps_all and state.pool.shares_beyond(state.seq, end):
        # giving the parked run its own cells restores saved state, which keeps only the SWA window
        return "the downstream cells are shared with another session and the model uses sliding-window attention"
    if delta != 0 and not backend.capabilities.shift:
        return "the field's length changed and this backend cannot shift cells"
    return None


def splice_field(state: CachedSequence, old: Rendered, new: Rendered, index: int, refresh: Refresh | None) -> Work[PrefillReport]:
    """Rewrite segment ``index`` (a field) from ``old`` to ``new``; every other downstream cell keeps its
    KV (stale) except the positions ``refresh(old, old_span)`` names (old coordinates), decoded in context.
    The field is decoded from its first token that changed (the report's ``computed``); the ones before keep
    their cells, as a prefix match would.

    Precondition: ``state`` holds ``old.tokens`` and :func:`splice_refusal` returned None.
    """
    span = old.spans[index]
    picked = frozenset(refresh(old, span)) if refresh is not None else frozenset()
    return (yield from splice_region(state, new.tokens, span.first, span.last + 1, new.spans[index].last + 1,
                                     picked, at_least_one=True))


def splice_region(state: CachedSequence, new_tokens: tuple[int, ...], first: int, old_end: int, new_end: int,
                  refresh: frozenset[int] = frozenset(), *, at_least_one: bool = False) -> Work[PrefillReport]:
    """Rewrite the cached positions ``first..old_end-1`` to hold ``new_tokens[first:new_end]`` (either range may
    be empty: a deletion, an insertion); the cells after them keep their KV (stale), moved by RoPE re-rotation to
    their new positions, except the ``refresh`` positions (old coordinates), decoded in context. The region is
    decoded from its first token that changed (``at_least_one``: at least its last token). Reports what was
    reused and computed.

    Precondition: ``state`` holds ``old`` tokens with ``new_tokens == old[:first] + X + old[old_end:]`` and
    :func:`region_refusal` returned None.
    """
    start = time.perf_counter()
    backend, pool, seq = state.backend, state.pool, state.seq
    old_tokens = state.tokens
    n_old, n_new = len(old_tokens), len(new_tokens)
    if n_new > backend.n_ctx:
        raise ContextOverflowError(f"the edited prompt of {n_new} tokens exceeds the context of {backend.n_ctx}")
    delta = new_end - old_end
    # the region's tokens before its first changed one keep their KV, as a prefix match would (it depends only
    # on the tokens up to them, which are the same): a chat-formatted field opens with its turn header and its
    # name, half its span. Cells there that an earlier splice left stale stay stale (and marked so): field_only
    # recomputes what changed, the selective edit is the one that refreshes stale cells
    same = common_prefix(old_tokens[first:old_end], new_tokens[first:new_end])
    skip = min(same, old_end - 1 - first, new_end - 1 - first) if at_least_one else min(same, new_end - first)
    first += max(0, skip)
    fresh = {p + delta for p in refresh if old_end <= p < n_old} | set(range(first, new_end))
    computed = 0
    with pool.scratch() as park:
        shift = delta != 0 and old_end < n_old
        moved = None
        if old_end < n_old:
            shared = pool.shares_beyond(seq, old_end)
            pool.share(seq, park, old_end, n_old)  # park the run by sharing its cells (no copy)
            if shift and (backend.capabilities.swa_keeps_all or not backend.n_swa):
                # move the run in its saved bytes (keys re-rotated, kvagent.kv.rotate): seq_add would leave a
                # K-shift that llama.cpp applies to the whole KV buffer at the next decode, every cell of it
                moved = pool.moved_state(backend.seq_save_writable(park), old_end, delta, in_place=True)
            if moved is not None or (shift and shared):
                # the park gets cells of its own: the moved bytes, or a copy to shift (a shift moves every sharer).
                # The sequence lets its cells go first, so a splice never holds the downstream twice
                payload = moved if moved is not None else state.save()
                backend.seq_rm(park, 0, -1)
                pool.cut(park, 0)
                state.cut(first)
                try:
                    backend.seq_restore(park, payload)
                except Exception as exc:  # no room for the copy: what follows the region is decoded instead
                    log.warning("seq %d: the cells after an edited region could not be moved (%s): recomputing them",
                                seq, exc)
                    backend.seq_rm(park, 0, -1)
                    fresh, shift = set(range(first, n_new)), False
                else:
                    if moved is None:
                        backend.seq_rm(park, 0, old_end)
        state.cut(first)
        if shift and moved is None:
            # the park is now the only holder of those cells: shifting them moves nobody else
            backend.seq_add(park, old_end, -1, delta)
        pos = first
        try:
            while pos < n_new:
                run_fresh = pos in fresh
                end = pos
                while end < n_new and (end in fresh) == run_fresh:
                    end += 1
                if run_fresh:
                    state.extend_decoded(new_tokens[:end])
                    computed += end - pos
                else:
                    state.share_prefix(park, new_tokens[:end])
                pos = end
        except KVAgentError:
            state.cut(first)  # the prompt holds the new value; its KV from the region on is recomputed later
            raise
    kept = frozenset(p for p in range(new_end, n_new) if p not in fresh)
    state.mark_stale(new_tokens, kept)
    return PrefillReport(reused=first + len(kept), computed=computed, seconds=time.perf_counter() - start)
    yield  # pragma: no cover - a unit of work like the others, though it never pauses (it holds a scratch)
