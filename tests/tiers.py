"""Which tier a collected case runs in (tests/conftest.py applies it). Three tiers:

- ``fast``: ``pytest`` (pyproject.toml's ``-m 'not full and not engines'``), ``make test``;
- ``full``: the rest of what CI runs, ``pytest -m 'full and not engines'`` (``make test-full``);
- ``engines``: the cases that start a third-party engine built by a make target of its own (llama.cpp's
  ``llama-server``, vLLM's CPU build), ``pytest -m engines`` (``make test-engines``). CI never runs them, even where
  the engines are built: their binaries are left on a machine by hand, not declared by the project's set-up.

A case belongs to the engines tier when it is marked ``engines``. Otherwise it belongs to the full tier when it is
marked ``slow``, ``e2e``, ``bench`` or ``full`` (see pyproject.toml's markers), or when it runs on a model after the
first of :data:`tests.models.MODELS` and is not marked ``arch``: a check whose outcome does not depend on the
architecture runs once, on the first model, in the fast tier."""

from __future__ import annotations

from typing import Iterable, Literal

import pytest

from kvagent.models import REGISTRY
from tests.models import FIRST, MODELS

Tier = Literal["fast", "full", "engines"]

FULL_TIER_MARKERS = frozenset({"slow", "e2e", "bench", "full"})
ENGINES_MARKER = "engines"
SELECT: dict[Tier, str] = {"fast": "not full and not engines", "full": "full and not engines", "engines": "engines"}
"""Each tier's ``pytest -m`` expression (the fast one is pyproject.toml's default, scripts/test_tiers.sh passes the
full one, the Makefile's ``test-engines`` the last)."""
KNOWN_MODELS = frozenset(REGISTRY) | frozenset(MODELS)
"""Names a case's parameter is read as a model by: the registry's and the test models (cases list models by name
even where ``$KVAGENT_TEST_MODELS`` narrows the test models)."""


def tier(marks: Iterable[str], models: Iterable[str]) -> Tier:
    """The tier of a case with these markers, run on these models (the module's rule)."""
    names = set(marks)
    if ENGINES_MARKER in names:
        return "engines"
    if names & FULL_TIER_MARKERS or (set(models) - {FIRST} and "arch" not in names):
        return "full"
    return "fast"


def full_tier(marks: Iterable[str], models: Iterable[str]) -> bool:
    """Whether a case with these markers, run on these models, belongs to the full tier."""
    return tier(marks, models) == "full"


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


def tier_of(item: pytest.Item) -> Tier:
    """The tier of the collected case ``item``."""
    return tier((mark.name for mark in item.iter_markers()), models_of(item))


def in_full_tier(item: pytest.Item) -> bool:
    """Whether the collected case ``item`` runs in the full tier only."""
    return tier_of(item) == "full"
