"""The adapter's named errors; each says how to fix the problem. All derive from kvagent's own errors, so
``except KVAgentError`` catches them too. A model that is not installed raises kvagent's
:class:`~kvagent.errors.ModelNotFoundError` (it names the package to install) on first use."""

from __future__ import annotations

from kvagent.errors import FieldValueError, KVAgentError, ModelNotFoundError, SkillStoreError


class UnknownSessionError(KVAgentError, KeyError):
    """``model.session(key)`` (or a session verb) named a session this chat model has not opened."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UndeclaredFieldError(FieldValueError):
    """A field was set (or a state key tracked as a field) that ``ChatKVAgent(fields=...)`` does not declare."""


class SkillNotCompiledError(SkillStoreError):
    """A skill is not compiled for this model and ``compile_skills`` is off."""


class UnknownSkillError(KVAgentError):
    """A skill name is in none of the chat model's ``skills`` / ``skill_dirs`` files."""


__all__ = [
    "KVAgentError",
    "ModelNotFoundError",
    "SkillNotCompiledError",
    "UndeclaredFieldError",
    "UnknownSessionError",
    "UnknownSkillError",
]
