"""The on-disk/in-memory format of one sequence's saved KV: a checked envelope around llama.cpp bytes.

Layout: ``b"KVAG"``, a little-endian u32 header length, a JSON header, then the backend's payload.
The header carries the model fingerprint, the backend format, the cached token ids, and the payload's
length; the last position's logits (float32) may follow the payload, then the session's eviction state (named
arrays, each described in the header by dtype and shape: what an ``Evictor`` carries from one cycle to the next);
a sha256 covers all of it, so a blob from another model or backend format is refused by name, and a corrupt
or truncated blob is never handed to llama.cpp. The eviction state is read as plain arrays of a few numeric
dtypes whose sizes must add up to its length (never unpickled): a blob is data, whoever sent it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvagent.errors import KVBlobError

MAGIC = b"KVAG"
ENVELOPE_VERSION = 1
# dtypes an eviction state may hold (little-endian); anything else in a header is refused
STATE_DTYPES = ("<f4", "<f8", "<i8", "|u1", "|b1")
_MAX_STATE_NAME = 200


@dataclass(frozen=True)
class KVBlob:
    """A sequence's saved KV: which model and format made it, which tokens it holds, the raw bytes."""

    model_fingerprint: str
    backend_format: str
    tokens: tuple[int, ...]
    payload: bytes
    logits: bytes = b""  # float32 next-token logits after the last token, when the saver had them
    evicted: tuple[int, ...] = ()  # positions < len(tokens) an eviction cycle removed (no cell saved)
    evictor_policy: str = ""  # the eviction policy whose state ``evictor`` is ("" and {}: none saved)
    evictor: Mapping[str, np.ndarray] = field(default_factory=dict, compare=False)
    closed: tuple[int, ...] = ()  # evicted positions whose holes the cells were moved into (``Eviction(compact=True)``)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVBlob):
            return NotImplemented
        same = (self.model_fingerprint, self.backend_format, self.tokens, self.payload, self.logits, self.evicted,
                self.evictor_policy, self.closed) == (other.model_fingerprint, other.backend_format, other.tokens,
                                                      other.payload, other.logits, other.evicted, other.evictor_policy,
                                                      other.closed)
        return same and self.evictor.keys() == other.evictor.keys() and all(
            a.dtype == other.evictor[k].dtype and np.array_equal(a, other.evictor[k], equal_nan=a.dtype.kind == "f")
            for k, a in self.evictor.items())

    __hash__ = None  # type: ignore[assignment]

    def _state_bytes(self) -> tuple[list[list[object]], bytes]:
        """The eviction state as (manifest ``[[name, dtype, shape], ...]``, the arrays' bytes in that order)."""
        manifest, parts = [], []
        for name, arr in self.evictor.items():
            a = np.asarray(arr)  # (not ascontiguousarray: it makes a 0-d array 1-d)
            dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
            if dt.str not in STATE_DTYPES:
                raise KVBlobError(f"eviction state {name!r} has dtype {a.dtype}: use one of {', '.join(STATE_DTYPES)}")
            manifest.append([name, dt.str, list(a.shape)])
            parts.append(a.astype(dt, copy=False).tobytes(order="C"))
        return manifest, b"".join(parts)

    def to_bytes(self) -> bytes:
        manifest, state = self._state_bytes()
        header = json.dumps(
            {
                "envelope": ENVELOPE_VERSION,
                "model": self.model_fingerprint,
                "format": self.backend_format,
                "tokens": list(self.tokens),
                "payload_len": len(self.payload),
                "logits_len": len(self.logits),
                "sha256": hashlib.sha256(self.payload + self.logits + state).hexdigest(),
                **({"evicted": sorted(self.evicted)} if self.evicted else {}),
                **({"closed": sorted(self.closed)} if self.closed else {}),
                **({"evictor": {"policy": self.evictor_policy, "arrays": manifest, "len": len(state)}}
                   if manifest else {}),
            }
        ).encode()
        return MAGIC + struct.pack("<I", len(header)) + header + self.payload + self.logits + state

    @classmethod
    def from_bytes(cls, blob: bytes, *, model_fingerprint: str, backend_format: str) -> KVBlob:
        """Parse and check ``blob`` for this model and backend format; :class:`KVBlobError` if not."""
        if len(blob) < 8 or blob[:4] != MAGIC:
            raise KVBlobError("not a kvagent KV blob (bad magic): save it again with session.save()")
        (hlen,) = struct.unpack("<I", blob[4:8])
        try:
            header = json.loads(blob[8 : 8 + hlen])
            expected_len = int(header["payload_len"])
            logits_len = int(header.get("logits_len", 0))
            body = blob[8 + hlen :]
            ev = header.get("evictor") or {}
            manifest, state_len, policy = list(ev.get("arrays", [])), int(ev.get("len", 0)), str(ev.get("policy", ""))
            payload, logits = body[:expected_len], body[expected_len : expected_len + logits_len]
            state = body[expected_len + logits_len :]
            tokens = tuple(int(t) for t in header["tokens"])
            evicted = tuple(int(p) for p in header.get("evicted", ()))
            if any(not 0 <= p < len(tokens) for p in evicted) or len(set(evicted)) != len(evicted):
                raise ValueError("evicted positions outside the tokens")
            closed = tuple(int(p) for p in header.get("closed", ()))
            if not set(closed) <= set(evicted) or len(set(closed)) != len(closed):
                raise ValueError("closed positions that were not evicted")
            specs = _state_specs(manifest, state_len)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KVBlobError(f"corrupt KV blob header ({exc}): save it again with session.save()") from exc
        if header.get("envelope") != ENVELOPE_VERSION:
            raise KVBlobError(f"KV blob envelope v{header.get('envelope')} is not v{ENVELOPE_VERSION}: save it again")
        if header["model"] != model_fingerprint:
            raise KVBlobError(
                f"KV blob was made by model {header['model'][:12]}, this session runs {model_fingerprint[:12]}: "
                "recompute it on this model (prefill the prompt, then session.save())"
            )
        if header["format"] != backend_format:
            raise KVBlobError(
                f"KV blob has backend format {header['format']!r}, this backend writes {backend_format!r}: "
                "recompute it with this version"
            )
        if (len(payload) != expected_len or len(logits) != logits_len or len(state) != state_len
                or hashlib.sha256(body).hexdigest() != header.get("sha256")):
            raise KVBlobError("KV blob is corrupt or truncated (checksum mismatch): recompute it")
        arrays, at = {}, 0
        for name, dtype, shape, size in specs:
            arrays[name] = np.frombuffer(state, dtype, math.prod(shape), at).reshape(shape).copy()
            at += size
        return cls(header["model"], header["format"], tokens, payload, logits, evicted, policy, arrays, closed)


def _state_specs(manifest: list[object], length: int) -> list[tuple[str, np.dtype, tuple[int, ...], int]]:
    """Check an eviction state's manifest against its byte length before anything is allocated: ``(name, dtype,
    shape, bytes)`` per array; ValueError for an unknown dtype, a bad shape or name, or sizes that do not add up."""
    specs, total, names = [], 0, set()
    for entry in manifest:
        name, dtype, shape = entry  # type: ignore[misc]
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_STATE_NAME or name in names:
            raise ValueError(f"eviction state name {str(name)[:40]!r} is empty, too long or repeated")
        if dtype not in STATE_DTYPES:
            raise ValueError(f"eviction state {name!r} has dtype {dtype!r}, not one of {', '.join(STATE_DTYPES)}")
        if not isinstance(shape, list) or len(shape) > 4 or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"eviction state {name!r} has shape {shape!r}")
        dt = np.dtype(dtype)
        size = math.prod(shape) * dt.itemsize
        total += size
        if total > length:
            raise ValueError(f"eviction state arrays need more than its {length} bytes")
        names.add(name)
        specs.append((name, dt, tuple(shape), size))
    if total != length:
        raise ValueError(f"eviction state arrays take {total} of its {length} bytes")
    return specs
