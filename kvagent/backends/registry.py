"""Backends by name: ``Engine.load(..., backend="llama.cpp")`` builds one through this registry.

``llama.cpp`` is the product backend; ``fake`` is the pure-Python backend for tests of logic (it claims no
numbers). Each factory imports its module on demand, so naming a backend loads only that one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvagent.backends.base import Backend, BackendConfig
from kvagent.errors import KVAgentError

BackendFactory = Callable[[Path, BackendConfig], Backend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``Engine.load(..., backend=name)`` build backends with ``factory(model_path, config)``."""
    _REGISTRY[name] = factory


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def create_backend(name: str, model_path: Path, config: BackendConfig) -> Backend:
    """A backend by registered name; unknown names list the registered ones."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise KVAgentError(f"unknown backend {name!r}: use one of {', '.join(backend_names())}, or pass a Backend instance")
    backend = factory(model_path, config)
    if not isinstance(backend, Backend):
        raise KVAgentError(f"backend {name!r} does not implement kvagent.backends.base.Backend")
    return backend


def _llama_cpp(path: Path, config: BackendConfig) -> Backend:
    from kvagent.backends.llama_cpp import LlamaCppBackend  # the one llama_cpp importer, loaded on demand

    return LlamaCppBackend(path, config)


def _fake(path: Path, config: BackendConfig) -> Backend:
    from kvagent.backends.fake import FakeBackend

    return FakeBackend.from_config(path, config)


register_backend("llama.cpp", _llama_cpp)
register_backend("fake", _fake)
