"""What the adapter tests share (a module with its own name: ``conftest`` is taken by tests/conftest.py)."""

from __future__ import annotations

import numpy as np

# every adapter test that can uses these settings, so one engine (one model load) serves them all
MODEL = "smollm2-135m"
SETTINGS = {"model": MODEL, "n_ctx": 4096, "n_seq_max": 12}

POLICY = """You are the support agent of Northwind Outdoor, a shop for camping gear.
Rules:
1. Be brief: answer in at most two sentences.
2. Orders can be cancelled only while their status is "processing". Shipped orders cannot be cancelled;
   offer a return instead, free within 30 days of delivery.
3. Refunds go back to the original payment method within 5 business days.
4. Never invent order numbers, prices or dates. If you do not know, say so.
5. Gold members get free express shipping on every order."""


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))
