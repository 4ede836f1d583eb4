"""Backends by name: ``Engine.load(..., backend="llama.cpp")`` builds one through this registry.

``llama.cpp`` is the product backend; ``fake`` is the pure-Python backend for tests of logic (it claims no
numbers). Each factory imports its module on demand, so naming a backend loads only that one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvagent.backends.base import Backend, BackendConfig
from kvagent.errors import KVAgentError

BackendFactory = Callable[[Path, BackendConfig], Backend]


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: how to build one, and what callers may ask of it without importing its module.

    ``gpu_layers()``: ``n_gpu_layers`` for settings that leave it unset (every layer where the build can offload
    and sees a GPU; 0 otherwise). ``device_report()``: what ``kvagent gpu info`` prints (the build, its devices).
    ``baseline_chat(model_path, **options)``: the engine's own plain chat API on the same model, the comparison
    ``kvagent demo`` runs beside kvagent (None: the backend has none).
    """

    create: BackendFactory
    gpu_layers: Callable[[], int] = lambda: 0
    device_report: Callable[[], dict[str, Any]] = lambda: {"backends": [], "devices": []}
    baseline_chat: Callable[..., Any] | None = None


_REGISTRY: dict[str, BackendEntry] = {}


def register_backend(name: str, factory: BackendFactory | BackendEntry) -> None:
    """Make ``Engine.load(..., backend=name)`` build backends with ``factory(model_path, config)`` (a plain factory,
    or a :class:`BackendEntry` with the questions callers ask of the backend)."""
    _REGISTRY[name] = factory if isinstance(factory, BackendEntry) else BackendEntry(factory)


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def backend_entry(name: str) -> BackendEntry:
    """The registered entry of ``name``; unknown names list the registered ones."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise KVAgentError(f"unknown backend {name!r}: use one of {', '.join(backend_names())}, or pass a Backend instance")
    return entry


def create_backend(name: str, model_path: Path, config: BackendConfig) -> Backend:
    """A backend by registered name; unknown names list the registered ones."""
    backend = backend_entry(name).create(model_path, config)
    if not isinstance(backend, Backend):
        raise KVAgentError(f"backend {name!r} does not implement kvagent.backends.base.Backend")
    return backend


def default_gpu_layers(name: str = "llama.cpp") -> int:
    """``n_gpu_layers`` a backend gets when the settings leave it unset (see :class:`BackendEntry`)."""
    return backend_entry(name).gpu_layers()


def device_report(name: str = "llama.cpp") -> dict[str, Any]:
    """What the backend's build can offload to (``kvagent gpu info``)."""
    return backend_entry(name).device_report()


def baseline_chat(name: str, model_path: Path, **options: Any) -> Any:
    """The backend engine's own chat API on ``model_path`` (``kvagent demo``'s comparison)."""
    entry = backend_entry(name)
    if entry.baseline_chat is None:
        raise KVAgentError(f"backend {name!r} has no baseline chat API to compare with: run the demo on llama.cpp")
    return entry.baseline_chat(model_path, **options)


# -- the registered backends: each module is imported on demand, so naming a backend loads only that one
def _llama_cpp(path: Path, config: BackendConfig) -> Backend:
    from kvagent.backends.llama_cpp import LlamaCppBackend  # the one llama_cpp importer, loaded on demand

    return LlamaCppBackend(path, config)


def _llama_cpp_gpu_layers() -> int:
    from kvagent.backends.llama_cpp import default_gpu_layers as gpu_layers

    return gpu_layers()


def _llama_cpp_devices() -> dict[str, Any]:
    from kvagent.backends.llama_cpp import build_info, gpu_devices

    return {**build_info(), "devices": [dataclasses.asdict(dev) for dev in gpu_devices()]}


def _llama_cpp_baseline(path: Path, **options: Any) -> Any:
    from kvagent.backends.llama_cpp import BaselineChat

    return BaselineChat(path, **options)


def _fake(path: Path, config: BackendConfig) -> Backend:
    from kvagent.backends.fake import FakeBackend

    return FakeBackend.from_config(path, config)


register_backend("llama.cpp", BackendEntry(_llama_cpp, _llama_cpp_gpu_layers, _llama_cpp_devices, _llama_cpp_baseline))
register_backend("fake", _fake)
