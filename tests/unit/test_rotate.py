"""Re-rotating keys in a saved sequence's bytes (pure logic: bytes built here in llama.cpp's state layout)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvagent.backends.base import RopeLayout
from kvagent.kv.rotate import MoveCollision, shift_saved

HEAD_DIM, HEADS = 8, 2


def state(positions: list[int], keys: list[np.ndarray], values: list[np.ndarray], v_trans: bool = False) -> bytes:
    """One KV cache block, one stream: cells at ``positions``, per layer keys ``[cells, HEADS * HEAD_DIM]`` f16."""
    out = bytearray(8) + struct.pack("<II", 1, len(positions))
    for p in positions:
        out += struct.pack("<iII", p, 1, 0)
    out += struct.pack("<II", int(v_trans), len(keys))
    for k in keys:
        out += struct.pack("<iQ", 1, k.shape[1] * 2) + k.astype(np.float16).tobytes()
    for v in values:
        if v_trans:
            out += struct.pack("<iII", 1, 2, v.shape[1]) + v.T.astype(np.float16).tobytes()
        else:
            out += struct.pack("<iQ", 1, v.shape[1] * 2) + v.astype(np.float16).tobytes()
    return bytes(out)


def read(data: bytes, n_layer: int) -> tuple[list[int], list[np.ndarray]]:
    (count,) = struct.unpack_from("<I", data, 12)
    off, positions = 16, []
    for _ in range(count):
        positions.append(struct.unpack_from("<i", data, off)[0])
        off += 12
    off += 8
    keys = []
    for _ in range(n_layer):
        (row,) = struct.unpack_from("<Q", data, off + 4)
        off += 12
        keys.append(np.frombuffer(data, np.float16, count * row // 2, off).reshape(count, -1).astype(np.float32))
        off += count * row
    return positions, keys


def rotated(k: np.ndarray, delta: int, base: float, style: str, n_rot: int) -> np.ndarray:
    """The reference: each pair as a complex number times ``e^(i delta theta)``."""
    heads = k.reshape(len(k), HEADS, HEAD_DIM).astype(np.float64)
    half = n_rot // 2
    theta = delta * base ** (-np.arange(half) * 2.0 / n_rot)
    a, b = ((heads[..., 0:n_rot:2], heads[..., 1:n_rot:2]) if style == "norm"
            else (heads[..., :half], heads[..., half:n_rot]))
    z = (a + 1j * b) * np.exp(1j * theta)
    out = heads.copy()
    if style == "norm":
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:n_rot] = z.real, z.imag
    return out.reshape(len(k), -1)


CASES = [  # style, n_rot, base, v_trans, start, delta
    ("norm", 8, 10000.0, False, 2, 37),
    ("neox", 8, 1e6, True, 0, 500),
    ("neox", 4, 10000.0, False, 3, 1),  # partial rotary dimensions: the rest of each head untouched
    ("norm", 8, 10000.0, True, 2, 0),  # no move: the bytes come back as they were
    ("neox", 8, 10000.0, False, 5, -3),  # a move back with nothing kept below: a splice after a shorter field
]


@pytest.mark.parametrize(("style", "n_rot", "base", "v_trans", "start", "delta"), CASES)
def test_cells_from_start_move_and_their_keys_rotate(style: str, n_rot: int, base: float, v_trans: bool, start: int,
                                                     delta: int) -> None:
    rng = np.random.default_rng(0)
    positions = [0, 1, 2, 3, 4] if delta >= 0 else [5, 6, 7, 8, 9]
    keys = [rng.normal(size=(5, HEADS * HEAD_DIM)).astype(np.float16) for _ in range(2)]
    values = [rng.normal(size=(5, HEADS * HEAD_DIM)).astype(np.float16) for _ in range(2)]
    payload = state(positions, keys, values, v_trans)
    layout = RopeLayout(style, HEAD_DIM, n_rot, (((base, 1.0), (base, 1.0)),))
    out = shift_saved(payload, start, delta, layout)
    assert len(out) == len(payload) and out[-len(values[0].tobytes()):] == payload[-len(values[0].tobytes()):]
    moved, new_keys = read(out, 2)
    assert moved == [p + delta if p >= start else p for p in positions]
    for old, new in zip(keys, new_keys):
        expected = old.astype(np.float64)
        moving = [i for i, p in enumerate(positions) if p >= start]
        expected[moving] = rotated(old[moving], delta, base, style, n_rot)
        np.testing.assert_allclose(new, expected, atol=4e-3, rtol=2e-3)  # f16 storage
    if delta == 0:
        assert out == payload


BAD = [
    ("quantized keys", lambda p: p[:36] + struct.pack("<i", 8) + p[40:], "not f16"),
    ("cut short", lambda p: p[:-10], "end early"),
    ("a layer count the bytes do not hold", lambda p: p[:32] + struct.pack("<I", 1) + p[36:], "end early"),
    ("another cache count", lambda p: p + p[8:], "KV cache blocks"),
]


@pytest.mark.parametrize(("positions", "start", "delta"), [([0, 1, 2, 3], 2, -1), ([3, 4], 3, -4)])
def test_a_move_back_onto_kept_cells_or_below_zero_is_refused(positions: list[int], start: int, delta: int) -> None:
    k = np.ones((len(positions), HEADS * HEAD_DIM), np.float16)
    layout = RopeLayout("norm", HEAD_DIM, HEAD_DIM, (((1e4, 1.0), (1e4, 1.0)),))
    with pytest.raises(MoveCollision, match="kept cells or below position 0"):
        shift_saved(state(positions, [k, k], [k, k]), start, delta, layout)


@pytest.mark.parametrize(("name", "damage", "match"), BAD, ids=[b[0] for b in BAD])
def test_bytes_in_another_layout_are_refused(name: str, damage, match: str) -> None:
    k = np.ones((1, HEADS * HEAD_DIM), np.float16)
    payload = state([0], [k, k], [k, k])
    layout = RopeLayout("norm", HEAD_DIM, HEAD_DIM, (((1e4, 1.0), (1e4, 1.0)),))
    with pytest.raises(ValueError, match=match):
        shift_saved(damage(payload), 0, 5, layout)


def test_a_model_layout_with_other_layers_is_refused() -> None:
    k = np.ones((1, HEADS * HEAD_DIM), np.float16)
    three = RopeLayout("norm", HEAD_DIM, HEAD_DIM, (((1e4, 1.0),) * 3,))
    with pytest.raises(ValueError, match="2 layers, the model's layout says 3"):
        shift_saved(state([0], [k, k], [k, k]), 0, 5, three)
