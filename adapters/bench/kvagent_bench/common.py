"""What every benchmark shares: where results go, the machine description, median, JSON writing, and
95% confidence intervals for accuracies (Wilson) and perplexities (block bootstrap).

The results folder, the machine description and JSON writing live in :mod:`kvagent.results` (the
measurement commands outside the benchmarks use them too) and are re-exported here."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvagent.results import RESULTS_DIR, machine, write_json


def read_results(path: Path) -> dict[str, Any]:
    """A results file's JSON, or ``{}`` when it is missing or unreadable (a run that rewrites part of it starts afresh)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` for a proportion of ``successes`` out of ``n`` trials.

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0/n or n/n (E. B. Wilson,
    "Probable inference, the law of succession, and statistical inference", JASA 1927,
    https://doi.org/10.1080/01621459.1927.10502953). ``ValueError`` unless ``0 <= successes <= n`` and ``n >= 1``.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for paired right/wrong outcomes: ``b`` pairs where only the first is right,
    ``c`` where only the second is (an exact binomial test of ``min(b, c)`` out of ``b + c`` at 1/2; McNemar,
    Psychometrika 1947, https://doi.org/10.1007/BF02295996). 1.0 without discordant pairs."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b} and {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def bootstrap_perplexity_interval(nll: Sequence[np.ndarray], block: int = 64, reps: int = 2000, seed: int = 0,
                                  confidence: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval ``(low, high)`` for the perplexity of per-token NLLs, as perplexities.

    ``nll``: one ``[tokens]`` array of negative log-likelihoods (nats) per text. Each text is cut into
    consecutive blocks of ``block`` tokens (the last one may be shorter; no block spans two texts: nearby
    tokens are correlated, blocks keep that); ``reps`` resamples draw as many blocks with replacement and give
    ``exp(sum of NLL / tokens)``; the interval is their ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``
    quantiles. Seeded: the same input and ``seed`` give the same interval. ``(nan, nan)`` without tokens.
    """
    if block < 1 or reps < 1:
        raise ValueError(f"block and reps must be >= 1, got block={block}, reps={reps}")
    _z(confidence)  # validates confidence
    sums, counts = [], []
    for text in nll:
        values = np.asarray(text, dtype=np.float64)
        for start in range(0, values.size, block):
            sums.append(values[start : start + block].sum())
            counts.append(min(block, values.size - start))
    if not sums:
        return float("nan"), float("nan")
    s, c = np.array(sums), np.array(counts, dtype=np.float64)
    pick = np.random.default_rng(seed).integers(0, s.size, size=(reps, s.size))
    ppl = np.exp(s[pick].sum(axis=1) / c[pick].sum(axis=1))
    low, high = np.quantile(ppl, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def cluster_bootstrap_interval(groups: Sequence[Sequence[bool]], reps: int = 2000, seed: int = 0,
                               confidence: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval ``(low, high)`` for the share of successes when they come in correlated
    ``groups`` (the questions of one context): contexts are resampled with replacement, each bringing all its
    answers. Seeded; ``(nan, nan)`` without answers."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    _z(confidence)
    hits = np.array([sum(bool(x) for x in g) for g in groups], dtype=np.float64)
    sizes = np.array([len(g) for g in groups], dtype=np.float64)
    if not sizes.sum():
        return float("nan"), float("nan")
    pick = np.random.default_rng(seed).integers(0, hits.size, size=(reps, hits.size))
    share = hits[pick].sum(axis=1) / np.maximum(sizes[pick].sum(axis=1), 1)
    low, high = np.quantile(share, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def paired_ratio_interval(groups: Sequence[tuple[Sequence[bool], Sequence[bool]]], reps: int = 2000, seed: int = 0,
                          confidence: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval ``(low, high)`` for ``successes(a) / successes(b)`` over paired ``groups``
    (per context: its answers under ``a`` and under ``b``, the reference): contexts are resampled with replacement,
    each bringing both its answer sets. Seeded; resamples where ``b`` has no success are left out; ``(nan, nan)``
    when none is left."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    _z(confidence)
    a = np.array([sum(bool(x) for x in g) for g, _ in groups], dtype=np.float64)
    b = np.array([sum(bool(x) for x in g) for _, g in groups], dtype=np.float64)
    if not a.size:
        return float("nan"), float("nan")
    pick = np.random.default_rng(seed).integers(0, a.size, size=(reps, a.size))
    den = b[pick].sum(axis=1)
    ok = den > 0
    if not ok.any():
        return float("nan"), float("nan")
    ratio = a[pick].sum(axis=1)[ok] / den[ok]
    low, high = np.quantile(ratio, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


__all__ = ["RESULTS_DIR", "bootstrap_perplexity_interval", "read_results", "cluster_bootstrap_interval", "machine", "mcnemar_exact", "median",
           "paired_ratio_interval", "wilson_interval", "write_json"]
