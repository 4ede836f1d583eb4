"""Policies that need no model: recency (StreamingLLM's window, with :class:`KeepSinks`) and random."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvagent.policies.base import CacheView, EvictionPolicy, load_rng, rng_state


class Recency(EvictionPolicy):
    """Keep the most recent tokens: score = position. Wrapped in ``KeepSinks`` it is StreamingLLM's
    attention-sink + sliding-window cache (Xiao et al., 2023), the paper's sliding-window baseline."""

    name = "window"

    def score(self, view: CacheView) -> np.ndarray:
        return view.positions.astype(np.float64)


class RandomScores(EvictionPolicy):
    """Uniform random scores (seeded): the floor any informed policy must beat."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def score(self, view: CacheView) -> np.ndarray:
        return self._rng.random(len(view))

    def state(self) -> dict[str, np.ndarray]:
        return rng_state(self._rng)

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        rng = np.random.default_rng()
        load_rng(rng, state)
        self._rng = rng
