"""Span-level eviction: any scoring policy's token scores aggregated over spans kept or dropped whole.

Token-level scores keep scattered tokens and break a fact's sentence apart; worse, the tokens of a
random code are individually not very surprising (a digit after "is " has about log 10 = 2.3 nats of
surprise, a rare content word 10 or more), so a 4-digit code loses to rare words token by token
. :class:`Spans` wraps a policy the way :class:`~kvagent.policies.base.KeepSinks` does:
cut the cells into spans (sentences or clauses from the token texts, or fixed blocks of ``block``
positions, the pages a paged KV cache frees), score each span by ``reduce`` (max, mean, or the mean of
its top ``k`` tokens) of the inner scores, and rank spans whole. The budget stays exact: the cycle keeps
the best spans and cuts the last one that does not fit at the budget, keeping its best tokens.
"""

from __future__ import annotations

import logging

import numpy as np

from kvagent.policies.base import CacheView, EvictionPolicy, Wrapper

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
    n = scores.size
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    agg = reduce_spans(s, spans, reduce, k)
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

    def score(self, view: CacheView) -> np.ndarray:
        scores = np.asarray(self.inner.score(view), dtype=np.float64)
        return span_ranks(scores, self.spans(view), self.reduce, self.k)
