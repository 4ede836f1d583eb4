"""Backends: what a Session needs from an inference engine (see ``base.Backend``)."""

from kvagent.backends.base import Backend, BackendConfig

__all__ = ["Backend", "BackendConfig"]
