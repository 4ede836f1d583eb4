"""How the disk tier writes a stored prefix: the saved sequence's bytes as they are (``f16``), or its key and value
rows in llama.cpp's ``q8_0`` (about 53% of the bytes, lossy), or deflated (lossless).

A stored prefix is a ``kvblob.KVBlob``'s bytes; only its payload (``llama_state_seq_get_data``'s bytes, whose rows
:func:`kvagent.backends.state.read_blocks` finds) is encoded, the rest is kept as it is. Decoding gives a blob
whose checksum is computed again over the decoded payload, so a q8_0 prefix loads as any other blob; the disk
tier's own signature covers the encoded file.

``q8_0`` is llama.cpp's format for 8-bit caches (``ggml-common.h``, ``block_q8_0``): blocks of 32 values, each an
f16 scale ``max|x| / 127`` and 32 int8, decoded as ``q * scale``. docs/benchmarks/retained.md ("Prefixes on disk")
measures size, restore time and fidelity of each format.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import Literal, Protocol

import numpy as np

from kvagent.backends.state import read_blocks
from kvagent.errors import KVBlobError
from kvagent.kvblob import MAGIC

Format = Literal["f16", "q8_0", "deflate"]
FORMATS: tuple[Format, ...] = ("f16", "q8_0", "deflate")
Q8_BLOCK = 32
_Q8 = b"KVQ8"


class Codec(Protocol):
    """One way of writing a stored prefix's bytes (``encode``) and reading them back (``decode``)."""

    name: str

    def encode(self, blob: bytes) -> bytes: ...
    def decode(self, data: bytes) -> bytes: ...


class Plain:
    """The bytes as they are."""

    name = "f16"

    def encode(self, blob: bytes) -> bytes:
        return blob

    def decode(self, data: bytes) -> bytes:
        return data


class Deflate:
    """The bytes deflated (``zlib``, level 1: f16 rows compress little, so speed is what the level buys)."""

    name = "deflate"

    def encode(self, blob: bytes) -> bytes:
        return zlib.compress(blob, 1)

    def decode(self, data: bytes) -> bytes:
        try:
            return zlib.decompress(data)
        except zlib.error as exc:
            raise KVBlobError(f"a deflated stored prefix does not inflate ({exc})") from None


def _split(blob: bytes) -> tuple[dict[str, object], bytes, bytes]:
    """A blob's (header, payload, the bytes after it)."""
    if len(blob) < 8 or blob[:4] != MAGIC:
        raise KVBlobError("not a kvagent KV blob (bad magic)")
    (hlen,) = struct.unpack_from("<I", blob, 4)
    header = json.loads(blob[8:8 + hlen])
    n = int(header["payload_len"])
    body = blob[8 + hlen:]
    return header, body[:n], body[n:]


def _join(header: dict[str, object], payload: bytes, rest: bytes) -> bytes:
    header = {**header, "payload_len": len(payload), "sha256": hashlib.sha256(payload + rest).hexdigest()}
    encoded = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(encoded)) + encoded + payload + rest


def _regions(payload: bytes) -> list[tuple[int, int]]:
    """``(offset, n_values)`` of every f16 key and value region of a saved sequence, in order."""
    regions = []
    blocks, _ = read_blocks(payload)
    for block in blocks:
        n = len(block.positions)
        for i, rows in enumerate(block.layers):
            regions.append((rows.key_offset, block.keys(payload, i).size))  # ValueError unless f16
            regions.append((rows.value_offset, block.values(payload, i).size))
    return sorted(regions)


def q8_0(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` (f16, any length) as q8_0: (scales ``[blocks]`` f16, quants ``[blocks, 32]`` int8), the last
    block padded with zeros."""
    x = values.astype(np.float32)
    pad = (-len(x)) % Q8_BLOCK
    x = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, Q8_BLOCK)
    scale = np.abs(x).max(axis=1) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    quants = np.clip(np.rint(x / safe[:, None]), -127, 127).astype(np.int8)
    return scale.astype(np.float16), quants


def from_q8_0(scales: np.ndarray, quants: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` f16 values of q8_0 blocks (:func:`q8_0`'s inverse, up to its rounding)."""
    return (quants.astype(np.float32) * scales.astype(np.float32)[:, None]).reshape(-1)[:n].astype(np.float16)


class Q8:
    """The payload's key and value rows as q8_0; everything else as it is. ``KVBlobError`` for a payload whose rows
    are not f16 (another llama.cpp layout, a quantised cache)."""

    name = "q8_0"

    def encode(self, blob: bytes) -> bytes:
        header, payload, rest = _split(blob)
        try:
            regions = _regions(payload)
        except ValueError as exc:
            raise KVBlobError(f"cannot write this saved sequence as q8_0 ({exc})") from None
        values = np.concatenate([np.frombuffer(payload, np.float16, n, off) for off, n in regions]) \
            if regions else np.zeros(0, np.float16)
        scales, quants = q8_0(values)
        skeleton, at = bytearray(), 0
        for off, n in regions:  # the payload without its rows
            skeleton += payload[at:off]
            at = off + 2 * n
        skeleton += payload[at:]
        table = json.dumps({"regions": regions, "values": len(values), "skeleton": len(skeleton),
                            "header": header}).encode()
        return b"".join([_Q8, struct.pack("<I", len(table)), table, bytes(skeleton), scales.tobytes(),
                         quants.tobytes(), rest])

    def decode(self, data: bytes) -> bytes:
        try:
            if data[:4] != _Q8:
                raise ValueError("bad magic")
            (tlen,) = struct.unpack_from("<I", data, 4)
            table = json.loads(data[8:8 + tlen])
            at = 8 + tlen
            skeleton = data[at:at + int(table["skeleton"])]
            at += len(skeleton)
            n = int(table["values"])
            blocks = -(-n // Q8_BLOCK)
            scales = np.frombuffer(data, np.float16, blocks, at)
            at += 2 * blocks
            quants = np.frombuffer(data, np.int8, blocks * Q8_BLOCK, at).reshape(blocks, Q8_BLOCK)
            at += blocks * Q8_BLOCK
            values = from_q8_0(scales, quants, n).tobytes()
            payload, s, v = bytearray(), 0, 0  # len(payload) == s + v throughout
            for off, count in table["regions"]:
                gap = int(off) - len(payload)
                payload += skeleton[s:s + gap]
                s += gap
                payload += values[v:v + 2 * int(count)]
                v += 2 * int(count)
            payload += skeleton[s:]
            return _join(table["header"], bytes(payload), data[at:])
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise KVBlobError(f"a q8_0 stored prefix does not decode ({exc})") from None


def codec(name: Format) -> Codec:
    """The codec of a disk format."""
    return {"f16": Plain, "q8_0": Q8, "deflate": Deflate}[name]()


__all__ = ["Codec", "Deflate", "FORMATS", "Format", "Plain", "Q8", "codec", "from_q8_0", "q8_0"]
