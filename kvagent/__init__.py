"""kvagent: keep a local LLM's KV cache alive across an agent's turns and use it as structured memory."""

import os

# torch (reference model, eviction policies) shares the cores with llama.cpp: its idle OpenMP threads
# must sleep, not spin, or llama.cpp's decodes slow down ~10x in the same process. Read once, when
# torch's OpenMP runtime loads, so it is set here, before any kvagent module can import torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvagent.engine import Engine, EngineSettings
from kvagent.errors import (
    BackendError,
    ChatTemplateError,
    ContextOverflowError,
    EvictionError,
    KVAgentError,
    KVBlobError,
    KVCacheFullError,
    ModelNotFoundError,
    SegmentOrderError,
    SessionClosedError,
    UnsupportedModelError,
)
from kvagent.eviction import Eviction
from kvagent.models import DEFAULT_MODEL, REGISTRY, ModelRef, resolve_model
from kvagent.sampling import SamplingParams
from kvagent.segments import Rendered, Segment, SegmentKind, Span
from kvagent.generation import Decoder, Generation, GenerationStream
from kvagent.kv.sync import PrefillReport
from kvagent.session import Session

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "BackendError",
    "ChatTemplateError",
    "ContextOverflowError",
    "Engine",
    "EngineSettings",
    "Eviction",
    "EvictionError",
    "UnsupportedModelError",
    "Decoder",
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
