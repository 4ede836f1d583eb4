"""The on-disk/in-memory format of one sequence's saved KV: a checked envelope around llama.cpp bytes.

Layout: ``b"KVAG"``, a little-endian u32 header length, a JSON header, then the backend's payload.
The header carries the model fingerprint, the backend format, the cached token ids, and the payload's
length; the last position's logits (float32) may follow the payload; a sha256 covers both, so a blob from another model or backend format is refused by name, and a corrupt
or truncated blob is never handed to llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from kvagent.errors import KVBlobError

MAGIC = b"KVAG"
ENVELOPE_VERSION = 1


@dataclass(frozen=True)
class KVBlob:
    """A sequence's saved KV: which model and format made it, which tokens it holds, the raw bytes."""

    model_fingerprint: str
    backend_format: str
    tokens: tuple[int, ...]
    payload: bytes
    logits: bytes = b""  # float32 next-token logits after the last token, when the saver had them
    evicted: tuple[int, ...] = ()  # positions < len(tokens) an eviction cycle removed (no cell saved)

    def to_bytes(self) -> bytes:
        header = json.dumps(
            {
                "envelope": ENVELOPE_VERSION,
                "model": self.model_fingerprint,
                "format": self.backend_format,
                "tokens": list(self.tokens),
                "payload_len": len(self.payload),
                "logits_len": len(self.logits),
                "sha256": hashlib.sha256(self.payload + self.logits).hexdigest(),
                **({"evicted": sorted(self.evicted)} if self.evicted else {}),
            }
        ).encode()
        return MAGIC + struct.pack("<I", len(header)) + header + self.payload + self.logits

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
            payload, logits = body[:expected_len], body[expected_len:]
            tokens = tuple(int(t) for t in header["tokens"])
            evicted = tuple(int(p) for p in header.get("evicted", ()))
            if any(not 0 <= p < len(tokens) for p in evicted) or len(set(evicted)) != len(evicted):
                raise ValueError("evicted positions outside the tokens")
        except (ValueError, KeyError, TypeError) as exc:
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
        if len(payload) != expected_len or len(logits) != logits_len or hashlib.sha256(body).hexdigest() != header.get("sha256"):
            raise KVBlobError("KV blob is corrupt or truncated (checksum mismatch): recompute it")
        return cls(header["model"], header["format"], tokens, payload, logits, evicted)
