"""The fidelity measures: a shift of every logit is not a difference, a change of distribution is."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvagent.skills.fidelity import FidelityGuard, cosine, logit_cosine, next_token_kl

BASE = np.array([2.0, 7.5, -1.0, 0.5, 3.0], np.float32)


@pytest.mark.parametrize(("other", "shift_invariant", "plain_below", "kl_zero"), [
    (BASE, 1.0, None, True),
    (BASE - 2.36, 1.0, 0.99, True),  # the SmolLM2 case: the same distribution, every logit lower
    (BASE + 40.0, 1.0, 0.9, True),
    (-BASE, -1.0, None, False),
    (BASE[::-1].copy(), None, None, False),
])
def test_a_shift_is_not_a_difference(other: np.ndarray, shift_invariant: float | None, plain_below: float | None,
                                     kl_zero: bool) -> None:
    if shift_invariant is not None:
        assert logit_cosine(BASE, other) == pytest.approx(shift_invariant, abs=1e-9)
    else:
        assert logit_cosine(BASE, other) < 0.9
    if plain_below is not None:
        assert cosine(BASE, other) < plain_below  # what the plain cosine counted
    kl = next_token_kl(BASE, other)
    assert (kl == pytest.approx(0.0, abs=1e-9)) is kl_zero and kl >= -1e-12


def test_kl_by_hand() -> None:
    p, q = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert next_token_kl(np.log(p), np.log(q) + 3.0) == pytest.approx(expected)


@pytest.mark.parametrize(("a", "b", "expected"), [
    (np.zeros(4), np.full(4, 3.0), 1.0),  # both uniform
    (np.zeros(4), BASE[:4], 0.0),
])
def test_constant_logits(a: np.ndarray, b: np.ndarray, expected: float) -> None:
    assert logit_cosine(a, b) == expected


def test_the_guard_measures_by_the_shift_invariant_cosine() -> None:
    assert FidelityGuard.cosine is logit_cosine and FidelityGuard().cosine(BASE, BASE - 5.0) == pytest.approx(1.0)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(2, 64), elements=st.floats(-30, 30, width=32)), st.floats(-50, 50, width=32))
def test_any_shift_leaves_both_measures_unchanged(logits: np.ndarray, shift: float) -> None:
    noise = np.sin(np.arange(len(logits), dtype=np.float32))  # a fixed second vector, not a shift of the first
    # shifted in float64: in float32 a shift of 50 rounds away differences below ~4e-6 (a nearly constant vector
    # becomes constant), which changes the vector itself, not the measure's invariance
    shifted = logits.astype(np.float64) + shift
    assert logit_cosine(shifted, noise) == pytest.approx(logit_cosine(logits, noise), abs=1e-4)
    assert next_token_kl(shifted, noise) == pytest.approx(next_token_kl(logits, noise), abs=1e-4)
