"""The benchmarks' 95% intervals: Wilson for accuracies, a block bootstrap for perplexities."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvagent_bench.common import bootstrap_perplexity_interval, mcnemar_exact, wilson_interval

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

# (successes, n, low, high): 95% Wilson score intervals. The first three: the closed form at 0/n, p = 1/2 and
# n/n; the others are the published figures of R. G. Newcombe, "Two-sided confidence intervals for the single
# proportion: comparison of seven methods", Statistics in Medicine 17 (1998), table II, method 3.
WILSON = [
    (0, 30, 0.0, 0.1135),
    (15, 30, 0.3315, 0.6685),
    (30, 30, 0.8865, 1.0),
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
]


@pytest.mark.parametrize(("k", "n", "low", "high"), WILSON)
def test_wilson_matches_known_intervals(k: int, n: int, low: float, high: float) -> None:
    got = wilson_interval(k, n)
    assert got == pytest.approx((low, high), abs=5e-5)
    assert got[0] <= k / n <= got[1]


@pytest.mark.parametrize(("k", "n"), [(0, 30), (7, 30), (15, 30), (1, 3)])
def test_wilson_is_symmetric_and_narrows_with_lower_confidence(k: int, n: int) -> None:
    low, high = wilson_interval(k, n)
    mirror = wilson_interval(n - k, n)
    assert (low, high) == pytest.approx((1 - mirror[1], 1 - mirror[0]))
    narrow = wilson_interval(k, n, confidence=0.8)
    assert low <= narrow[0] <= narrow[1] <= high


@pytest.mark.parametrize(("k", "n", "confidence"), [(0, 0, 0.95), (-1, 10, 0.95), (11, 10, 0.95), (1, 10, 1.0),
                                                    (1, 10, 0.0)])
def test_wilson_refuses_impossible_counts(k: int, n: int, confidence: float) -> None:
    with pytest.raises(ValueError):
        wilson_interval(k, n, confidence)


def noisy(seed: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).gamma(2.0, 1.6, size=tokens)  # NLL-like: positive, skewed, mean 3.2


# (name, texts of per-token NLL, what must hold of (low, high) given the pooled perplexity)
BOOTSTRAP = [
    ("constant", [np.full(300, 2.5)], lambda lo, hi, ppl: lo == pytest.approx(ppl) and hi == pytest.approx(ppl)),
    ("noisy", [noisy(0, 1024)], lambda lo, hi, ppl: lo < ppl < hi),
    ("two texts", [noisy(1, 511), noisy(2, 700)], lambda lo, hi, ppl: lo < ppl < hi),
    # blocks never span texts: two 10-token texts are two blocks, so resamples give exp(1), exp(1.5) or exp(2)
    ("short texts", [np.full(10, 1.0), np.full(10, 2.0)],
     lambda lo, hi, ppl: lo == pytest.approx(math.e) and hi == pytest.approx(math.exp(2.0))),
]


@pytest.mark.parametrize(("texts", "holds"), [b[1:] for b in BOOTSTRAP], ids=[b[0] for b in BOOTSTRAP])
def test_bootstrap_interval(texts: list[np.ndarray], holds) -> None:  # type: ignore[no-untyped-def]
    ppl = math.exp(sum(t.sum() for t in texts) / sum(t.size for t in texts))
    low, high = bootstrap_perplexity_interval(texts, seed=3)
    assert holds(low, high, ppl)
    assert bootstrap_perplexity_interval(texts, seed=3) == (low, high)  # seeded


def test_bootstrap_narrows_with_more_blocks_and_depends_on_the_seed() -> None:
    short = bootstrap_perplexity_interval([noisy(4, 256)])
    long = bootstrap_perplexity_interval([noisy(4, 4096)])
    assert long[1] - long[0] < short[1] - short[0]
    assert bootstrap_perplexity_interval([noisy(4, 1024)], seed=1) != bootstrap_perplexity_interval([noisy(4, 1024)])


def test_bootstrap_without_tokens_is_nan_and_bad_arguments_are_refused() -> None:
    assert all(math.isnan(x) for x in bootstrap_perplexity_interval([]))
    assert all(math.isnan(x) for x in bootstrap_perplexity_interval([np.zeros(0)]))
    for kwargs in ({"block": 0}, {"reps": 0}, {"confidence": 1.5}):
        with pytest.raises(ValueError):
            bootstrap_perplexity_interval([noisy(0, 64)], **kwargs)


# --- intervals over contexts (the held-out eviction suite) ------------------------------------------------
def test_cluster_bootstrap_interval_brackets_the_share_and_is_degenerate_when_every_context_agrees() -> None:
    from kvagent_bench.common import cluster_bootstrap_interval

    groups = [[True, True, False], [False, False, False], [True, True, True], [True, False, False]]
    low, high = cluster_bootstrap_interval(groups)
    assert low < 6 / 12 < high and 0 <= low and high <= 1
    assert cluster_bootstrap_interval([[True, False]] * 5) == (0.5, 0.5)
    assert all(np.isnan(cluster_bootstrap_interval([])))


def test_paired_ratio_interval_resamples_contexts_with_their_reference() -> None:
    from kvagent_bench.common import paired_ratio_interval

    same = [([True, False], [True, False]), ([True, True], [True, True]), ([False], [False])]
    assert paired_ratio_interval(same) == (1.0, 1.0)  # a policy that answers like the reference in every context
    half = [([True, False], [True, True]), ([False, True], [True, True]), ([True, False], [True, True])]
    assert paired_ratio_interval(half) == (0.5, 0.5)
    mixed = [([True], [True]), ([False], [True]), ([True, True], [True, False]), ([False], [False])]
    low, high = paired_ratio_interval(mixed)
    assert low < 1.0 < high  # 3 / 3 overall, but the contexts disagree
    assert all(np.isnan(paired_ratio_interval([([True], [False])])))  # the reference never answers


@pytest.mark.parametrize(("b", "c", "p"), [
    (0, 0, 1.0),      # no discordant pair: nothing to test
    (3, 3, 1.0),      # balanced
    (0, 5, 0.0625),   # 2 * (1/2)^5
    (1, 9, 0.021484375),  # 2 * (1 + 10) / 2^10
    (6, 0, 0.03125),
    (10, 20, 0.09873715),  # scipy.stats.binomtest(10, 30).pvalue
])
def test_mcnemar_exact_matches_the_binomial_test(b: int, c: int, p: float) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-6)
    assert mcnemar_exact(c, b) == pytest.approx(p, rel=1e-6)


def test_mcnemar_exact_refuses_negative_counts() -> None:
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)
