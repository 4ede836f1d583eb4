"""n_gpu_layers left unset resolves by itself: all layers with a GPU build and a device, else 0 (the CPU build
unchanged); $KVAGENT_GPU_LAYERS and $KVAGENT_FLASH_ATTN set the defaults, explicit settings win."""

from __future__ import annotations

import pytest

from kvagent.engine import EngineSettings, auto_gpu_layers
from kvagent.errors import KVAgentError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVAGENT_GPU_LAYERS", raising=False)
    monkeypatch.delenv("KVAGENT_FLASH_ATTN", raising=False)


def test_unset_resolves_from_the_build_and_its_devices() -> None:
    from kvagent.backends.llama_cpp import gpu_devices, supports_gpu_offload

    devices = gpu_devices()
    assert supports_gpu_offload() or not devices  # a CPU build sees no GPU
    expected = -1 if devices else 0
    assert auto_gpu_layers() == expected
    settings = EngineSettings()
    assert settings.n_gpu_layers is None and settings.backend_config().n_gpu_layers == expected
    # flash attention follows the device: on with a GPU (its non-flash path gave NaN on an H200), off on a CPU
    assert settings.flash_attn is None and settings.backend_config().flash_attn is bool(devices)


def test_other_backends_stay_on_the_cpu() -> None:
    assert auto_gpu_layers("fake") == 0


def test_environment_sets_the_defaults_and_explicit_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVAGENT_GPU_LAYERS", "-1")
    monkeypatch.setenv("KVAGENT_FLASH_ATTN", "1")
    assert EngineSettings().backend_config().n_gpu_layers == -1
    assert EngineSettings().flash_attn is True and EngineSettings().backend_config().flash_attn is True
    assert EngineSettings(n_gpu_layers=0).backend_config().n_gpu_layers == 0
    assert EngineSettings(flash_attn=False).backend_config().flash_attn is False
    monkeypatch.setenv("KVAGENT_FLASH_ATTN", "off")
    assert EngineSettings().flash_attn is False and EngineSettings().backend_config().flash_attn is False


@pytest.mark.parametrize(("name", "value"), [("KVAGENT_GPU_LAYERS", "all"), ("KVAGENT_FLASH_ATTN", "maybe")])
def test_bad_environment_values_are_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(KVAgentError, match=name):
        EngineSettings().backend_config()
