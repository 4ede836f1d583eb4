"""Policies built from others: a recent window beside the best-scored cells, per-segment budgets, a mix of two scores.

Each is a :class:`~kvagent.policies.base.Wrapper` that only reorders its inner policy's scores; the cycle
(:func:`~kvagent.policies.base.select_keep`) still chooses. They read ``view.budget`` (the cells the cycle keeps)
and, for :class:`Shares`, ``view.labels`` (each cell's segment label). Their room is the budget less the cells the
cycle keeps anyway: pinned ones, the last one, and those the inner policy scored +inf (sinks, unscored cells).

- :class:`Recent`: StreamingLLM's recent window (Xiao et al., 2023, https://arxiv.org/abs/2309.17453) takes
  ``share`` of the room, the inner policy ranks the rest: the window keeps the latest facts, a scoring policy
  the older ones.
- :class:`Shares`: a segment label (``"memory"``, ``"tool"``, ...) gets its own share of the room: its
  best-scored cells, up to that share, go before any other cell.
- :class:`RankMix`: two policies' ranks averaged with a weight (a score from reconstruction beside one from
  surprise).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kvagent.policies.base import CacheView, EvictionPolicy, Wrapper, under_prefix, with_prefix


def ranks01(scores: np.ndarray) -> np.ndarray:
    """``[n]`` the order of ``scores`` as values in ``[0, 1)`` (ties: the later cell higher; NaN and -inf lowest);
    +inf stays +inf (cells a policy always keeps)."""
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    n = s.size
    order = np.lexsort((np.arange(n), s))
    out = np.empty(n)
    out[order] = np.arange(n, dtype=np.float64) / max(n, 1)
    out[s == np.inf] = np.inf
    return out


def room(view: CacheView, scores: np.ndarray) -> int:
    """Cells the scores decide about: the budget less the pinned cells, the last cell and the +inf ones (0 when
    the view has no budget)."""
    if view.budget is None or not len(view):
        return 0
    forced = view.pinned.copy()
    forced[-1] = True
    forced |= np.isposinf(scores)
    return max(int(view.budget) - int(forced.sum()), 0)


class Recent(Wrapper):
    """A recent window (``share`` of the room: the newest cells not otherwise kept) kept whole, the inner policy
    ranking the rest; ``share=0`` is the inner policy, ``share=1`` the window."""

    def __init__(self, inner: EvictionPolicy, share: float, name: str | None = None) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"the recent window's share must be in [0, 1], got {share}")
        super().__init__(inner, name or f"{inner.name}+recent{share:g}")
        self.share = share

    def score(self, view: CacheView) -> np.ndarray:
        scores = np.asarray(self.inner.score(view), dtype=np.float64).copy()
        window = int(round(self.share * room(view, scores)))
        if window:
            free = np.flatnonzero(~view.pinned & ~np.isposinf(scores))
            free = free[free != len(view) - 1]
            scores[free[-window:]] = np.inf
        return scores


class Shares(Wrapper):
    """Per-segment budgets: cells labelled ``label`` (``view.labels``) get ``shares[label]`` of the room; within
    that share, the label's best cells by the inner scores are kept before any other cell (a label with fewer cells
    leaves the rest of its share to everyone). Cells outside every share compete by the inner scores."""

    def __init__(self, inner: EvictionPolicy, shares: Mapping[str, float], name: str | None = None) -> None:
        if any(not 0 <= s <= 1 for s in shares.values()) or sum(shares.values()) > 1:
            raise ValueError(f"segment shares must be in [0, 1] and sum to at most 1, got {dict(shares)}")
        super().__init__(inner, name or f"{inner.name}+shares")
        self.shares = dict(shares)

    def score(self, view: CacheView) -> np.ndarray:
        scores = ranks01(self.inner.score(view))
        if view.labels is None:
            return scores
        labels = np.asarray(view.labels, dtype=object)
        total = room(view, scores)
        open_ = ~view.pinned & np.isfinite(scores)
        open_[-1] = False
        for label, share in self.shares.items():
            members = np.flatnonzero(open_ & (labels == label))
            quota = min(int(share * total), members.size)
            if quota:
                best = members[np.argsort(scores[members], kind="stable")[::-1][:quota]]
                scores[best] += 2.0  # above every cell outside a share, below +inf
        return scores


class RankMix(EvictionPolicy):
    """``weight`` x rank of ``a`` + (1 - ``weight``) x rank of ``b`` (ranks in [0, 1)); a cell either policy keeps
    always (+inf) is kept. Both policies see every view and are told what was kept."""

    def __init__(self, a: EvictionPolicy, b: EvictionPolicy, weight: float = 0.5, name: str | None = None) -> None:
        if not 0 <= weight <= 1:
            raise ValueError(f"the mix weight must be in [0, 1], got {weight}")
        self.a, self.b, self.weight = a, b, weight
        self.name = name or f"{a.name}*{weight:g}+{b.name}"
        self.needs_hidden = a.needs_hidden or b.needs_hidden
        self.needs_probe = a.needs_probe or b.needs_probe

    def score(self, view: CacheView) -> np.ndarray:
        ra, rb = ranks01(self.a.score(view)), ranks01(self.b.score(view))
        keep = np.isposinf(ra) | np.isposinf(rb)
        mixed = self.weight * np.where(keep, 0.0, ra) + (1 - self.weight) * np.where(keep, 0.0, rb)
        mixed[keep] = np.inf
        return mixed

    def kept(self, positions: np.ndarray) -> None:
        self.a.kept(positions)
        self.b.kept(positions)

    def state(self) -> dict[str, np.ndarray]:
        return {**with_prefix("a", self.a.state()), **with_prefix("b", self.b.state())}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        other = [k for k in state if not k.startswith(("a.", "b."))]
        if other:
            raise ValueError(f"not {self.name}'s state: {other[:4]}")
        before = self.a.state()
        self.a.load_state(under_prefix("a", state))
        try:
            self.b.load_state(under_prefix("b", state))
        except ValueError:
            self.a.load_state(before)  # nothing changed
            raise

    def input_layers(self, n_layer: int, model_path: Path) -> tuple[int, ...]:
        return tuple(sorted(set(self.a.input_layers(n_layer, model_path)) | set(self.b.input_layers(n_layer, model_path))))


class RankMax(RankMix):
    """The better of two policies' ranks (ranks in [0, 1); ``b``'s scaled by ``weight``): a cell either policy ranks
    high is kept, the two orders interleaved, so each policy's best cells share the room. A cell either keeps always
    (+inf) is kept."""

    def __init__(self, a: EvictionPolicy, b: EvictionPolicy, weight: float = 1.0, name: str | None = None) -> None:
        super().__init__(a, b, weight, name or f"max({a.name},{b.name})")

    def score(self, view: CacheView) -> np.ndarray:
        ra, rb = ranks01(self.a.score(view)), ranks01(self.b.score(view))
        keep = np.isposinf(ra) | np.isposinf(rb)
        best = np.maximum(np.where(keep, 0.0, ra), self.weight * np.where(keep, 0.0, rb))
        best[keep] = np.inf
        return best
