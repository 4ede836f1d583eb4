"""What a session's blob carries for its evictor: the envelope's state section (round trip, every refusal before
anything is allocated) and each stateful policy's ``state`` / ``load_state`` (round trip; a state it did not write is
refused and nothing changes). The KV result (a restored session evicts as the saved one) is checked on the real
models in ``tests/integration/test_eviction.py``."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvagent.errors import KVBlobError
from kvagent.kvblob import MAGIC, STATE_DTYPES, KVBlob
from kvagent.policies.attention import HeavyHitters, ImportanceSampling
from kvagent.policies.base import CacheView, EvictionPolicy, Wrapper
from kvagent.policies.compose import RankMix
from kvagent.policies.incremental import IncrementalSurprise
from kvagent.policies.information import SelfInformation
from kvagent.policies.reconstruction import Reconstruction
from kvagent.policies.recurrence import FutureCopy
from kvagent.policies.simple import RandomScores, Recency
from kvagent.policies.spans import TurnContrast

FP, FMT = "a" * 64, "fmt-1"


def _blob(**state: np.ndarray) -> KVBlob:
    return KVBlob(FP, FMT, (1, 2, 3), b"kv-bytes", b"\x00\x00\x80\x3f", (1,), "surprise" if state else "", state)


def _parse(raw: bytes) -> KVBlob:
    return KVBlob.from_bytes(raw, model_fingerprint=FP, backend_format=FMT)


def _with_header(raw: bytes, edit: object) -> bytes:
    """``raw`` with its JSON header changed by ``edit(header)`` (the checksum left as it was)."""
    (n,) = struct.unpack("<I", raw[4:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)  # type: ignore[operator]
    h = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(h)) + h + raw[8 + n :]


def test_the_state_travels_and_is_checksummed() -> None:
    blob = _blob(**{"hidden.pos": np.arange(3, dtype=np.int64), "hidden.rows": np.ones((3, 4), np.float32),
                    "seen": np.zeros(0, np.int64), "flag": np.array([True, False])})
    raw = blob.to_bytes()
    back = _parse(raw)
    assert back == blob and back.evictor_policy == "surprise"
    assert all(back.evictor[k].dtype == v.dtype for k, v in blob.evictor.items())
    back.evictor["hidden.rows"][0, 0] = 5.0  # the arrays are the blob's own copies, writable
    with pytest.raises(KVBlobError, match="checksum"):
        _parse(raw[:-1] + bytes([raw[-1] ^ 1]))


def test_a_blob_without_state_is_as_before() -> None:
    raw = KVBlob(FP, FMT, (1,), b"kv").to_bytes()
    assert b"evictor" not in raw and _parse(raw).evictor == {}


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(st.characters(codec="utf-8"), min_size=1, max_size=20),
                       st.sampled_from(STATE_DTYPES).flatmap(lambda dt: hnp.arrays(
                           np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))),
                       max_size=5))
def test_any_state_of_the_allowed_dtypes_round_trips(state: dict[str, np.ndarray]) -> None:
    back = _parse(_blob(**state).to_bytes())
    assert back == _blob(**state)


def test_a_state_of_another_dtype_is_refused_when_saved() -> None:
    with pytest.raises(KVBlobError, match="dtype complex128"):
        _blob(x=np.zeros(2, np.complex128)).to_bytes()


def _arrays(h: dict) -> list:
    return h["evictor"]["arrays"]


@pytest.mark.parametrize(("edit", "match"), [
    (lambda h: _arrays(h)[0].__setitem__(1, "|O"), "dtype '|O'"),
    (lambda h: _arrays(h)[0].__setitem__(2, [10 ** 15, 10 ** 6]), "need more than"),
    (lambda h: _arrays(h)[0].__setitem__(2, [-1, 4]), "shape"),
    (lambda h: _arrays(h)[0].__setitem__(2, [1, 1, 1, 1, 1]), "shape"),
    (lambda h: _arrays(h)[0].__setitem__(2, [1]), "take 8 of its 24"),
    (lambda h: _arrays(h).append(list(_arrays(h)[0])), "repeated"),
    (lambda h: _arrays(h)[0].__setitem__(0, ""), "empty"),
    (lambda h: _arrays(h)[0].__setitem__(0, 7), "empty, too long"),
    (lambda h: h["evictor"].__setitem__("arrays", [["x"]]), "corrupt KV blob header"),
    (lambda h: h.__setitem__("evictor", "no"), "corrupt KV blob header"),
    (lambda h: h["evictor"].__setitem__("len", 16), "need more than its 16"),
    (lambda h: h["evictor"].__setitem__("len", 32), "take 24 of its 32"),
])
def test_a_malformed_state_header_is_refused_before_anything_is_read(edit: object, match: str) -> None:
    raw = _blob(x=np.arange(3, dtype=np.int64)).to_bytes()
    with pytest.raises(KVBlobError, match=match):
        _parse(_with_header(raw, edit))


# --- policies --------------------------------------------------------------------------------------
def _view(n: int) -> CacheView:
    return CacheView(tokens=np.arange(n), positions=np.arange(n), pinned=np.zeros(n, bool), new=np.ones(n, bool),
                     hidden=None, model_path=None)  # type: ignore[arg-type]


def _h2o() -> HeavyHitters:
    p = HeavyHitters()
    p._values = {3: 0.5, 7: 1.25, 9: 0.0}
    return p


def _importance() -> ImportanceSampling:
    p = ImportanceSampling(seed=3)
    p._values = {1: 2.0}
    p._rng.random(5)
    return p


def _reconstruction() -> Reconstruction:
    p = Reconstruction()
    p._scores, p.replayed = {4: 0.25, 5: 0.5}, 77
    return p


def _random() -> RandomScores:
    p = RandomScores(seed=1)
    p.score(_view(7))
    return p


def _selfinfo() -> SelfInformation:
    p = SelfInformation()
    p._values = {2: 3.5, 6: 0.125}
    return p


def _mix() -> RankMix:
    return RankMix(_h2o(), _reconstruction(), 0.5)


def _contrast() -> TurnContrast:
    p = TurnContrast(FutureCopy(_selfinfo()))
    p._starts, p._sums, p._counted = [0, 7], {0: [12.5, 4.0], 7: [3.0, 1.0]}, {1, 2, 3, 8}
    return p


STATEFUL = {"h2o": (_h2o, HeavyHitters), "importance": (_importance, lambda: ImportanceSampling(seed=9)),
            "kvzip": (_reconstruction, Reconstruction), "random": (_random, lambda: RandomScores(seed=5)),
            "mix": (_mix, lambda: RankMix(HeavyHitters(), Reconstruction(), 0.5)),
            "wrapped": (lambda: Wrapper(_h2o()), lambda: Wrapper(HeavyHitters())),
            "selfinfo": (_selfinfo, SelfInformation),
            "contrast": (_contrast, lambda: TurnContrast(FutureCopy(SelfInformation())))}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_a_policy_takes_back_its_state(name: str) -> None:
    make, fresh = STATEFUL[name]
    saved = make()
    state = dict(_parse(_blob(**saved.state()).to_bytes()).evictor)
    other = fresh()
    other.load_state(state)
    assert _parse(_blob(**other.state()).to_bytes()) == _parse(_blob(**saved.state()).to_bytes())
    if name in ("random", "importance"):  # the same draws from here on
        assert np.array_equal(saved._rng.random(4), other._rng.random(4))


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_a_state_the_policy_did_not_write_is_refused_and_changes_nothing(name: str) -> None:
    make, _ = STATEFUL[name]
    policy = make()
    before = _blob(**policy.state()).to_bytes()
    for bad in ({"other": np.zeros(1)}, {**policy.state(), "extra.pos": np.zeros(1, np.int64)}):
        with pytest.raises(ValueError):
            policy.load_state(bad)
        assert _blob(**policy.state()).to_bytes() == before


def test_a_stateless_policy_refuses_a_state_and_takes_none() -> None:
    Recency().load_state({})
    with pytest.raises(ValueError, match="keeps no state"):
        Recency().load_state({"total.pos": np.zeros(1, np.int64)})
    assert EvictionPolicy().state() == {}


def _incremental_state(n: int = 3, d: int = 4, heads: int = 2, kv: int = 1, hd: int = 2) -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    f4 = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    f8 = lambda *s: r.standard_normal(s)  # noqa: E731
    return {"pos": np.array([2, 5, 9][:n], np.int64), "tok": np.arange(n, dtype=np.int64), "hid": f4(n, d),
            "qhid": f4(n, d), "k": f4(kv, n, hd), "v": f4(kv, n, hd), "q": f4(heads, n, hd), "m": f8(heads, n),
            "l": f8(heads, n), "acc": f8(heads, n, hd), "normed0": f4(n, d), "mu0": f4(n, d), "logz0": f8(n)}


def test_the_incremental_surprise_state_round_trips() -> None:
    state = _incremental_state()
    p = IncrementalSurprise()
    assert p.state() == {}
    p.load_state(_parse(_blob(**state).to_bytes()).evictor)
    assert _blob(**p.state()) == _blob(**state)
    p.load_state({})
    assert p.state() == {}


@pytest.mark.parametrize(("change", "match"), [
    (lambda s: s.pop("acc"), "differ"),
    (lambda s: s.__setitem__("m", s["m"].astype(np.float32)), "expected <f8"),
    (lambda s: s.__setitem__("k", s["k"][:, :2]), "disagrees"),
    (lambda s: s.__setitem__("hid", s["hid"][:, :3]), "disagrees"),
    (lambda s: s.__setitem__("pos", s["pos"][::-1].copy()), "ascending"),
    (lambda s: s.__setitem__("q", s["q"][0]), "expected <f4"),
])
def test_a_malformed_incremental_state_is_refused_and_changes_nothing(change: object, match: str) -> None:
    p = IncrementalSurprise()
    good = _incremental_state()
    p.load_state(good)
    bad = _incremental_state()
    change(bad)  # type: ignore[operator]
    with pytest.raises(ValueError, match=match):
        p.load_state(bad)
    assert _blob(**p.state()) == _blob(**good)
