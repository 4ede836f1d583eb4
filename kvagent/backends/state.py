"""The one reader of llama.cpp's per-sequence state layout, the bytes ``llama_state_seq_get_data`` writes
(``read_blocks``: positions, key and value rows). The backend reads its cells' positions from them; the KV layer
re-rotates a transplant's keys in them (``kvagent.kv.rotate``) and reads their values (``kvagent.kv.state``).

The format (llama.cpp's ``llama_kv_cache::state_write``, f16 caches): an 8-byte header, then per cache (a
sliding-window model writes two: full attention, then the window) the stream count and per stream a cell count,
per cell (pos int32, n_seq_id uint32, the seq ids), then ``v_trans`` and ``n_layer`` (uint32), per layer the keys
(type int32, row bytes uint64, ``count`` rows) and per layer the values (``v_trans`` 0: like the keys; 1: type
int32, element bytes uint32, ``n_embd_v`` uint32 then ``n_embd_v`` columns of ``count`` elements).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

F16 = 1


@dataclass(frozen=True)
class LayerRows:
    """Where one layer's keys and values lie in a saved sequence's bytes (``count`` rows each)."""

    key_type: int
    key_offset: int
    key_row: int  # bytes per key row
    value_type: int
    value_offset: int
    value_row: int  # v_trans 0: bytes per value row; 1: bytes per element
    n_embd_v: int  # v_trans 1: the value columns (0 otherwise)


@dataclass(frozen=True)
class StateBlock:
    """One stream of one KV cache in a saved sequence: its cells' positions (and where each position's int32
    lies), its layers' rows. ``cache`` counts the caches in the order saved (empty ones too)."""

    cache: int
    positions: tuple[int, ...]
    position_offsets: tuple[int, ...]
    v_trans: bool
    layers: tuple[LayerRows, ...]

    def keys(self, data: bytes | bytearray, layer: int) -> np.ndarray:
        """Layer ``layer``'s keys ``[cells, n_embd_k]`` f16 (a view into ``data``); ``ValueError`` unless f16."""
        rows = self.layers[layer]
        if rows.key_type != F16 or rows.key_row % 2:
            raise ValueError(f"key type {rows.key_type} with rows of {rows.key_row} bytes, not f16")
        n = len(self.positions)
        return np.frombuffer(data, np.float16, n * rows.key_row // 2, rows.key_offset).reshape(n, rows.key_row // 2)

    def values(self, data: bytes | bytearray, layer: int) -> np.ndarray:
        """Layer ``layer``'s values ``[cells, n_embd_v]`` f16 (either layout); ``ValueError`` unless f16."""
        rows, n = self.layers[layer], len(self.positions)
        if not self.v_trans:
            if rows.value_type != F16:
                raise ValueError(f"value type {rows.value_type}, not f16")
            return np.frombuffer(data, np.float16, n * rows.value_row // 2, rows.value_offset).reshape(n, -1)
        if rows.value_type != F16 or rows.value_row != 2:
            raise ValueError(f"value type {rows.value_type} ({rows.value_row} bytes), not f16")
        return np.frombuffer(data, np.float16, n * rows.n_embd_v, rows.value_offset).reshape(rows.n_embd_v, n).T


def read_blocks(data: bytes | bytearray) -> tuple[list[StateBlock], int]:
    """The non-empty streams of every cache of a saved sequence (see the module docstring), and how many caches
    it holds; ``ValueError`` when the bytes are not in that layout (another llama.cpp, cut short, bytes left)."""
    blocks: list[StateBlock] = []
    off, cache = 8, 0
    try:
        while off < len(data):
            (n_stream,), off = struct.unpack_from("<I", data, off), off + 4
            for _ in range(n_stream):
                (count,), off = struct.unpack_from("<I", data, off), off + 4
                positions, offsets = [], []
                for _ in range(count):
                    pos, n_ids = struct.unpack_from("<iI", data, off)
                    positions.append(pos)
                    offsets.append(off)
                    off += 8 + 4 * n_ids
                if count == 0:
                    continue
                v_trans, n_layer = struct.unpack_from("<II", data, off)
                off += 8
                keys = []
                for _ in range(n_layer):
                    kind, row = struct.unpack_from("<iQ", data, off)
                    keys.append((kind, off + 12, row))
                    off += 12 + count * row
                layers = []
                for key_type, key_offset, key_row in keys:
                    if not v_trans:
                        kind, row = struct.unpack_from("<iQ", data, off)
                        layers.append(LayerRows(key_type, key_offset, key_row, kind, off + 12, row, 0))
                        off += 12 + count * row
                    else:
                        kind, size, n_embd = struct.unpack_from("<iII", data, off)
                        layers.append(LayerRows(key_type, key_offset, key_row, kind, off + 12, size, n_embd))
                        off += 12 + count * n_embd * size
                blocks.append(StateBlock(cache, tuple(positions), tuple(offsets), bool(v_trans), tuple(layers)))
            cache += 1
    except struct.error as exc:
        raise ValueError(f"the bytes end early ({exc})") from None
    if off > len(data):
        raise ValueError(f"the bytes end early ({off - len(data)} bytes short)")
    if off < len(data):
        raise ValueError(f"{len(data) - off} bytes left over")
    return blocks, cache


__all__ = ["F16", "LayerRows", "StateBlock", "read_blocks"]
