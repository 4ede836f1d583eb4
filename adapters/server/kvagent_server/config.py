"""The server's settings (``kvagent serve`` options), validated at the edge; unknown keys are refused."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class ServerConfig(BaseModel):
    """How ``kvagent serve`` runs: the model and its KV pool, who may call, where idle sessions park."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "smollm2-135m"
    """Registry name or path of a local ``.gguf`` file; also the model id clients send."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    n_ctx: int = Field(16384, ge=64)
    """KV pool shared by every live session (and the longest one session can get)."""
    n_seq_max: int = Field(32, ge=1, le=256)
    """Sessions held live at once; idle ones beyond that are parked."""
    n_threads: int = Field(0, ge=0)
    """llama.cpp threads; 0 = all cores."""
    flash_attn: bool = True
    """On by default here: in one pool of many sessions every token attends over the whole pool, and
    flash attention skips the other sessions' masked cells (prefill beside five live sessions: 4-7 s
    instead of 6-18 s per 1.3k tokens on 2 cores)."""
    api_key: str | None = None
    """When set, every request but ``GET /health`` needs ``Authorization: Bearer <key>``."""
    skills_dir: Path | None = None
    """Skill files (``*.yaml``) sessions may include by name; compiled on first use."""
    park_dir: Path | None = None
    """Where parked sessions' KV is written (default: a temporary folder removed at shutdown)."""
    max_parked: int = Field(1024, ge=0)
    """Parked sessions kept; beyond, the least recently used *implicit* ones (keyed chat sessions) are
    forgotten: their clients resend the history, which rebuilds them. Sessions made with
    ``POST /v1/sessions`` are never forgotten."""
    default_max_tokens: int = Field(512, ge=1)
    """Reply length when a request gives neither ``max_tokens`` nor ``max_completion_tokens``."""
    retry_after_s: int = Field(1, ge=1)
    """``Retry-After`` of a 503 (every sequence or KV cell busy, nothing idle to park)."""
