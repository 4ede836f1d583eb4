"""KV blob envelope: round trip and every refusal."""

from __future__ import annotations

import pytest

from kvagent.errors import KVBlobError
from kvagent.kvblob import KVBlob

GOOD = KVBlob("a" * 64, "fmt-1", (1, 2, 3), b"\x00\x01payload")


def _flip_last(b: bytes) -> bytes:
    return b[:-1] + bytes([b[-1] ^ 1])


def test_round_trip() -> None:
    assert KVBlob.from_bytes(GOOD.to_bytes(), model_fingerprint="a" * 64, backend_format="fmt-1") == GOOD


@pytest.mark.parametrize(
    ("blob", "model", "fmt", "match"),
    [
        (GOOD.to_bytes(), "b" * 64, "fmt-1", "made by model aaaaaaaaaaaa, this session runs bbbbbbbbbbbb"),
        (GOOD.to_bytes(), "a" * 64, "fmt-2", "backend format 'fmt-1'"),
        (_flip_last(GOOD.to_bytes()), "a" * 64, "fmt-1", "checksum"),
        (GOOD.to_bytes()[:-3], "a" * 64, "fmt-1", "checksum"),
        (b"NOPE" + GOOD.to_bytes()[4:], "a" * 64, "fmt-1", "bad magic"),
        (GOOD.to_bytes()[:12], "a" * 64, "fmt-1", "corrupt KV blob header"),
    ],
)
def test_refusals(blob: bytes, model: str, fmt: str, match: str) -> None:
    with pytest.raises(KVBlobError, match=match):
        KVBlob.from_bytes(blob, model_fingerprint=model, backend_format=fmt)


def test_logits_travel_and_are_checksummed() -> None:
    blob = KVBlob("a" * 64, "fmt-1", (1,), b"kv", logits=b"\x00\x00\x80\x3f")
    raw = blob.to_bytes()
    assert KVBlob.from_bytes(raw, model_fingerprint="a" * 64, backend_format="fmt-1") == blob
    with pytest.raises(KVBlobError, match="checksum"):
        KVBlob.from_bytes(_flip_last(raw), model_fingerprint="a" * 64, backend_format="fmt-1")
