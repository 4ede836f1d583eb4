"""What the future repeats: a copy model's counter-causal discount, exact and cheap.

Counter-causal surprise ("Back from the Future", Gould and van den Hengel, 2026) keeps what the tokens after a cell
cannot predict. Its fast pass queries the last layer from the state at ``p - 1`` over the cached keys after ``p``;
on the two shipped models that state already carries the causal prediction of ``x_p``, so the pass ranks cells as
self-information does (:class:`~kvagent.policies.information.SelfInformation`; Spearman 0.996-0.997 on the held-out
calibration contexts, BENCHMARKS.md), and the future's own say is lost.

:class:`FutureCopy` adds that say with the simplest model of the future that cannot leak: a cache (copy) model
(Kuhn and De Mori, 1990, "A cache-based natural language model for speech recognition", IEEE TPAMI 12(6)), the
mechanism induction heads implement (Olsson et al., 2022, https://arxiv.org/abs/2209.11895). A word that occurs
again later in the cache is predictable from its future, so its inner score is multiplied by ``discount``: the
topic words of a question its answer repeats, a memo line copied from an earlier memo. A value stated once, a name,
a code, is not. Words are tokens whose text is alphabetic and at least ``min_len`` characters (case ignored); any
other token recurs when the ``ngram`` tokens ending at it occur again later (a random code's digits rarely do).
"""

from __future__ import annotations

import numpy as np

from kvagent.policies.base import CacheView, EvictionPolicy, Wrapper


def recurs_later(tokens: np.ndarray, texts: tuple[str, ...] | None, ngram: int = 3, min_len: int = 3) -> np.ndarray:
    """``[n]`` bool, in view order: the cell's word (or, for a token that is no word, the ``ngram`` token ids ending
    at it) occurs again at a later cell. Without ``texts`` every token is matched by its n-gram."""
    n = int(tokens.size)
    ids = tokens.tolist()
    out = np.zeros(n, dtype=bool)
    words: set[str] = set()
    grams: set[tuple[int, ...]] = set()
    for p in range(n - 1, -1, -1):
        word = texts[p].strip().lower() if texts is not None else ""
        if word.isalpha() and len(word) >= min_len:
            out[p] = word in words
            words.add(word)
        elif ngram and p + 1 >= ngram:
            gram = tuple(ids[p + 1 - ngram : p + 1])
            out[p] = gram in grams
            grams.add(gram)
    return out


class FutureCopy(Wrapper):
    """The inner policy's finite scores times ``discount`` where :func:`recurs_later` (higher = keep; the inner
    scores must be non-negative, as self-information and surprise are). +inf cells stay kept."""

    def __init__(self, inner: EvictionPolicy, discount: float = 0.5, ngram: int = 3, min_len: int = 3,
                 name: str | None = None) -> None:
        if not 0 <= discount <= 1:
            raise ValueError(f"the recurrence discount must be in [0, 1], got {discount}")
        if ngram < 0 or min_len < 1:
            raise ValueError(f"need ngram >= 0 and min_len >= 1, got {ngram}, {min_len}")
        super().__init__(inner, name)
        self.discount, self.ngram, self.min_len = discount, ngram, min_len

    def score(self, view: CacheView) -> np.ndarray:
        scores = np.asarray(self.inner.score(view), dtype=np.float64).copy()
        again = recurs_later(view.tokens, view.texts, self.ngram, self.min_len) & np.isfinite(scores)
        scores[again] *= self.discount
        return scores
