"""The disk tier's formats (``kvagent.kv.codec``) on a real saved sequence: ``f16`` and ``deflate`` give back the very
bytes, ``q8_0`` the same blob with each key and value within half a quantization step, in about 53% of the bytes;
and a disk tier in each format restores a prefix a new session continues from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvagent import Segment
from kvagent.backends.state import read_blocks
from kvagent.errors import KVBlobError
from kvagent.kv.codec import FORMATS, Q8_BLOCK, codec
from kvagent.kv.tiers import FolderStore
from kvagent.kvblob import KVBlob

DOC = Segment.policy("You are the archivist of the Larkspur museum. " + " ".join(
    f"Room {n} holds the {kind} collection, catalogued in {1900 + 7 * n}." for n, kind in
    enumerate(["maps", "coins", "letters", "tools", "prints", "clocks", "globes", "seals"])))


@pytest.fixture()
def saved(engine: Any) -> bytes:
    with engine.session([DOC], share_prefix=False) as s:
        return s.save()


def parsed(engine: Any, blob: bytes) -> KVBlob:
    return KVBlob.from_bytes(blob, model_fingerprint=engine.fingerprint, backend_format=engine.backend.format)


def rows(engine: Any, blob: bytes) -> list[np.ndarray]:
    """Every key and value tensor of the blob's payload, f32, in the order of its bytes (values saved transposed are
    transposed back)."""
    payload = parsed(engine, blob).payload
    blocks, _ = read_blocks(payload)
    return [a.astype(np.float32) for b in blocks for i in range(len(b.layers))
            for a in (b.keys(payload, i), b.values(payload, i).T if b.v_trans else b.values(payload, i))]


@pytest.mark.parametrize("name", ["f16", "deflate"])
def test_lossless_formats_give_back_the_bytes(saved: bytes, name: str) -> None:
    c = codec(name)  # type: ignore[arg-type]
    assert c.decode(c.encode(saved)) == saved


@pytest.mark.arch  # the rows' layout: Gemma-3 saves two caches (full attention, then its sliding window)
def test_q8_0_keeps_every_row_within_half_a_step_in_about_half_the_bytes(engine: Any, saved: bytes) -> None:
    c = codec("q8_0")
    encoded = c.encode(saved)
    decoded = c.decode(encoded)  # a checked blob: the checksum is the decoded payload's
    payload = len(parsed(engine, saved).payload)  # the rest (the saved logits) is kept as it is
    ratio = (len(encoded) - (len(saved) - payload)) / payload
    assert 0.5 < ratio < 0.56, ratio
    for before, after in zip(rows(engine, saved), rows(engine, decoded), strict=True):
        flat = before.reshape(-1)
        pad = (-flat.size) % Q8_BLOCK
        step = np.abs(np.concatenate([flat, np.zeros(pad)])).reshape(-1, Q8_BLOCK).max(axis=1) / 127
        error = np.abs(after.reshape(-1) - flat)
        # half a step of q8_0, plus the f16 rounding of the scale (up to 127 steps of it) and of the decoded value
        block = np.repeat(step, Q8_BLOCK)[:flat.size]
        bound = block * (0.5 + 127 * 1e-3) + np.abs(flat) * 1e-3 + 1e-6
        assert (error <= bound).all(), float((error - bound).max())


def continued(engine: Any, blob: bytes) -> np.ndarray:
    """The next-token logits after ``blob`` restored and a question decoded on top, in cells left as they were
    (the session's cells are not retained: each call decodes into the same free cells)."""
    with engine.session([], share_prefix=False) as s:
        s.restore(blob, [DOC])
        s.extend(Segment.user("Which room holds the clocks?"))
        out = s.logits()
        s.close(retain=False)
    return out


@pytest.mark.parametrize("name", FORMATS)
def test_a_disk_tier_file_in_each_format_restores_a_session_that_goes_on(engine: Any, saved: bytes, name: str,
                                                                       tmp_path: Path) -> None:
    """Lossless formats continue exactly as the saved bytes do; q8_0 within a cosine of 0.99, the same top token
    (docs/benchmarks/retained.md, "Prefixes on disk", measures it on longer prompts)."""
    store = FolderStore(tmp_path / "disk", codec(name))
    size = store.put(1, saved)
    assert size == (tmp_path / "disk" / "1.kv").stat().st_size
    blob = store.get(1)
    assert blob is not None
    reference, ours = continued(engine, saved), continued(engine, blob)
    if name == "q8_0":
        cos = float(ours @ reference / np.linalg.norm(ours) / np.linalg.norm(reference))
        assert cos > 0.99 and int(ours.argmax()) == int(reference.argmax()), cos
    else:
        assert np.array_equal(ours, reference)


def test_a_q8_0_file_that_does_not_decode_is_a_clear_error(saved: bytes) -> None:
    c = codec("q8_0")
    encoded = c.encode(saved)
    with pytest.raises(KVBlobError, match="q8_0"):
        c.decode(encoded[: len(encoded) // 2])
    with pytest.raises(KVBlobError, match="q8_0"):
        c.decode(b"nonsense")


def test_a_disk_tier_entry_whose_file_does_not_decode_is_dropped_not_raised(engine: Any, saved: bytes,
                                                                            tmp_path: Path) -> None:
    """A q8_0 file that fails to decode (here: re-signed after it was cut short) is forgotten by the tier, and the
    session that wanted it computes its prompt instead of failing."""
    from kvagent.kv.tiers import Tier

    store = FolderStore(tmp_path / "disk", codec("q8_0"))
    tier = Tier("disk", store, 1 << 30)
    tier.put(parsed(engine, saved).tokens, "", saved)
    (entry,) = tier._entries.values()
    path = tmp_path / "disk" / f"{entry.key}.kv"
    cut = path.read_bytes()[32:][: entry.size // 2]
    import hashlib
    import hmac

    path.write_bytes(hmac.new(store._secret, cut, hashlib.sha256).digest() + cut)
    assert tier.load(entry, engine.fingerprint, engine.backend.format) is None
    assert len(tier) == 0 and not path.exists()
