"""Move a saved sequence's cells to other positions in its bytes: RoPE re-rotation of the keys before restore.

A transplant places a compiled skill's cells at the position it takes in a new prompt. ``seq_add`` does that
inside llama.cpp, but it leaves a pending K-shift that llama.cpp applies to the whole KV buffer (every cell of
every layer, ``build_graph_shift``) at the next decode: a prompt with N skills pays N whole-buffer rotations,
most of the time of a turn with many tools. Rotating the keys of the skill's own cells in its saved bytes, and
restoring them where they belong, leaves nothing pending.

RoPE rotations compose: a key cached at position ``p`` becomes the key at ``p + delta`` by one more rotation of
angle ``delta * freq_scale * base^(-2i / n_rot)`` on each pair ``i`` of each head's first ``n_rot`` dimensions
(adjacent pairs in ggml's NORM mode, halves in NEOX mode), the same rotation llama.cpp's K-shift applies
("Models Take Notes at Prefill", arXiv:2606.17107, for why a transplant may do this at all).

The bytes are llama.cpp's per-sequence state (``llama_state_seq_get_data``): an 8-byte header, then one block
per KV cache (two for sliding-window models: the full-attention layers' cache, then the sliding-window one),
each ``u32 n_stream``, per stream ``u32 cell_count``, per cell ``i32 pos, u32 n_seq_id, u32 seq_id[n]``, then
``u32 v_trans, u32 n_layer``, per layer ``i32 type, u64 row_size`` and ``cell_count`` key rows, then the values.
Keys must be f16 (kvagent's contexts store f16 KV). Anything else is refused with :class:`ValueError` and the
caller falls back to ``seq_add``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

GGML_TYPE_F16 = 1


@dataclass(frozen=True)
class RopeLayout:
    """How a model's saved keys are rotated.

    ``caches[c][j]``: (RoPE base, frequency scale) of the ``j``-th layer stored in the state's ``c``-th KV cache
    block. ``style``: ``"norm"`` (adjacent pairs) or ``"neox"`` (halves). Each key row is ``n_head_kv`` heads of
    ``head_dim`` values, the first ``n_rot`` of each head rotated.
    """

    style: str
    head_dim: int
    n_rot: int
    caches: tuple[tuple[tuple[float, float], ...], ...]


def _angles(delta: int, base: float, scale: float, n_rot: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[n_rot // 2]`` of the rotation by ``delta``, computed as ggml's CPU RoPE computes them: in
    float32, each pair's angle the previous one times ``base^(-2/n_rot)``. Its relative error in each angle is
    the same at every position, so its rotations compose exactly (p, then delta, is p + delta, as a cold prefill
    computes it); exact angles would differ from both by that error (measured: a logit cosine of 0.9989 against
    ``seq_add`` on a SmolLM2 prompt with two skills)."""
    f32 = np.float32
    theta_scale = f32(np.power(f32(base), f32(-2.0) / f32(n_rot), dtype=np.float32))
    theta, thetas = f32(delta), np.empty(n_rot // 2, dtype=np.float32)
    for i in range(n_rot // 2):
        thetas[i] = f32(scale) * theta
        theta = f32(theta * theta_scale)
    return np.cos(thetas), np.sin(thetas)


def _rotate(rows: np.ndarray, delta: int, base: float, scale: float, layout: RopeLayout) -> np.ndarray:
    """``rows: [cells, n_head_kv * head_dim]`` f16 keys rotated by ``delta`` positions; returns f16."""
    n, width = rows.shape
    heads = rows.astype(np.float32).reshape(n, width // layout.head_dim, layout.head_dim)
    half = layout.n_rot // 2
    cos, sin = _angles(delta, base, scale, layout.n_rot)
    if layout.style == "norm":
        x1, x2 = heads[..., 0 : layout.n_rot : 2], heads[..., 1 : layout.n_rot : 2]
        r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        heads[..., 0 : layout.n_rot : 2], heads[..., 1 : layout.n_rot : 2] = r1, r2
    else:
        x1, x2 = heads[..., :half].copy(), heads[..., half : layout.n_rot].copy()
        heads[..., :half], heads[..., half : layout.n_rot] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return heads.reshape(n, width).astype(np.float16)


def shift_saved(payload: bytes, start: int, delta: int, layout: RopeLayout) -> bytes:
    """``payload`` with every cell at position ``>= start`` moved by ``delta``: its position rewritten and its
    keys re-rotated in every layer. Cells below ``start`` are kept as they are.

    Raises :class:`ValueError` where the bytes do not have the layout described in the module docstring (another
    llama.cpp state format, quantized keys, a cache count other than ``layout``'s).
    """
    data = bytearray(payload)
    off, caches = 8, 0
    try:
        while off < len(data):
            if caches >= len(layout.caches):
                raise ValueError(f"more KV cache blocks than the {len(layout.caches)} expected")
            layers = layout.caches[caches]
            (n_stream,), off = struct.unpack_from("<I", data, off), off + 4
            for _ in range(n_stream):
                (count,), off = struct.unpack_from("<I", data, off), off + 4
                moved = np.zeros(count, dtype=bool)
                for c in range(count):
                    pos, n_ids = struct.unpack_from("<iI", data, off)
                    if pos >= start:
                        struct.pack_into("<i", data, off, pos + delta)
                        moved[c] = True
                    off += 8 + 4 * n_ids
                if count == 0:
                    continue
                v_trans, n_layer = struct.unpack_from("<II", data, off)
                off += 8
                if n_layer != len(layers):
                    raise ValueError(f"a KV cache block has {n_layer} layers, the model's layout says {len(layers)}")
                for base, scale in layers:
                    kind, row = struct.unpack_from("<iQ", data, off)
                    off += 12
                    if kind != GGML_TYPE_F16 or row % 2 or (row // 2) % layout.head_dim:
                        raise ValueError(f"keys of type {kind} with rows of {row} bytes: only f16 keys are rotated")
                    keys = np.frombuffer(data, np.float16, count * row // 2, off).reshape(count, row // 2)
                    if moved.any() and delta:
                        rotated = keys.copy()
                        rotated[moved] = _rotate(keys[moved], delta, base, scale, layout)
                        data[off : off + count * row] = rotated.tobytes()
                    off += count * row
                for _ in range(n_layer):  # values: not rotated, skipped
                    if not v_trans:
                        _, row = struct.unpack_from("<iQ", data, off)
                        off += 12 + count * row
                    else:
                        _, size, n_embd = struct.unpack_from("<iII", data, off)
                        off += 12 + count * n_embd * size
            caches += 1
    except struct.error as exc:
        raise ValueError(f"saved sequence bytes end early ({exc})") from None
    if off != len(data) or caches != len(layout.caches):
        raise ValueError(f"saved sequence bytes hold {caches} KV cache blocks ending at {off} of {len(data)} bytes")
    return bytes(data)
