"""Rebase: bring a sequence to a resent prompt by editing the regions that changed, not by rebuilding from the first.

A client that resends its whole prompt (an OpenAI client, LangChain) changes it itself: a clock line, a memory
block, old tool results cleared, old turns summarised. :func:`kvagent.kv.sync.sync` keeps only the common
prefix and recomputes the rest; :func:`rebase` first aligns the new tokens with the cached ones
(:func:`kvagent.kv.diff.align`) and turns each changed region that cached cells follow into a splice
(:func:`kvagent.kv.splice.splice_region`): a replaced span is decoded in place, a deleted span's cells are
removed, an inserted span is decoded at its place, and the cells after each keep their KV, moved by RoPE
re-rotation where the length changed (stale, as after a field-only edit: "Models Take Notes at Prefill",
https://arxiv.org/abs/2606.17107, measures when that holds; kvagent's calibration says per model). What is left
(the new messages at the end) is synced as usual. The alignment is segment-aware: whole segments (messages, the
policy, skills) are matched first, then tokens inside the segments that differ.

It falls back to that sync (a recompute from the first change, reported) when the model's calibration does not
say splices hold, when a change lies inside a transplanted skill or a tool call, when the cache cannot be
spliced exactly (:func:`kvagent.kv.splice.region_refusal`), or when the change is too large to be worth it:
more than :data:`MAX_SHARE` of the tokens after the first change, or more than :data:`MAX_EDITS` regions.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvagent.kv.diff import Hunk, align_spans
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.splice import region_refusal, splice_region
from kvagent.kv.sync import ImplicitEdit, PrefillReport
from kvagent.kv.work import Work
from kvagent.segments import Rendered, SegmentKind, Span

log = logging.getLogger(__name__)

MAX_SHARE = 0.5  # changed tokens above this share of what follows the first change: recompute from it
MAX_EDITS = 8  # more changed regions than this: recompute from the first (each splice moves the cells after it)

Sync = Callable[[Rendered], Work[PrefillReport]]
Detokenize = Callable[[tuple[int, ...]], str]
Frozen = Callable[[Span], "str | None"]


def rebase(state: CachedSequence, old: Rendered, new: Rendered, *, sync: Sync, recompute_because: str | None,
           detokenize: Detokenize, frozen: Frozen = lambda span: None, max_share: float = MAX_SHARE,
           max_edits: int = MAX_EDITS) -> Work[PrefillReport]:
    """Bring ``state`` (holding ``old.tokens``) to ``new`` (see the module docstring); ``sync`` finishes the
    prompt as usual. ``recompute_because``: why splices do not hold for this model (None: they do);
    ``frozen(span)``: why a span of ``old`` may not be edited in place (None: it may; skills never are).
    The report's ``edits`` lists what was done; ``computed`` counts every token decoded (changed + new)."""
    start = time.perf_counter()
    if tuple(state.tokens) != old.tokens or not old.tokens or new.tokens[: len(old.tokens)] == old.tokens:
        return (yield from sync(new))  # nothing cached to edit (or a cache that lags), or only new tokens at the end
    hunks, inner, why = plan(old, new, recompute_because=recompute_because, frozen=frozen, max_share=max_share,
                             max_edits=max_edits)
    line = _line_of(new.tokens, detokenize)
    end = hunks[-1] if hunks and hunks[-1].old_end == len(old.tokens) and hunks[-1].removed else None
    edits: list[ImplicitEdit] = []
    computed = 0
    offset = 0  # how far the regions already spliced moved the old positions after them
    for k, h in enumerate(inner if why is None else ()):
        first, old_end, new_end = h.old_start + offset, h.old_end + offset, h.new_end
        why = region_refusal(state, first, old_end, h.delta)
        if why is not None:  # the regions before it are spliced; it and the rest are recomputed
            inner = inner[k:]
            break
        cur = state.tokens
        target = (*cur[:first], *new.tokens[h.new_start:h.new_end], *cur[old_end:])
        report = yield from splice_region(state, target, first, old_end, new_end)
        edits.append(ImplicitEdit(h.kind, h.old_start, h.old_end, h.new_start, h.new_end, report.computed,
                                  line(h.new_start)))
        computed += report.computed
        offset += h.delta
    if why is not None:
        first_change = inner[0]
    elif end is not None:  # cached tokens at the end changed and nothing cached follows: recomputed from there
        first_change, why = end, "the change reaches the end of the cached prompt: nothing cached follows it"
    if why is not None:
        log.info("seq %d: a resent prompt changed at token %d; recomputing from there (%s)", state.seq,
                 first_change.new_start, why)
    tail = yield from sync(new)
    computed += tail.computed
    reused = len(new.tokens) - computed - tail.transplanted
    if why is not None:
        edits.append(ImplicitEdit("fallback", first_change.old_start, len(old.tokens), first_change.new_start,
                                  len(new.tokens), tail.computed, line(first_change.new_start), why))
    return PrefillReport(reused, computed, time.perf_counter() - start, tail.shared, tail.transplanted,
                         tail.fidelity, tail.fell_back, tail.recomputed_because, tuple(edits), restored=tail.restored)


def plan(old: Rendered, new: Rendered, *, recompute_because: str | None, frozen: Frozen = lambda span: None,
         max_share: float = MAX_SHARE, max_edits: int = MAX_EDITS) -> tuple[list[Hunk], list[Hunk], str | None]:
    """What :func:`rebase` will do, before anything changes: (every changed region, those with cached cells after
    them, why those are recomputed from the first rather than spliced: None when they are spliced)."""
    hunks = align_rendered(old, new)
    inner = [h for h in hunks if h.old_end < len(old.tokens)]
    why = (recompute_because or refusal(old, new, inner, frozen, max_share, max_edits)) if inner else None
    return hunks, inner, why


def align_rendered(old: Rendered, new: Rendered) -> list[Hunk]:
    """The changed regions of two rendered prompts, segment by segment first (:func:`kvagent.kv.diff.align_spans`)."""
    return align_spans(old.tokens, [s.first for s in old.spans], new.tokens, [s.first for s in new.spans])


def refusal(old: Rendered, new: Rendered, hunks: list[Hunk], frozen: Frozen, max_share: float,
             max_edits: int) -> str | None:
    """Why these changes are recomputed rather than spliced, before anything changes (None: splice them)."""
    if len(hunks) > max_edits:
        return f"{len(hunks)} changed regions (more than {max_edits})"
    changed = sum(h.added for h in hunks)
    after = len(new.tokens) - hunks[0].new_start
    if changed > max_share * after:
        return f"{changed} of the {after} tokens after the first change differ (more than {max_share:.0%})"
    for h in hunks:
        for span in old.spans:
            if span.last < h.old_start or span.first >= max(h.old_end, h.old_start + 1):
                continue
            if h.old_start <= span.first and span.last < h.old_end:
                continue  # the whole span goes (a summarised or dropped turn): none of its cells is kept or moved
            if span.kind is SegmentKind.SKILL:
                return f"a change inside a transplanted skill or tool spec ({span.segment_id})"
            reason = frozen(span)
            if reason is not None:
                return reason
        if h.added and any(span.kind is SegmentKind.SKILL and span.first < h.new_end and span.last >= h.new_start
                           for span in new.spans):
            return "a skill or tool spec is added or changed (the sync transplants it rather than decoding it)"
    return None


def _line_of(tokens: tuple[int, ...], detokenize: Detokenize) -> Callable[[int], str]:
    """The text line of ``tokens`` that position ``at`` starts in (at most 80 characters)."""

    def line(at: int) -> str:
        lo, hi = max(0, at - 48), min(len(tokens), at + 32)
        before, after = detokenize(tokens[lo:at]), detokenize(tokens[at:hi])
        text = before.rsplit("\n", 1)[-1] + after.split("\n", 1)[0]
        return text.strip()[:80]

    return line


__all__ = ["MAX_EDITS", "MAX_SHARE", "ImplicitEdit", "align_rendered", "plan", "rebase", "refusal"]
