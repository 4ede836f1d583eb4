"""Named exceptions: every failure a user can cause or meet says what went wrong and how to fix it.

All kvagent errors derive from :class:`KVAgentError`, so callers can catch one type. Errors raised on
bad input are raised *before* any state changes: a refused call leaves the session and its KV cache as
they were.
"""

from __future__ import annotations


class KVAgentError(Exception):
    """Base class of every kvagent error."""


class ModelNotFoundError(KVAgentError):
    """A model name is unknown, its package is not installed, or its file is missing."""


class BackendError(KVAgentError):
    """A native llama.cpp call failed; the message names the call and its return code."""


class KVCacheFullError(BackendError):
    """llama.cpp found no free KV cells for a batch (``llama_decode`` returned 1)."""


class DecodeAborted(BackendError):
    """A preemptible ``llama_decode`` was aborted because other work arrived (it returned 2); llama.cpp removed the
    aborted micro-batch's positions, so the sequence holds what it held before the call."""


class ContextOverflowError(KVAgentError):
    """A prompt or a generation does not fit in the session's context window.

    Nothing is cut silently: the call is refused before anything is decoded (for a prompt) or stops at
    the limit with the text generated so far in :attr:`partial` (for a generation).
    """

    def __init__(self, message: str, partial: str = "") -> None:
        super().__init__(message)
        self.partial = partial


class SegmentOrderError(KVAgentError):
    """A prompt's segments are in an order kvagent cannot render (e.g. a field after the first turn)."""


class SessionClosedError(KVAgentError):
    """A call on a session that was closed; open a new one with ``engine.session(...)``."""


class KVBlobError(KVAgentError):
    """A saved KV blob is corrupt, truncated, or was made by another model or format."""


class ChatTemplateError(KVAgentError):
    """The model's chat template could not be turned into role wrappers."""


class FieldValueError(KVAgentError, ValueError):
    """``session.set`` named an unknown field or a value the field's spec does not allow (a ``ValueError`` too, so
    pydantic reports it where a spec is declared, with its location)."""


class SkillFileError(KVAgentError):
    """A skill file is unreadable or invalid; the message names the file, the line and the field."""


class SkillStoreError(KVAgentError):
    """A compiled skill is missing, corrupt, or was compiled for another model or backend format."""


class UnsupportedModelError(KVAgentError):
    """The torch transformer (kvagent.transformer) cannot load a GGUF: unknown architecture or quantization type."""


class EvictionError(KVAgentError):
    """An eviction policy name, budget or cycle setting is invalid, or a cache cannot be pruned."""


class ProbeInputError(KVAgentError):
    """A causal probe's input is inconsistent: e.g. the old and new field values differ in token length,
    a span is empty, or the edit does not move the decision score at all."""


class ToolSpecError(KVAgentError, ValueError):
    """A tool cannot be bound: an invalid or duplicate name, parameters that are not an object schema."""


class ToolSchemaError(ToolSpecError):
    """A tool's (or a structured reply's) JSON schema uses keywords the grammar cannot express; the message
    names them."""


class ToolChoiceError(KVAgentError, ValueError):
    """``tool_choice`` names a tool that is not bound, or is not one of auto, none, required or a name."""


class ToolCallError(KVAgentError):
    """A tool call in a turn's text does not parse (an unconstrained turn) or names a tool that is not bound."""


class CacheFolderError(KVAgentError):
    """A folder kvagent loads code or KV from (the cache folder, its ``native`` and ``skills`` folders) can be written
    by other users, or belongs to another user: a file they put there would be loaded."""


class MemoryEditError(KVAgentError, ValueError):
    """A memory edit cannot be made: an unknown or read-only block, a value over the block's limit, a text to
    replace that is not in the block. Nothing was changed."""
