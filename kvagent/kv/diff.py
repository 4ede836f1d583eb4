"""Token diff: align a new prompt with the cached one, so that a changed region becomes an edit, not a rebuild.

Agents resend their whole prompt and change it themselves (a clock line, a memory block, cleared tool results,
a summary in place of old turns). The cache holds the old tokens; :func:`align` finds the regions that differ
as :class:`Hunk` s between runs of equal tokens. The alignment is greedy, left to right: equal tokens are
matched while they agree; at a mismatch the resynchronisation point is the pair of positions ``(i', j')``
whose next ``k`` tokens agree and that minimises ``(i' - i) + (j' - j)`` (old tokens dropped plus new tokens
added) less the equal run that follows it (up to :data:`LOOKAHEAD` tokens), looked up through an index of the
old prompt's ``k``-grams. A resynchronisation needs at least :data:`MIN_RUN` equal tokens after it (a turn
header or a common phrase inside a changed block is no place to resume). The run matters where lines share their
wording: a deleted line must not be aligned
as each following line replaced by the next one. This finds every edit agents
make (replacements, deletions, insertions, several per prompt); it does not detect moved blocks (they are a
replacement). The work is bounded: at most :data:`WORK_PER_TOKEN` lookups per token of the two prompts, past
which the rest is one hunk (the caller recomputes it), so a 100k-character prompt aligns in milliseconds.
"""

from __future__ import annotations

import bisect
import difflib
from dataclasses import dataclass
from typing import Literal, Sequence

K = 4  # tokens that must agree to resynchronise: fewer matches template pieces by chance
MIN_GAP = 8  # hunks closer than this are merged: a short equal run between two changes is not worth a splice
WORK_PER_TOKEN = 32
MIN_RUN = 16  # equal tokens a resynchronisation needs after it (fewer only where the prompts end)
LOOKAHEAD = 64  # equal tokens read after a resynchronisation point to score it (a capped run length)
CANDIDATES = 4  # old positions tried per new position: the nearest ones after the mismatch

EditKind = Literal["replace", "delete", "insert"]


@dataclass(frozen=True)
class Hunk:
    """Old positions ``old_start..old_end-1`` became new positions ``new_start..new_end-1`` (either range may be
    empty). Between two hunks, and before the first and after the last, the old and new tokens are equal."""

    old_start: int
    old_end: int
    new_start: int
    new_end: int

    @property
    def kind(self) -> EditKind:
        if self.old_end == self.old_start:
            return "insert"
        if self.new_end == self.new_start:
            return "delete"
        return "replace"

    @property
    def delta(self) -> int:
        """How far the positions after the hunk move."""
        return (self.new_end - self.new_start) - (self.old_end - self.old_start)

    @property
    def added(self) -> int:
        return self.new_end - self.new_start

    @property
    def removed(self) -> int:
        return self.old_end - self.old_start


def align(old: Sequence[int], new: Sequence[int], *, k: int = K, min_gap: int = MIN_GAP) -> list[Hunk]:
    """The hunks that turn ``old`` into ``new`` (empty when they are equal), in order.

    Applying them (:func:`apply`) to ``old`` gives ``new``. Equal runs between hunks are at least ``min_gap``
    tokens long (shorter ones are merged into the hunks around them)."""
    n, m = len(old), len(new)
    tail = 0  # equal tokens at the end: the greedy pass cannot resynchronise on fewer than k of them
    while tail < n and tail < m and old[n - 1 - tail] == new[m - 1 - tail]:
        tail += 1
    if 0 < tail < min(n, m):
        return align(old[: n - tail], new[: m - tail], k=k, min_gap=min_gap)  # the same positions: the end is cut
    index: dict[tuple[int, ...], list[int]] = {}
    for p in range(n - k + 1):
        index.setdefault(tuple(old[p : p + k]), []).append(p)  # ascending: p grows
    budget = WORK_PER_TOKEN * (n + m) + 64
    hunks: list[Hunk] = []
    i = j = 0
    while True:
        while i < n and j < m and old[i] == new[j]:
            i, j = i + 1, j + 1
        if i == n or j == m:
            if i < n or j < m:
                hunks.append(Hunk(i, n, j, m))
            break
        best: tuple[int, int] | None = None
        best_score = n + m  # any resynchronisation beats none; a later j2 scores at least (j2 - j) - LOOKAHEAD
        for j2 in range(j, m - k + 1):
            if (j2 - j) - LOOKAHEAD >= best_score or budget <= 0:
                break
            budget -= 1
            at = index.get(tuple(new[j2 : j2 + k]))
            if not at:
                continue
            q = bisect.bisect_left(at, i)
            for i2 in at[q : q + CANDIDATES]:
                run = _run(old, new, i2 + k, j2 + k, LOOKAHEAD - k) + k
                budget -= run // k
                if run < MIN_RUN and i2 + run < n and j2 + run < m:
                    continue  # a few equal tokens (a turn header, a common phrase) inside a changed block
                score = (i2 - i) + (j2 - j) - run
                if score < best_score:
                    best, best_score = (i2, j2), score
        if best is None or budget <= 0:
            hunks.append(Hunk(i, n, j, m))  # nothing to resynchronise on (or out of work): the rest differs
            break
        hunks.append(Hunk(i, best[0], j, best[1]))
        i, j = best
    return _merge(hunks, min_gap)


def align_spans(old: Sequence[int], old_starts: Sequence[int], new: Sequence[int], new_starts: Sequence[int], *,
                k: int = K, min_gap: int = MIN_GAP) -> list[Hunk]:
    """:func:`align`, segment-aware: the prompts are cut into segments (``*_starts``: the first position of each, in
    order), whole segments are matched first (a longest-common-subsequence over their token runs, as ``difflib``
    does), and :func:`align` runs inside each stretch of segments that differ one for one (a message edited in
    place: a clock line, a cleared result). A stretch whose segments were dropped, added or summarised into fewer is
    one region of whole segments: a turn that goes keeps none of its cells (the turn headers it shares with the new
    text are not worth aligning). A message cleared, dropped or summarised is then found as such even where its text
    shares a phrase with a later one."""
    a, b = _cut(old, old_starts), _cut(new, new_starts)
    ends_a, ends_b = _ends(a), _ends(b)
    hunks: list[Hunk] = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        o0, o1, n0, n1 = ends_a[i1], ends_a[i2], ends_b[j1], ends_b[j2]
        if i2 - i1 != j2 - j1:  # segments dropped, added, or several summarised into one: whole segments
            hunks.append(Hunk(o0, o1, n0, n1))
            continue
        hunks += [Hunk(h.old_start + o0, h.old_end + o0, h.new_start + n0, h.new_end + n0)
                  for h in align(old[o0:o1], new[n0:n1], k=k, min_gap=min_gap)]
    return _merge(hunks, min_gap)


def _cut(tokens: Sequence[int], starts: Sequence[int]) -> list[tuple[int, ...]]:
    bounds = [*(s for s in starts if 0 < s < len(tokens)), len(tokens)]
    out, at = [], 0
    for end in bounds:
        if end > at:
            out.append(tuple(tokens[at:end]))
            at = end
    return out


def _ends(pieces: Sequence[tuple[int, ...]]) -> list[int]:
    """Token offset at which each piece starts, then the total."""
    out = [0]
    for piece in pieces:
        out.append(out[-1] + len(piece))
    return out


def _run(old: Sequence[int], new: Sequence[int], i: int, j: int, cap: int) -> int:
    """How many tokens agree from ``old[i]`` and ``new[j]`` on (at most ``cap``)."""
    n = 0
    while n < cap and i + n < len(old) and j + n < len(new) and old[i + n] == new[j + n]:
        n += 1
    return n


def _merge(hunks: list[Hunk], min_gap: int) -> list[Hunk]:
    out: list[Hunk] = []
    for h in hunks:
        if out and h.old_start - out[-1].old_end < min_gap:
            prev = out.pop()
            h = Hunk(prev.old_start, h.old_end, prev.new_start, h.new_end)
        out.append(h)
    return out


def apply(old: Sequence[int], new: Sequence[int], hunks: Sequence[Hunk]) -> list[int]:
    """``old`` with each hunk's old range replaced by its new range of ``new`` (equals ``new`` for ``align``'s)."""
    out: list[int] = []
    at = 0
    for h in hunks:
        out.extend(old[at : h.old_start])
        out.extend(new[h.new_start : h.new_end])
        at = h.old_end
    out.extend(old[at:])
    return out


__all__ = ["Hunk", "align", "align_spans", "apply"]
