"""Which tier a collected case runs in (tests/conftest.py applies it). Four tiers, each a ``pytest -m`` expression
(:data:`SELECT`):

- ``fast``: ``pytest`` (pyproject.toml's default), ``make test``;
- ``full``: the rest of what CI runs, ``make test-full`` (``make test-all`` runs both);
- ``copies``: a model-independent check's copies on the test models after the first (Gemma-3's), ``make
  test-copies``: the check runs in CI once, on the first model; the copies where a developer asks for them;
- ``engines``: the cases that start a third-party engine built by a make target of its own (llama.cpp's
  ``llama-server``, vLLM's CPU build), ``make test-engines``. CI never runs them, even where the engines are built:
  their binaries are left on a machine by hand, not declared by the project's set-up.

The rule, first match: a case marked ``engines`` is in the engines tier. A case that runs on a test model after the
first of :data:`tests.models.MODELS` (a parameter of the case), is not marked ``arch`` (its outcome does not depend
on the architecture) and was not put in the full tier by name (below) is a copy. A case marked ``slow``, ``e2e``,
``bench`` or ``full`` (see pyproject.toml's markers), or run on another registry model (Qwen2.5's tool-trained
checks) and not marked ``arch``, is in the full tier. Everything else is fast: every check once on the first model, and the architecture's checks on every model."""

from __future__ import annotations

from typing import Iterable, Literal

import pytest

from kvagent.models import REGISTRY
from tests.models import FIRST, MODELS

Tier = Literal["fast", "full", "copies", "engines"]

FULL_TIER_MARKERS = frozenset({"slow", "e2e", "bench", "full"})
ENGINES_MARKER = "engines"
COPIES_MARKER = "copies"
SELECT: dict[Tier, str] = {"fast": "not full and not copies and not engines",
                           "full": "full and not copies and not engines",
                           "copies": "copies and not engines",
                           "engines": "engines"}
"""Each tier's ``pytest -m`` expression: the fast one is pyproject.toml's default, the others the Makefile's
(``FULL_TIER``, ``COPIES_TIER``, ``test-engines``); tests/unit/test_tiers.py checks both files agree. ``full`` and ``copies`` are markers
tests/conftest.py adds by the rule (a case may also carry ``full`` itself)."""
COPY_MODELS = frozenset(MODELS[1:])
"""The test models after the first: a model-independent check's runs on them are its copies."""
KNOWN_MODELS = frozenset(REGISTRY) | frozenset(MODELS)
"""Names a case's parameter is read as a model by: the registry's and the test models (cases list models by name
even where ``$KVAGENT_TEST_MODELS`` narrows the test models)."""


def tier(marks: Iterable[str], models: Iterable[str]) -> Tier:
    """The tier of a case with these markers, run on these models (the module's rule)."""
    names, models = set(marks), set(models)
    if ENGINES_MARKER in names:
        return "engines"
    if "arch" not in names and models & COPY_MODELS and not names & FULL_TIER_MARKERS:
        return "copies"
    if names & FULL_TIER_MARKERS or (models - {FIRST} and "arch" not in names):
        return "full"
    return "fast"


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

