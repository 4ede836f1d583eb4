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

The bytes are llama.cpp's per-sequence state (``llama_state_seq_get_data``), read by
:func:`kvagent.backends.state.read_blocks` (two caches for sliding-window models: the full-attention layers', then the
sliding-window one). Keys must be f16 (kvagent's contexts store f16 KV). Anything else is refused with
:class:`ValueError` and the caller falls back to ``seq_add``.
"""

from __future__ import annotations

import struct

import numpy as np

from kvagent.backends.base import RopeLayout
from kvagent.backends.state import read_blocks


class MoveCollision(ValueError):
    """A move back would land cells on positions the payload keeps (or below 0): this payload cannot move so."""


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
    """``rows: [cells, n_head_kv * head_dim]`` f16 keys rotated by ``delta`` positions, in place; returns ``rows``.

    ggml's products, ``x1 * cos - x2 * sin`` and ``x1 * sin + x2 * cos``, in float32 on each pair (adjacent in
    NORM mode, the two halves in NEOX mode), each product and sum rounded to float32 as ggml rounds it, the result
    to f16. Only the rotated dimensions are read and written (the rest of each head stays as it was). (A complex
    multiplication of NORM pairs is 40% faster but rounds 1 in 10^4 values differently: measured to move a
    three-skill transplant's logits on SmolLM2 from a cosine above 0.96 to 0.953 against a cold prefill, so the
    arithmetic stays as validated.)"""
    n, width = rows.shape
    heads = rows.view()
    heads.shape = (n, width // layout.head_dim, layout.head_dim)  # a view or an error, never a silent copy
    cos, sin = _angles(delta, base, scale, layout.n_rot)
    if layout.style == "norm":
        first, second = heads[..., 0 : layout.n_rot : 2], heads[..., 1 : layout.n_rot : 2]
    else:
        half = layout.n_rot // 2
        first, second = heads[..., :half], heads[..., half : layout.n_rot]
    x1, x2 = first.astype(np.float32), second.astype(np.float32)  # contiguous copies: one pass each
    r1 = x1 * cos
    r1 -= x2 * sin
    x1 *= sin  # x1 is not read again: the second product reuses its buffer
    x2 *= cos
    x1 += x2
    first[...], second[...] = r1, x1
    return rows


def shift_saved(payload: bytes | bytearray, start: int, delta: int, layout: RopeLayout, *,
                in_place: bool = False) -> bytearray:
    """``payload`` with every cell at position ``>= start`` moved by ``delta``: its position rewritten and its
    keys re-rotated in every layer. Cells below ``start`` are kept as they are. The payload is copied first,
    unless ``in_place`` (a ``bytearray`` the caller owns, e.g. a fresh ``seq_save_writable``): then it is
    rewritten where it lies and returned (a sequence's state is tens of MB).

    A move back (``delta < 0``) is allowed where no kept cell lies in ``[start + delta, start)`` and no position
    would fall below 0 (a splice moving the run after a field that got shorter: the bytes hold only that run).

    Raises :class:`ValueError` where the bytes do not have the layout ``kvagent.backends.state.read_blocks`` reads
    (another llama.cpp state format, quantized keys) or another count of caches or layers than ``layout``'s,
    or :class:`MoveCollision` (a ``ValueError``) where a move back would land cells on kept positions or below 0.
    """
    if in_place and not isinstance(payload, bytearray):
        raise TypeError("in_place needs a bytearray (the bytes are rewritten where they lie)")
    data = payload if in_place else bytearray(payload)
    blocks, n_caches = read_blocks(data)
    if n_caches != len(layout.caches):
        raise ValueError(f"{n_caches} KV cache blocks, the model's layout says {len(layout.caches)}")
    for block in blocks:
        layers = layout.caches[block.cache]
        if len(block.layers) != len(layers):
            raise ValueError(f"a KV cache block has {len(block.layers)} layers, the model's layout says {len(layers)}")
        if delta < 0 and any(start + delta <= p < start or (p >= start and p + delta < 0) for p in block.positions):
            raise MoveCollision(f"moving the cells from {start} back by {-delta} would land them on kept cells or "
                                "below position 0")
        moved = np.array([p >= start for p in block.positions], dtype=bool)
        if not moved.any() or not delta:
            continue
        for p, at in zip(block.positions, block.position_offsets):
            if p >= start:
                struct.pack_into("<i", data, at, p + delta)
        every = bool(moved.all())  # a splice's parked run, a transplant without a sink: no gather
        for i, (base, scale) in enumerate(layers):
            keys = block.keys(data, i)  # a writable view into ``data``
            if keys.shape[1] % layout.head_dim:
                raise ValueError(f"key rows of {keys.shape[1]} values are not heads of {layout.head_dim}")
            if every:
                _rotate(keys, delta, base, scale, layout)
            else:
                keys[moved] = _rotate(keys[moved], delta, base, scale, layout)  # the gather is a copy
    return data  # not copied again: a sequence's state is tens of MB (the backend restores from it as it is)
