"""LangChain and LangGraph on kvagent: a chat model whose KV cache stays alive across turns.

``ChatKVAgent`` (``chat_models``) is the chat model; ``KVAgentStateRunnable`` (``state``) runs it on a
chain's or graph's state dict, turning changed fields into errata; ``KVCacheMiddleware`` (``middleware``) keeps its
cache per thread in a LangChain v1 agent, and ``KVCheckpointer`` (``checkpoint``) keeps each thread's snapshot beside
its LangGraph checkpoints; ``registry`` shares engines per
(model, settings) across the process; ``desktop`` is the Textual desktop agent (the ``desktop`` extra).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from langchain_kvagent.chat_models import DEFAULT_SESSION, ChatKVAgent
    from langchain_kvagent.errors import (SkillNotCompiledError, UndeclaredFieldError, UnknownSessionError,
                                          UnknownSkillError)
    from langchain_kvagent.registry import Turn
    from langchain_kvagent.checkpoint import KVCheckpointer, SnapshotModelError
    from langchain_kvagent.middleware import KVCacheMiddleware, NotKVAgentModelError
    from langchain_kvagent.state import KVAgentStateRunnable

# the public names and their modules, imported on first use: `kvagent --help` loads this package's command
# (langchain_kvagent.cli) without importing LangChain
_EXPORTS = {
    "DEFAULT_SESSION": "chat_models", "ChatKVAgent": "chat_models", "KVAgentStateRunnable": "state", "Turn": "registry",
    "SkillNotCompiledError": "errors", "UndeclaredFieldError": "errors", "UnknownSessionError": "errors",
    "UnknownSkillError": "errors", "KVCacheMiddleware": "middleware", "NotKVAgentModelError": "middleware",
    "KVCheckpointer": "checkpoint", "SnapshotModelError": "checkpoint",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'langchain_kvagent' has no attribute {name!r}")
    return getattr(importlib.import_module(f"langchain_kvagent.{module}"), name)


__version__ = "0.1.0"
__all__ = [
    "DEFAULT_SESSION",
    "ChatKVAgent",
    "KVAgentStateRunnable",
    "KVCacheMiddleware",
    "KVCheckpointer",
    "NotKVAgentModelError",
    "SkillNotCompiledError",
    "SnapshotModelError",
    "Turn",
    "UndeclaredFieldError",
    "UnknownSessionError",
    "UnknownSkillError",
]
