"""Reading the value vectors out of llama.cpp's per-sequence state (``llama_state_seq_get_data``) and ranking
the cells of a transplant by how far their values are from a cold prefill's (selective recompute, CacheBlend:
Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion", EuroSys 2025).

The format (llama.cpp's ``llama_kv_cache::state_write``, f16 caches): an 8-byte header, then per cache (a
sliding-window model writes two: full attention, then the window) the stream count and per stream a cell count,
per cell (pos int32, n_seq_id uint32, the seq ids), then ``v_trans`` and ``n_layer`` (uint32), per layer the keys
(type int32, row bytes uint64, ``count`` rows) and per layer the values (``v_trans`` 0: like the keys; 1: type
int32, element bytes uint32, ``n_embd_v`` uint32 then ``n_embd_v`` columns of ``count`` elements).
Values carry no position (RoPE rotates the keys only), so the values of one token computed at two positions
compare directly.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvagent.errors import BackendError

F16 = 1


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
    """The caches of a saved sequence (see the module docstring), empty ones left out; ``BackendError`` when the
    bytes are not in that format (another llama.cpp, a quantised cache)."""
    caches: list[CacheValues] = []
    off = 8
    try:
        while off < len(data):
            (n_stream,) = struct.unpack_from("<I", data, off)
            off += 4
            for _ in range(n_stream):
                (count,) = struct.unpack_from("<I", data, off)
                off += 4
                positions = []
                for _ in range(count):
                    pos, n_ids = struct.unpack_from("<iI", data, off)
                    off += 8 + 4 * n_ids
                    positions.append(pos)
                if count == 0:
                    continue
                v_trans, n_layer = struct.unpack_from("<II", data, off)
                off += 8
                for _ in range(n_layer):  # keys: skipped
                    kind, row = struct.unpack_from("<iQ", data, off)
                    if kind != F16:
                        raise ValueError(f"key type {kind}, not f16")
                    off += 12 + count * row
                values = []
                for _ in range(n_layer):
                    if not v_trans:
                        kind, row = struct.unpack_from("<iQ", data, off)
                        off += 12
                        if kind != F16:
                            raise ValueError(f"value type {kind}, not f16")
                        values.append(np.frombuffer(data, np.float16, count * row // 2, off).reshape(count, row // 2))
                        off += count * row
                    else:
                        kind, size, n_embd = struct.unpack_from("<iII", data, off)
                        off += 12
                        if kind != F16 or size != 2:
                            raise ValueError(f"value type {kind} ({size} bytes), not f16")
                        values.append(np.frombuffer(data, np.float16, count * n_embd, off).reshape(n_embd, count).T)
                        off += count * n_embd * size
                caches.append(CacheValues(tuple(positions), tuple(values)))
    except (struct.error, ValueError) as exc:
        raise BackendError(f"cannot read values from this llama.cpp's state format ({exc})") from exc
    if off != len(data):
        raise BackendError(f"cannot read values from this llama.cpp's state format ({len(data) - off} bytes left)")
    return caches


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
