"""Backends: what a Session needs from an inference engine (see ``base.Backend``)."""

from kvagent.backends.base import Backend, BackendConfig, Capabilities
from kvagent.backends.registry import backend_names, create_backend, register_backend

__all__ = ["Backend", "BackendConfig", "Capabilities", "backend_names", "create_backend", "register_backend"]
