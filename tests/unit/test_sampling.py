"""Sampler: greedy, top-k/top-p cuts, seeded reproducibility, parameter validation."""

from __future__ import annotations

import numpy as np
import pytest

from kvagent.sampling import Sampler, SamplingParams

LOGITS = np.array([0.0, 3.0, 2.5, -1.0, 2.9], dtype=np.float32)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(), {1}),
        (SamplingParams(temperature=1.0, top_k=1, seed=0), {1}),
        (SamplingParams(temperature=1.0, top_p=1e-6, seed=0), {1}),
        (SamplingParams(temperature=1.0, top_k=2, seed=0), {1, 4}),
        (SamplingParams(temperature=5.0, seed=0), {0, 1, 2, 3, 4}),
    ],
)
def test_samples_stay_in_the_allowed_set(params: SamplingParams, allowed: set[int]) -> None:
    sampler = Sampler(params)
    assert {sampler(LOGITS) for _ in range(200)} <= allowed


def test_high_temperature_reaches_beyond_top1() -> None:
    sampler = Sampler(SamplingParams(temperature=5.0, seed=1))
    assert len({sampler(LOGITS) for _ in range(200)}) >= 3


def test_seed_reproduces() -> None:
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [a(LOGITS) for _ in range(50)] == [b(LOGITS) for _ in range(50)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k")],
)
def test_invalid_params(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
