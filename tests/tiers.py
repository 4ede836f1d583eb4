"""Which tier a collected case runs in (tests/conftest.py applies it; ``pytest`` runs the fast tier, ``pytest -m
full`` the rest). A case belongs to the full tier when it is marked ``slow``, ``e2e``, ``bench`` or ``full`` (see
pyproject.toml's markers), or when it runs on a model after the first of :data:`tests.models.MODELS` and is not
marked ``arch``: a check whose outcome does not depend on the architecture runs once, on the first model, in the
fast tier."""

from __future__ import annotations

from typing import Iterable

import pytest

from kvagent.models import REGISTRY
from tests.models import FIRST, MODELS

FULL_TIER_MARKERS = frozenset({"slow", "e2e", "bench", "full"})
KNOWN_MODELS = frozenset(REGISTRY) | frozenset(MODELS)
"""Names a case's parameter is read as a model by: the registry's and the test models (cases list models by name
even where ``$KVAGENT_TEST_MODELS`` narrows the test models)."""


def full_tier(marks: Iterable[str], models: Iterable[str]) -> bool:
    """Whether a case with these markers, run on these models, belongs to the full tier (the module's rule)."""
    names = set(marks)
    return bool(names & FULL_TIER_MARKERS) or (bool(set(models) - {FIRST}) and "arch" not in names)


def models_of(item: pytest.Item) -> set[str]:
    """The models a collected case runs on, read from its parameters: a model name, or an object whose ``model``
    attribute is one (a case record)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    found: set[str] = set()
    for value in callspec.params.values():
        for candidate in (value, getattr(value, "model", None)):
            if isinstance(candidate, str) and candidate in KNOWN_MODELS:
                found.add(candidate)
    return found


def in_full_tier(item: pytest.Item) -> bool:
    """Whether the collected case ``item`` runs in the full tier only."""
    return full_tier((mark.name for mark in item.iter_markers()), models_of(item))
