"""Fidelity guard for transplants: a sampled check against a recompute, with fallback.

A transplant's KV is an approximation (re-rotated keys, repaired seam). On a sampled share of the
syncs that transplanted something, the guard prefills the same tokens in a scratch sequence, compares
the next-token distributions (:func:`logit_cosine`, the logits' cosine less their mean), and when the cosine is
under ``threshold`` it logs a warning and the session adopts the recomputed cells instead. Not in "Models Take Notes at Prefill"
(arXiv:2606.17107): our own
safety net, so a bad transplant (a new model, an odd seam) degrades speed, not answers.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The plain cosine of two vectors (logits ``[vocab]``: it counts a constant added to every logit, which the
    softmax ignores; :func:`logit_cosine` does not). What the benchmarks quoted as "cosine" before 2026-12-04."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def next_token_kl(reference: np.ndarray, ours: np.ndarray) -> float:
    """KL(p_reference || p_ours) in nats between the softmaxes of two logit vectors ``[vocab]``: how much of the
    reference's next-token distribution the other loses (0 for the same distribution, shifts included)."""
    lr, lo = _log_softmax(reference), _log_softmax(ours)
    return float(np.exp(lr) @ (lr - lo))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64).ravel()
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def logit_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of two next-token logit vectors ``[vocab]``, each less its own mean over the vocabulary.

    A constant added to every logit leaves the softmax unchanged, so it must not move the measure: a raw cosine
    counts it. Measured (SmolLM2, a tool spec transplanted behind a policy and a field, 2026-12-04): the
    transplant's logits sat 2.36 below the recompute's everywhere (spread 0.37), the same distribution
    (KL 0.0015, the same top 4), raw cosine 0.815, this 0.994. The other way on Gemma-3's 262k-entry vocabulary,
    whose shared mean inflates a raw cosine: a skill transplanted at seam 0, raw 0.989, this 0.938, KL 0.76.
    1.0 for two constant vectors (both uniform). Scale-invariant too (a change of temperature does not move it;
    :func:`next_token_kl` does), which a transplant's approximation does not produce.
    """
    x = a.astype(np.float64).ravel()
    y = b.astype(np.float64).ravel()
    x, y = x - x.mean(), y - y.mean()
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return float(x @ y / (nx * ny))


@dataclass
class FidelityGuard:
    """Check a ``rate`` share of transplanting syncs; fall back below ``threshold`` (:func:`logit_cosine`)."""

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

    cosine = staticmethod(logit_cosine)
