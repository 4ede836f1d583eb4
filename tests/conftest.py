"""Shared fixtures, and the test tiers (the rule and each tier's ``-m`` expression: tests/tiers.py).

``make test`` runs the fast tier: ``pytest``. ``make test-all`` runs it and then the full tier (``make test-full``);
no case runs in both, and the two are what CI runs. ``make test-copies`` runs the copies of model-independent checks
on the test models after the first (Gemma-3's), ``make test-engines`` the cases that start llama.cpp's
``llama-server`` or vLLM; CI runs neither. Before ``-m`` deselects, each case gets the marker of its tier where that
tier is ``full`` or ``copies``.
"""

from __future__ import annotations

import os

# before torch loads anywhere: idle OpenMP threads must not spin against llama.cpp (kvagent.reference)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# what the CLI prints is read at one width whatever runs the tests: a terminal, CI, or a pytest-xdist worker (whose
# output is no terminal, so Rich would wrap at 80 columns)
os.environ.setdefault("COLUMNS", "200")

from typing import Any, Iterator

import pytest

from tests.models import MODELS
from tests.tiers import tier_of

# A GPU machine without the model packages (scripts/gpu_check.sh): registry names stand for local files,
# e.g. KVAGENT_TEST_MODEL_FILES=smollm2-135m=/path/smollm2-4l.gguf (a layer-truncated copy, `kvagent gpu truncate`).
# Device placement and flash attention come from the engine's own defaults: $KVAGENT_GPU_LAYERS, $KVAGENT_FLASH_ATTN.
if os.environ.get("KVAGENT_TEST_MODEL_FILES"):
    import dataclasses
    from pathlib import Path

    from kvagent.models import REGISTRY

    for _item in filter(None, os.environ["KVAGENT_TEST_MODEL_FILES"].split(",")):
        _name, _file = _item.split("=", 1)
        REGISTRY[_name] = dataclasses.replace(REGISTRY[_name], locate=lambda f=Path(_file): f)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: the tier's marker must be on each case before ``-m`` deselects by it
    for item in items:
        name = tier_of(item)
        if name in ("full", "copies") and item.get_closest_marker(name) is None:
            item.add_marker(getattr(pytest.mark, name))


@pytest.fixture(scope="session", params=MODELS)
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One real engine per test model for the whole run (loading is the slow part)."""
    from kvagent import Engine

    eng = Engine.load(request.param, n_ctx=2048, n_seq_max=6)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _no_retained_sequences_from_earlier_tests(request: pytest.FixtureRequest) -> None:
    """Each test on the shared engine starts without the sequences earlier tests closed (``SequencePool.retain``) and
    without the prefixes its tiers stored: a cold prefill stays cold, and what a test reuses is what it made.
    Retention itself is tested within tests."""
    for name in ("engine", "core_engine"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            engine.pool.clear_retained()
            if engine.tiers is not None:
                engine.tiers.clear()


@pytest.fixture(scope="session")
def reference(engine: Any) -> Any:
    """The torch reference model on the same GGUF as ``engine`` (skipped without the torch extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from kvagent.transformer.model import Transformer

    return Transformer.load(engine.model.path)
