"""kvagent.native without a model: array shapes from ggml's ne, the build's errors, the Python fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvagent import native
from kvagent.errors import BackendError


@pytest.mark.parametrize(
    ("ne", "ndim", "shape"),
    [
        ([576, 40, 1, 1], None, (40, 576)),  # l_out: [n_tokens, n_embd]
        ([576, 1, 1, 1], None, (1, 576)),  # one token keeps its row
        ([64, 3, 40, 1], None, (40, 3, 64)),  # Kcur: [n_tokens, n_head_kv, head_dim]
        ([64, 3, 1, 1], None, (3, 64)),  # ... whose token dim a one-token decode loses without ndim
        ([64, 3, 1, 1], 3, (1, 3, 64)),
        ([192, 40, 1, 1], 3, (1, 40, 192)),
        ([256, 40, 9, 1], None, (9, 40, 256)),  # kq_soft_max: [n_head, n_tokens, n_kv]
        ([256, 40, 9, 2], 2, (2, 9, 40, 256)),  # non-unit dims are never dropped
        ([5, 1, 1, 1], 1, (5,)),
        ([5, 1, 1, 1], 5, (1, 1, 1, 1, 5)),
    ],
)
def test_shape_from_ne(ne: list[int], ndim: int | None, shape: tuple[int, ...]) -> None:
    assert native._shape(ne, ndim) == shape


def test_missing_source_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native, "SOURCE", tmp_path / "kvcapture.c")
    with pytest.raises(BackendError, match="source .* is missing.*capture='python'"):
        native.build_native()


def test_missing_compiler_falls_back_to_python(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(BackendError, match="no C compiler"):
        native.build_native()
    with caplog.at_level(logging.WARNING, logger="kvagent.native"):
        cap = native.load_capture("native")
    assert isinstance(cap, native.PythonCapture)
    assert "falling back to the Python capture" in caplog.text


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="'native' or 'python'"):
        native.load_capture("cuda")  # type: ignore[arg-type]


def test_build_key_follows_the_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path))
    first = native.library_path()
    edited = tmp_path / "kvcapture.c"
    edited.write_text(native.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(native, "SOURCE", edited)
    second = native.library_path()
    assert first.parent == second.parent == tmp_path / "native"
    assert first != second
