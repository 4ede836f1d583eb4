"""Shared fixtures, and the test tiers (the rule is in tests/tiers.py).

``make test`` runs the fast tier: ``pytest`` (its default ``-m 'not full and not engines'``). ``make test-all`` runs
it and then the rest: ``pytest -m 'full and not engines'``; no case runs in both. ``make test-engines`` runs the cases
that start llama.cpp's ``llama-server`` or vLLM (``pytest -m engines``), which CI never runs. A case belongs to the
full tier when it is marked

- ``slow``: long-running;
- ``e2e``: a whole process or a long run of one (the server soak, fuzz at length, the desktop app, the
  examples, the demo, a ten-turn graph);
- ``bench``: a benchmark's smoke test (the benchmarks are their own distribution, ``adapters/bench``);
- ``full``: named for the full tier directly;

or when it runs on a model after the first of :data:`tests.models.MODELS` (a parameter of the case, the
``engine`` fixture's included) and is not marked ``arch``. ``arch`` marks the checks whose outcome depends on
the model's architecture (Gemma-3's sliding window, edits behind it, the torch oracle, ``auto``'s cell-by-cell
check, compaction): those run on every model in the fast tier. Everything else runs once, on the first model,
in the fast tier, and its other models' copies in the full tier.
"""

from __future__ import annotations

import os

# before torch loads anywhere: idle OpenMP threads must not spin against llama.cpp (kvagent.reference)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import Any, Iterator

import pytest

from tests.models import MODELS
from tests.tiers import in_full_tier

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
    # tryfirst: the ``full`` marker must be on each case before ``-m`` deselects by it
    for item in items:
        if in_full_tier(item) and item.get_closest_marker("full") is None:
            item.add_marker(pytest.mark.full)


@pytest.fixture(scope="session", params=MODELS)
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One real engine per test model for the whole run (loading is the slow part)."""
    from kvagent import Engine

    eng = Engine.load(request.param, n_ctx=2048, n_seq_max=6)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def reference(engine: Any) -> Any:
    """The torch reference model on the same GGUF as ``engine`` (skipped without the torch extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from kvagent.transformer.model import Transformer

    return Transformer.load(engine.model.path)
