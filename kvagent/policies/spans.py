"""Span-level eviction: any scoring policy's token scores aggregated over spans kept or dropped whole.

Token-level scores keep scattered tokens and break a fact's sentence apart; worse, the tokens of a
random code are individually not very surprising (a digit after "is " has about log 10 = 2.3 nats of
surprise, a rare content word 10 or more), so a 4-digit code loses to rare words token by token
. :class:`Spans` wraps a policy the way :class:`~kvagent.policies.base.KeepSinks` does:
cut the cells into spans (sentences or clauses from the token texts, or fixed blocks of ``block``
positions, the pages a paged KV cache frees), score each span by ``reduce`` (max, mean, or the mean of
its top ``k`` tokens) of the inner scores, and rank spans whole. The budget stays exact: the cycle keeps
the best spans and cuts the last one that does not fit at the budget, keeping its best tokens.

:class:`TurnContrast` ranks a span by how far it stands out from the rest of its turn (a chat message, a tool
result, a shared document) instead of by its own value: a memo line holding a door code among routine lines, or a
user's aside among their questions, stands out in its message even where a page of novel scores higher everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from kvagent.policies.base import CacheView, EvictionPolicy, Wrapper, under_prefix, with_prefix

log = logging.getLogger(__name__)

UNITS = ("sentence", "clause", "block")
REDUCES = ("max", "mean", "topk")
_SENTENCE_END = ".!?;"
_CLAUSE_END = _SENTENCE_END + ",:"
_CLOSERS = "\"')]}\u201d\u2019*_ \t"  # may follow the punctuation in the same token ('."', '.)')


def ends_span(text: str, unit: str) -> bool:
    """Whether a token with this text closes a sentence (``unit="sentence"``) or clause: it holds a
    newline, or ends (closing quotes and brackets aside) with sentence / clause punctuation."""
    if "\n" in text:
        return True
    core = text.rstrip(_CLOSERS)
    return bool(core) and core[-1] in (_CLAUSE_END if unit == "clause" else _SENTENCE_END)


def cut_spans(positions: np.ndarray, texts: tuple[str, ...] | None, pinned: np.ndarray, unit: str = "sentence",
              block: int = 16, max_len: int = 64) -> np.ndarray:
    """``[n]`` span id (0, 1, ... ascending) of each cell, in view order.

    ``unit="block"``: cells share a span when their positions share ``position // block`` (fixed pages,
    stable from cycle to cycle). ``"sentence"`` / ``"clause"``: a span ends after a token that
    :func:`ends_span`, and after ``max_len`` cells. Every unit also ends a span where pinned and free
    cells meet (segments pinned by the session never share a span with free ones). Without ``texts``
    sentence units fall back to blocks."""
    n = positions.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if unit not in UNITS:
        raise ValueError(f"unknown span unit {unit!r}: use one of {', '.join(UNITS)}")
    starts = np.zeros(n, dtype=bool)
    starts[0] = True
    starts[1:] |= pinned[1:] != pinned[:-1]
    if unit == "block" or texts is None:
        if unit != "block":
            log.debug("no token texts in the view: %s spans fall back to blocks of %d", unit, block)
        page = positions // max(block, 1)
        starts[1:] |= page[1:] != page[:-1]
        return np.cumsum(starts) - 1
    ids = np.zeros(n, dtype=np.int64)
    span, length = 0, 0
    for i in range(n):
        if i and (starts[i] or length >= max_len):
            span, length = span + 1, 0
        ids[i] = span
        length += 1
        if ends_span(texts[i], unit) and i + 1 < n:
            starts[i + 1] = True
    return ids


def reduce_spans(scores: np.ndarray, spans: np.ndarray, reduce: str = "max", k: int = 4) -> np.ndarray:
    """``[n_spans]`` aggregate of each span's finite scores (max, mean or mean of the top ``k``); -inf for
    a span with none (NaN counts as -inf, +inf cells are ranked apart by :func:`span_ranks`)."""
    if reduce not in REDUCES:
        raise ValueError(f"unknown span reduce {reduce!r}: use one of {', '.join(REDUCES)}")
    n_spans = int(spans.max()) + 1 if spans.size else 0
    out = np.full(n_spans, -np.inf)
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    for j in range(n_spans):
        vals = s[spans == j]
        vals = vals[np.isfinite(vals)]
        if not vals.size:
            continue
        if reduce == "max":
            out[j] = vals.max()
        elif reduce == "mean":
            out[j] = vals.mean()
        else:
            out[j] = np.sort(vals)[::-1][: max(k, 1)].mean()
    return out


def span_ranks(scores: np.ndarray, spans: np.ndarray, reduce: str = "max", k: int = 4) -> np.ndarray:
    """``[n]`` scores whose order ranks spans whole: by span aggregate (ties: the later span first),
    then inside a span by the cell's own score (ties: the later cell first). Cells the inner policy
    scored +inf (always keep: sinks, cells without a captured state) stay +inf. Higher = keep; only the
    order is meaningful (values are ranks ``1..n``)."""
    return rank_by_spans(scores, spans, reduce_spans(scores, spans, reduce, k))


def rank_by_spans(scores: np.ndarray, spans: np.ndarray, agg: np.ndarray) -> np.ndarray:
    """:func:`span_ranks` for given span values ``agg`` (``[n_spans]``, higher = keep the span)."""
    n = scores.size
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    idx = np.arange(n)
    # ascending keys: lexsort's last key is primary; lowest rank = evicted first
    order = np.lexsort((idx, s, spans, agg[spans] if n else s))
    out = np.empty(n)
    out[order] = np.arange(1, n + 1, dtype=np.float64)
    out[s == np.inf] = np.inf
    return out


class Spans(Wrapper):
    """Wraps a scoring policy; spans (``unit``: "sentence", "clause" or "block" of ``block`` positions)
    are ranked by ``reduce`` ("max", "mean", "topk" = mean of the top ``k``) of the inner scores and kept
    or dropped whole (the last one cut at the budget). Needs the view's ``texts`` for sentence units
    (the Evictor fills them); falls back to blocks without."""

    def __init__(self, inner: EvictionPolicy, unit: str = "sentence", reduce: str = "max", block: int = 16,
                 k: int = 4, max_len: int = 64, name: str | None = None) -> None:
        if unit not in UNITS:
            raise ValueError(f"unknown span unit {unit!r}: use one of {', '.join(UNITS)}")
        if reduce not in REDUCES:
            raise ValueError(f"unknown span reduce {reduce!r}: use one of {', '.join(REDUCES)}")
        if block < 1 or k < 1 or max_len < 1:
            raise ValueError(f"block, k and max_len must be >= 1, got {block}, {k}, {max_len}")
        super().__init__(inner, name or f"{inner.name}-{unit}")
        self.unit, self.reduce, self.block, self.k, self.max_len = unit, reduce, block, k, max_len

    def spans(self, view: CacheView) -> np.ndarray:
        return cut_spans(view.positions, view.texts, view.pinned, self.unit, self.block, self.max_len)

    def aggregate(self, view: CacheView, scores: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """``[n_spans]`` the value a span is ranked by: ``reduce`` of its cells' scores."""
        return reduce_spans(scores, spans, self.reduce, self.k)

    def score(self, view: CacheView) -> np.ndarray:
        scores = np.asarray(self.inner.score(view), dtype=np.float64)
        spans = self.spans(view)
        return rank_by_spans(scores, spans, self.aggregate(view, scores, spans))


BASELINES = ("mean", "median")


def turn_starts(texts: tuple[str, ...] | None, labels: tuple[str, ...] | None, n: int) -> np.ndarray:
    """``[n]`` bool, in view order: the cell opens a turn, being a control token (a chat format's turn marker;
    llama.cpp renders no text for it) or the first cell of another segment label than the cell before it. The
    first cell opens nothing (its turn began before the view, or it is the first)."""
    starts = np.zeros(n, dtype=bool)
    if texts is not None:
        starts |= np.fromiter((t == "" for t in texts), bool, n)
    if labels is not None and n:
        lab = np.asarray(labels, dtype=object)
        starts[1:] |= lab[1:] != lab[:-1]
    if n:
        starts[0] = False
    return starts


def turn_ids(texts: tuple[str, ...] | None, labels: tuple[str, ...] | None, n: int) -> np.ndarray:
    """``[n]`` turn id (0, 1, ... ascending) of each cell, in view order (:func:`turn_starts`). Without texts or
    labels every cell is in turn 0."""
    return np.cumsum(turn_starts(texts, labels, n))


class TurnContrast(Spans):
    """Spans ranked by how much they stand out from their turn: the span's ``reduce`` of the inner scores less the
    turn's ``baseline`` ("mean": the mean of the inner scores its cells had when first seen; "median": the median of
    its spans' values now). A turn of uniformly dense text (a novel's page, a log of identifiers) then spends no more
    of the budget than a turn of routine text, and each turn's outstanding sentences go first. Same units and budget
    rules as :class:`Spans`.

    Turns are cut where :func:`turn_starts` says, and remembered: a turn's opening position and its cells' first
    scores are kept until its last cell is evicted, so a turn pruned down to its best sentence is still measured
    against everything it held (with the mean of what is left, what was kept would sink to zero and go next), and
    its cells still belong to it after its marker was evicted. Saved and restored with the session."""

    def __init__(self, inner: EvictionPolicy, unit: str = "sentence", reduce: str = "mean", baseline: str = "mean",
                 name: str | None = None, **kw: int) -> None:
        if baseline not in BASELINES:
            raise ValueError(f"unknown turn baseline {baseline!r}: use one of {', '.join(BASELINES)}")
        super().__init__(inner, unit, reduce, name=name or f"{inner.name}-contrast", **kw)
        self.baseline = baseline
        self._starts: list[int] = []  # ascending positions that opened a turn
        self._sums: dict[int, list[float]] = {}  # turn start -> [sum, count] of its cells' first finite scores
        self._counted: set[int] = set()  # positions whose score is in their turn's sum

    def turns(self, view: CacheView) -> np.ndarray:
        """``[n]`` the opening position of each cell's turn (-1 before the first recorded one), recording the turns
        this view opens."""
        pos = view.positions
        new = pos[turn_starts(view.texts, view.labels, len(view))].tolist()
        if new and (not self._starts or set(new) - set(self._starts)):
            self._starts = sorted(set(self._starts) | set(new))
        starts = np.asarray(self._starts, dtype=np.int64)
        at = np.searchsorted(starts, pos, side="right") - 1
        return np.where(at >= 0, starts[np.clip(at, 0, None)] if starts.size else -1, -1)

    def aggregate(self, view: CacheView, scores: np.ndarray, spans: np.ndarray) -> np.ndarray:
        agg = super().aggregate(view, scores, spans)
        if not agg.size:
            return agg
        turn = self.turns(view)
        s = np.asarray(scores, dtype=np.float64)
        for p, t, v in zip(view.positions.tolist(), turn.tolist(), s.tolist()):
            if p not in self._counted and np.isfinite(v):
                total = self._sums.setdefault(t, [0.0, 0.0])
                total[0] += v
                total[1] += 1
                self._counted.add(p)
        first = np.flatnonzero(np.r_[True, spans[1:] != spans[:-1]])  # each span's first cell
        span_turn = turn[first]
        out = agg.copy()
        for t in np.unique(span_turn):
            mine = span_turn == t
            if self.baseline == "mean":
                total, count = self._sums.get(int(t), (0.0, 0.0))
                base = total / count if count else 0.0
            else:
                vals = agg[mine][np.isfinite(agg[mine])]
                base = float(np.median(vals)) if vals.size else 0.0
            out[mine] = agg[mine] - base
        return out

    def kept(self, positions: np.ndarray) -> None:
        super().kept(positions)
        keep = set(positions.tolist())
        self._counted &= keep
        starts = np.asarray(self._starts, dtype=np.int64)
        at = np.searchsorted(starts, positions, side="right") - 1
        live = {int(starts[i]) for i in at.tolist() if i >= 0}
        self._starts = [t for t in self._starts if t in live]
        self._sums = {t: v for t, v in self._sums.items() if t in live or (t == -1 and (at < 0).any())}

    def state(self) -> dict[str, np.ndarray]:
        keys = sorted(self._sums)
        own = {"starts": np.asarray(self._starts, dtype=np.int64), "turn": np.asarray(keys, dtype=np.int64),
               "sum": np.array([self._sums[k][0] for k in keys], dtype=np.float64),
               "count": np.array([self._sums[k][1] for k in keys], dtype=np.float64),
               "counted": np.asarray(sorted(self._counted), dtype=np.int64)}
        return {**with_prefix("turns", own), **with_prefix("inner", self.inner.state())}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        own = under_prefix("turns", state)
        other = [k for k in state if not k.startswith(("turns.", "inner."))]
        arrays = [own.get(k) for k in ("starts", "turn", "sum", "count", "counted")]
        if other or set(own) != {"starts", "turn", "sum", "count", "counted"} or any(
                a is None or a.ndim != 1 for a in arrays) or not arrays[1].shape == arrays[2].shape == arrays[3].shape:
            raise ValueError(f"not {self.name}'s state: {sorted(state)[:4]}")
        self.inner.load_state(under_prefix("inner", state))  # raises before anything of ours changed
        starts, turn, total, count, counted = arrays
        self._starts = [int(x) for x in starts.tolist()]
        self._sums = {int(t): [float(a), float(c)] for t, a, c in zip(turn.tolist(), total.tolist(), count.tolist())}
        self._counted = {int(x) for x in counted.tolist()}
