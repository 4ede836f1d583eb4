"""The value vectors of a saved sequence (``llama_state_seq_get_data``'s bytes, read by
:func:`kvagent.backends.state.read_blocks`) and ranking the cells of a transplant by how far their values are from
a cold prefill's (selective recompute, CacheBlend: Yao et al., "CacheBlend: Fast Large Language Model Serving for
RAG with Cached Knowledge Fusion", EuroSys 2025).

Values carry no position (RoPE rotates the keys only), so the values of one token computed at two positions
compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvagent.backends.state import read_blocks
from kvagent.errors import BackendError


@dataclass(frozen=True)
class CacheValues:
    """One cache of a saved sequence: ``positions`` [cells] and per layer its values ``[cells, n_embd_v]`` (f16)."""

    positions: tuple[int, ...]
    values: tuple[np.ndarray, ...]

    def rows(self, positions: list[int]) -> list[np.ndarray]:
        """Per layer the value rows of ``positions`` (each must be held), ``[len(positions), n_embd_v]`` f32."""
        index = {p: i for i, p in enumerate(self.positions)}
        rows = [index[p] for p in positions]
        return [v[rows].astype(np.float32) for v in self.values]


def parse_values(data: bytes) -> list[CacheValues]:
    """The caches of a saved sequence (the layout :func:`~kvagent.backends.state.read_blocks` reads), empty ones
    left out; ``BackendError`` when the bytes are not in that layout (another llama.cpp, a quantised cache)."""
    try:
        blocks, _ = read_blocks(data)
        for b in blocks:
            for i in range(len(b.layers)):
                b.keys(data, i)  # f16 keys too: the layout this reader knows
        return [CacheValues(b.positions, tuple(b.values(data, i) for i in range(len(b.layers)))) for b in blocks]
    except ValueError as exc:
        raise BackendError(f"cannot read values from this llama.cpp's state format ({exc})") from exc


def value_deviation(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Per row, the sum over layers of ``||a_l[i] - b_l[i]|| / mean_j ||b_l[j]||`` (``a_l``, ``b_l``: one layer's
    values of the same tokens, ``[n, n_embd_v]``); ``[n]``. Zero for identical values."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} layers against {len(b)}")
    n = a[0].shape[0] if a else 0
    out = np.zeros(n, np.float64)
    for x, y in zip(a, b):
        if x.shape != y.shape:
            raise ValueError(f"layer shapes {x.shape} and {y.shape}")
        scale = float(np.linalg.norm(y, axis=1).mean()) + 1e-6
        out += np.linalg.norm(x - y, axis=1) / scale
    return out


def rank_deviating(compiled: bytes, offset_compiled: int, reference: bytes, offset_reference: int, length: int,
                   first: int = 0) -> tuple[int, ...]:
    """The offsets ``first..length-1`` of a span by decreasing value deviation between two saved sequences that
    hold its ``length`` tokens from positions ``offset_compiled`` and ``offset_reference`` (a skill compiled behind
    its sink, the same tokens prefilled cold behind another prefix); deviations summed over every cache that holds
    both (a sliding-window cache only holds its window), ties by offset."""
    dev = np.zeros(length, np.float64)
    for ca, cb in zip(parse_values(compiled), parse_values(reference)):
        held_a, held_b = set(ca.positions), set(cb.positions)
        offsets = [i for i in range(length) if offset_compiled + i in held_a and offset_reference + i in held_b]
        if not offsets:
            continue
        d = value_deviation(ca.rows([offset_compiled + i for i in offsets]), cb.rows([offset_reference + i for i in offsets]))
        dev[offsets] += d
    candidates = np.arange(first, length)
    order = candidates[np.argsort(-dev[first:], kind="stable")]
    return tuple(int(i) for i in order)


__all__ = ["CacheValues", "parse_values", "rank_deviating", "value_deviation"]
