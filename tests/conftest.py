"""Shared fixtures: one engine per real model for the whole run (loading is the slow part)."""

from __future__ import annotations

import os

# before torch loads anywhere: idle OpenMP threads must not spin against llama.cpp (kvagent.reference)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import Iterator

import pytest

from kvagent.skills.fidelity import cosine  # noqa: F401  (the plain cosine; the tests import it from here)

MODELS = os.environ.get("KVAGENT_TEST_MODELS", "smollm2-135m,gemma3-270m").split(",")
"""The models the ``engine`` fixture runs on; ``$KVAGENT_TEST_MODELS`` narrows them (scripts/gpu_check.sh)."""

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


@pytest.fixture(scope="session", params=MODELS)
def engine(request: pytest.FixtureRequest) -> Iterator["object"]:
    from kvagent import Engine

    eng = Engine.load(request.param, n_ctx=2048, n_seq_max=6)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def reference(engine: "object") -> "object":
    """The torch reference model on the same GGUF as ``engine`` (skipped without the torch extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from kvagent.reference.model import ReferenceModel

    return ReferenceModel.load(engine.model.path)  # type: ignore[attr-defined]
