"""The real models the tests run on, in tier order: the first runs every check in the fast tier, the others run
there only the checks that depend on the architecture (``@pytest.mark.arch``), and the rest in the full tier.

``$KVAGENT_TEST_MODELS`` narrows them (scripts/gpu_check.sh)."""

from __future__ import annotations

import os

MODELS = os.environ.get("KVAGENT_TEST_MODELS", "smollm2-135m,gemma3-270m").split(",")
FIRST = MODELS[0]
