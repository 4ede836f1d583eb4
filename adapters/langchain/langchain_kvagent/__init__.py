"""LangChain and LangGraph on kvagent: a chat model whose KV cache stays alive across turns.

``ChatKVAgent`` (``chat_models``) is the chat model; ``KVAgentStateRunnable`` (``state``) runs it on a
chain's or graph's state dict, turning changed fields into errata; ``registry`` shares engines per
(model, settings) across the process; ``desktop`` is the Textual desktop agent (the ``desktop`` extra).
"""

from langchain_kvagent.chat_models import DEFAULT_SESSION, ChatKVAgent
from langchain_kvagent.errors import SkillNotCompiledError, UndeclaredFieldError, UnknownSessionError, UnknownSkillError
from langchain_kvagent.registry import Turn
from langchain_kvagent.state import KVAgentStateRunnable

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_SESSION",
    "ChatKVAgent",
    "KVAgentStateRunnable",
    "SkillNotCompiledError",
    "Turn",
    "UndeclaredFieldError",
    "UnknownSessionError",
    "UnknownSkillError",
]
