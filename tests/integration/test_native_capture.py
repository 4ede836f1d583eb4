"""Activation capture through cb_eval on the real models: native (C) and Python callbacks agree, capture
sees every token of a decode, and never changes the logits."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from kvagent.engine import Engine, EngineSettings
from kvagent.native import NativeCapture, PythonCapture
from kvagent.skills.fidelity import cosine
from tests.models import MODELS

KINDS = ["native", "python"]
TEXT = "The quick brown fox jumps over the lazy dog while the agent reads its notes. " * 40


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[tuple[str, str], Engine]]:
    """(model, capture kind) -> engine, loaded on first use, closed at the end of the module."""
    loaded: dict[tuple[str, str], Engine] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, key: tuple[str, str]) -> Engine:
            model, kind = key
            loaded[key] = self[key] = Engine(EngineSettings(model=model, n_ctx=1024, n_seq_max=2, capture=kind))
            return loaded[key]

    yield Lazy()
    for eng in loaded.values():
        eng.close()


def decode(engine: Engine, n_tokens: int, *, start: int = 0, outputs: str = "last") -> np.ndarray:
    """Decode ``n_tokens`` of TEXT into sequence 0 after ``start`` cached ones (emptied first when 0)."""
    b = engine.backend
    tokens = b.tokenize(TEXT, special=False)
    assert len(tokens) >= start + n_tokens
    if start == 0:
        b.seq_rm(0, -1, -1)
    chunk = tokens[start : start + n_tokens]
    out = [outputs == "all" or i == n_tokens - 1 for i in range(n_tokens)]
    return b.decode(chunk, list(range(start, start + n_tokens)), [0] * n_tokens, out)


def n_embd(engine: Engine) -> int:
    b = engine.backend
    return int(b.meta(f"{b.architecture}.embedding_length"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_capture_kind_is_the_one_asked_for(engines: dict, model: str, kind: str) -> None:
    cap = engines[model, kind].backend.capture
    assert isinstance(cap, {"native": NativeCapture, "python": PythonCapture}[kind])
    assert engines[model, kind].backend.layer_output_name(-2) == f"l_out-{engines[model, kind].backend.n_layer - 2}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    ("n_tokens", "n_ubatches"),
    [(1, 1), (7, 1), (300, 1), (600, 2)],  # 600 > n_ubatch = 512: one capture per micro-batch
)
def test_layer_output_has_a_row_per_token(engines: dict, model: str, kind: str, n_tokens: int, n_ubatches: int) -> None:
    engine = engines[model, kind]
    b, cap = engine.backend, engine.backend.capture
    name = b.layer_output_name(b.n_layer - 2)
    cap.unwant_all()
    cap.want([name])
    cap.enabled = True
    decode(engine, n_tokens)
    got = cap.take()
    assert list(got) == [name]
    arrays = got[name]
    assert len(arrays) == n_ubatches
    assert all(a.dtype == np.float32 and a.ndim == 2 and a.shape[1] == n_embd(engine) for a in arrays)
    assert sum(a.shape[0] for a in arrays) == n_tokens
    assert all(np.isfinite(a).all() for a in arrays)
    assert cap.skipped == {"noncontiguous": 0, "type": 0, "nomem": 0}
    assert cap.take() == {}  # take drops what it returned


@pytest.mark.parametrize(
    ("names", "ndim", "start", "n_tokens"),
    [
        (["l_out-{mid}", "l_out-{last}", "result_norm"], None, 0, 40),
        (["Kcur-2", "Vcur-2", "kq_soft_max-1"], 3, 0, 40),
        (["l_out-0", "Kcur-{mid}"], 3, 40, 1),  # one-token decode over a cache
    ],
)
@pytest.mark.arch  # the graph's node names and layouts are the architecture's
@pytest.mark.parametrize("model", MODELS)
def test_native_and_python_capture_the_same_numbers(
    engines: dict, model: str, names: list[str], ndim: int | None, start: int, n_tokens: int
) -> None:
    captured = {}
    for kind in KINDS:
        engine = engines[model, kind]
        b, cap = engine.backend, engine.backend.capture
        wanted = [n.format(mid=b.n_layer // 2, last=b.n_layer - 1) for n in names]
        cap.unwant_all()
        if start:
            cap.enabled = False
            decode(engine, start)
        cap.enabled = True
        cap.want(wanted, ndim=ndim)
        decode(engine, n_tokens, start=start)
        captured[kind] = cap.take_events()
    native, python = captured["native"], captured["python"]
    assert [n for n, _ in native] == [n for n, _ in python]
    assert {n for n, _ in native} == set(wanted)
    for (name, a), (_, p) in zip(native, python):
        assert a.shape == p.shape, name
        assert ndim is None or a.ndim == ndim
        np.testing.assert_allclose(a, p, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_disabled_capture_captures_nothing(engines: dict, model: str, kind: str) -> None:
    engine = engines[model, kind]
    cap = engine.backend.capture
    cap.unwant_all()
    cap.want([engine.backend.layer_output_name(-2), "result_norm"])
    cap.enabled = False
    decode(engine, 20)
    assert cap.take() == {}
    cap.enabled = True
    decode(engine, 1, start=20)
    assert set(cap.take()) == {engine.backend.layer_output_name(-2), "result_norm"}


@pytest.mark.arch
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("start", "n_tokens"), [(0, 64), (64, 1)])
def test_capture_does_not_change_logits(engines: dict, model: str, kind: str, start: int, n_tokens: int) -> None:
    reference = engines[model, "none"]
    assert reference.backend.capture is None
    engine = engines[model, kind]
    cap = engine.backend.capture
    cap.unwant_all()
    cap.want([engine.backend.layer_output_name(-2), "result_norm", "Kcur-1"])
    cap.enabled = True
    logits = []
    for eng in (reference, engine):
        if start:
            decode(eng, start)
        logits.append(decode(eng, n_tokens, start=start, outputs="all"))
    assert cap.take()
    ref, got = logits
    assert ref.shape == got.shape == (n_tokens, engine.backend.n_vocab)
    for r, g in zip(ref, got):
        assert cosine(r, g) >= 0.9999
        assert int(r.argmax()) == int(g.argmax())


@pytest.mark.parametrize("name", ["", "x" * 64])
def test_bad_names_are_refused(engines: dict, name: str) -> None:
    for kind in KINDS:
        with pytest.raises(ValueError, match="cannot want"):
            engines[MODELS[0], kind].backend.capture.want([name])
