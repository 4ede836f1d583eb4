"""Fidelity guard for transplants: a sampled check against a recompute, with fallback.

A transplant's KV is an approximation (re-rotated keys, repaired seam). On a sampled share of the
syncs that transplanted something, the guard prefills the same tokens in a scratch sequence, compares
the next-token distributions (cosine of the logits), and when the cosine is under ``threshold`` it
logs a warning and the session adopts the recomputed cells instead. Not in "Models Take Notes at Prefill"
(arXiv:2606.17107): our own
safety net, so a bad transplant (a new model, an odd seam) degrades speed, not answers.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class FidelityGuard:
    """Check a ``rate`` share of transplanting syncs; fall back below cosine ``threshold``."""

    rate: float = 1.0
    threshold: float = 0.99
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine in [-1, 1], got {self.threshold}")
        self._rng = random.Random(self.seed)

    def sampled(self) -> bool:
        return self._rng.random() < self.rate

    @staticmethod
    def cosine(a: np.ndarray, b: np.ndarray) -> float:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))
