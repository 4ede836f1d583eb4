"""kvagent: keep a local LLM's KV cache alive across an agent's turns and use it as structured memory."""

from kvagent.engine import Engine, EngineSettings
from kvagent.errors import (
    BackendError,
    ChatTemplateError,
    ContextOverflowError,
    KVAgentError,
    KVBlobError,
    KVCacheFullError,
    ModelNotFoundError,
    SegmentOrderError,
    SessionClosedError,
)
from kvagent.models import DEFAULT_MODEL, REGISTRY, ModelRef, resolve_model
from kvagent.sampling import SamplingParams
from kvagent.segments import Rendered, Segment, SegmentKind, Span
from kvagent.session import Generation, GenerationStream, PrefillReport, Session

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "BackendError",
    "ChatTemplateError",
    "ContextOverflowError",
    "Engine",
    "EngineSettings",
    "Generation",
    "GenerationStream",
    "KVAgentError",
    "KVBlobError",
    "KVCacheFullError",
    "ModelNotFoundError",
    "ModelRef",
    "PrefillReport",
    "Rendered",
    "SamplingParams",
    "Segment",
    "SegmentKind",
    "SegmentOrderError",
    "Session",
    "SessionClosedError",
    "Span",
    "resolve_model",
]
