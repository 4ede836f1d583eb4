"""Attention-score baselines: H2O, TOVA and importance sampling (the baselines of "Back from the Future", Gould
and van den Hengel, 2026).

All three read the last layer's attention, recomputed in torch from the penultimate hidden states
llama.cpp's decode captured (:mod:`kvagent.policies.last_layer`); one layer because kvagent evicts a
position from every layer at once. Rows without a captured hidden state are kept (score +inf).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import kvagent.policies.last_layer as last_layer
from kvagent.policies.base import CacheView, EvictionPolicy, PositionTable, load_rng, rng_state, under_prefix, with_prefix


class HeavyHitters(PositionTable):
    """H2O (Zhang et al., 2023): keep the tokens with the largest attention accumulated over every query
    since they were cached. Each cycle adds the attention of the tokens decoded since the last one
    (summed over heads and queries) to a per-position total; evicted positions are forgotten. This is
    the self-reinforcing score the surprise paper argues against: kept tokens keep collecting attention."""

    name = "h2o"
    table = "total"
    needs_hidden = True

    def accumulate(self, view: CacheView) -> np.ndarray:
        """Update and return the accumulated attention ``[n]`` (NaN where no hidden state exists)."""
        hidden = view.hidden
        rows = last_layer.captured_rows(hidden, self.name)
        present = np.zeros(len(view), dtype=bool)
        present[rows] = True
        queries = np.flatnonzero(view.new[rows])
        if queries.size and rows.size > 1:
            probs = last_layer.attention(view.model_path, hidden[rows], view.positions[rows], queries)
            gained = probs.sum(axis=(0, 1))
            for p, g in zip(view.positions[rows].tolist(), gained.tolist()):
                self._values[p] = self._values.get(p, 0.0) + g
        return np.array([self._values.get(int(p), np.nan) if ok else np.nan for p, ok in zip(view.positions, present)])

    def score(self, view: CacheView) -> np.ndarray:
        total = self.accumulate(view)
        return np.where(np.isnan(total), np.inf, total)


class ImportanceSampling(HeavyHitters):
    """Importance sampling: keep a random subset drawn without replacement with probability proportional
    to accumulated attention (weighted reservoir keys ``log(u) / w``, Efraimidis & Spirakis), so
    low-attention tokens keep a chance that H2O's deterministic top-k never gives them. Seeded."""

    name = "importance"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = np.random.default_rng(seed)

    def score(self, view: CacheView) -> np.ndarray:
        total = self.accumulate(view)
        weight = np.clip(np.nan_to_num(total, nan=np.inf), 1e-12, None)
        return np.log(self._rng.random(len(view))) / weight

    def state(self) -> dict[str, np.ndarray]:
        return {**super().state(), **with_prefix("draws", rng_state(self._rng))}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        rng = np.random.default_rng()
        load_rng(rng, under_prefix("draws", state))  # checked on a new generator first: nothing changes on a bad state
        super().load_state({k: v for k, v in state.items() if not k.startswith("draws.")})
        self._rng = rng


class LatestQuery(EvictionPolicy):
    """TOVA (Oren et al., 2024): keep the tokens the latest query attends to most (mean over heads)."""

    name = "tova"
    needs_hidden = True

    def score(self, view: CacheView) -> np.ndarray:
        def latest_query(rows: np.ndarray) -> np.ndarray:
            hidden = view.hidden[rows]  # type: ignore[index]
            return last_layer.attention(view.model_path, hidden, view.positions[rows], np.array([rows.size - 1])).mean(axis=0)[0]

        return last_layer.score_captured(view, self.name, latest_query)
