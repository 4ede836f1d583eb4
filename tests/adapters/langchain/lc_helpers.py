"""What the adapter tests share (a module with its own name: ``conftest`` is taken by tests/conftest.py)."""

from __future__ import annotations

import numpy as np

# every adapter test that can uses these settings, so one engine (one model load) serves them all
MODEL = "smollm2-135m"
SETTINGS = {"model": MODEL, "n_ctx": 4096, "n_seq_max": 12}

from kvagent.demo import POLICY  # noqa: E402, F401  (the demo's support policy, re-exported to the tests)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))
