"""Token sampling from one row of logits: greedy, or temperature with top-k / top-p (nucleus).

Sampling is done in numpy on the logits the backend returns, so it is the same for every backend and
reproducible with a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by the temperature, cut to
    the ``top_k`` best (0 = no cut) and to the smallest set whose probability reaches ``top_p``, then
    sampled with a generator seeded by ``seed`` (``None`` = fresh entropy).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no cut), got {self.top_k}")


@dataclass
class Sampler:
    """Stateful sampler (owns its random generator) for one generation."""

    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """Pick a token id from ``logits`` of shape ``[n_vocab]``."""
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        order = np.argsort(-scaled, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        top = scaled[order]
        probs = np.exp(top - top[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self._rng.choice(len(order), p=probs)])
