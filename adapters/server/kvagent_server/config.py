"""The server's settings (``kvagent serve`` options), validated at the edge; unknown keys are refused.

One concern per class: :class:`EngineSettings` (the local engine and its sessions), :class:`TenancySettings`
(who may call, quotas, what one request may cost: both modes), :class:`ProxySettings` (``--upstream``);
:class:`ServerConfig` composes them with the model and the address, as one flat set of fields (the command line's).

Who may call (:mod:`kvagent_server.tenants`): no key at all (one local user: loopback clients and ``Host`` names
only, and a non-loopback ``host`` is refused at start), one ``api_key`` (one tenant, ``default``), or a ``keys_file``
of hashed keys mapped to tenants with quotas. What one request may cost is bounded by the ``max_*`` settings, every
one checked before any tokenizing or state change (docs/server.md, "Limits").
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from kvagent.kv.codec import Format

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a client's address) is this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EngineSettings(BaseModel):
    """The local engine (``kvagent serve`` without ``--upstream``): its KV pool, decoding, and where sessions live
    and park."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_seq_max: int = Field(32, ge=1, le=256)
    """Sessions held live at once; idle ones beyond that are parked."""
    n_threads: int = Field(0, ge=0)
    """llama.cpp threads; 0 = all cores."""
    flash_attn: bool = True
    """On by default here: in one pool of many sessions every token attends over the whole pool, and
    flash attention skips the other sessions' masked cells (prefill beside five live sessions: 4-7 s
    instead of 6-18 s per 1.3k tokens on 2 cores)."""
    prefill_chunk_alone: int | None = Field(512, ge=1)
    """The engine's ``prefill_chunk_alone``: a prefill alone on the engine decodes chunks of this many tokens,
    preempted when another request arrives (SmolLM2, 2 cores: a cold prefill 1.36x faster than in chunks of 64,
    and a short request beside a 2k-token prefill waits 1.2x its idle time instead of 2.3x; BENCHMARKS.md,
    "llama-server"). None: chunks of 64 always."""

    cache_ram_mb: int = Field(1024, ge=0)
    """Host memory (MiB) for the prefixes of retained sequences the KV pool gave back (``kvagent.kv.tiers``): a later
    request of the same tenant restores one instead of computing it (llama-server's ``--cache-ram``). 0: none."""
    cache_disk_mb: int = Field(4096, ge=0)
    """Disk (MiB) below the host-memory tier, in a private folder of kvagent's cache folder removed at shutdown.
    0: none."""
    cache_disk_format: Format = "f16"
    """How the disk tier writes a prefix: ``f16`` as saved (exact), ``q8_0`` (about 53% of the bytes, lossy) or
    ``deflate`` (lossless); docs/benchmarks/retained.md, "Prefixes on disk"."""

    auto_tools: Literal["free", "once"] = "free"
    """How ``tool_choice="auto"`` is decoded: ``free`` (OpenAI's meaning), or ``once``: a tool called since the last
    user message may not be called again (its result is in the prompt; ``kvagent.tools.choice.spent_tools``). For a
    small tool-trained model that repeats its call after the result (Qwen2.5-Coder-0.5B), so an agent loop ends."""

    skills_dir: Path | None = None
    """Skill files (``*.yaml``) sessions may include by name; compiled on first use."""
    park_dir: Path | None = None
    """Where parked sessions' KV is written (default: a temporary folder removed at shutdown); made mode 0700,
    refused when other users can write it; each file 0600."""
    max_parked: int = Field(1024, ge=0)
    """Parked sessions kept; beyond, the least recently used *implicit* ones (keyed chat sessions) are
    forgotten: their clients resend the history, which rebuilds them. Sessions made with
    ``POST /v1/sessions`` are never forgotten."""
    min_free_disk_mb: int = Field(256, ge=0)
    """Parking writes no KV file when the park folder's disk would keep less free space than this: the session
    keeps its segments and is prefilled again."""
    restore_unsigned: Literal["refuse", "text"] = "refuse"
    """A restore whose signature fails: ``refuse`` (422), or ``text``: its texts are kept without KV and without
    token ids, tokenized and prefilled again."""


class TenancySettings(BaseModel):
    """Who may call (keys, tenants, origins), each tenant's quotas, and what one request may cost (every limit
    checked before any tokenizing or state change), in both modes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: SecretStr | None = None
    """One key for one tenant (``default``): every request but ``GET /health`` needs ``Authorization: Bearer <key>``.
    An empty key is refused (it is not "no auth")."""
    keys_file: Path | None = None
    """A JSON file of tenants, each with the sha256 of its keys and its quotas (``kvagent_server.tenants``)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins (``https://app.example``) allowed besides the server's own; any other ``Origin`` is refused."""
    secret_file: Path | None = None
    """The secret saved sessions are signed with (HMAC-SHA256): read from this file, or created there (32 random
    bytes, mode 0600) when it does not exist, so snapshots survive restarts. None: a secret per process."""

    # -- per tenant (defaults; a keys file may set its own per tenant) --------------------------------
    max_sessions: int = Field(1024, ge=1)
    """Sessions one tenant keeps (made with ``POST /v1/sessions`` or keyed by chat requests). Beyond, a new
    chat key forgets the tenant's least recently used idle chat session; a new ``POST /v1/sessions`` is a 429."""
    max_parked_mb: int = Field(8192, ge=0)
    """Parked KV one tenant may keep on disk; beyond, its sessions park without KV (prefilled again)."""
    max_in_flight: int = Field(64, ge=1)
    """Requests of one tenant served at once; beyond, 429 with ``Retry-After``."""
    cache_scope: Literal["tenant", "session"] = "tenant"
    """Whose KV a session may start from: ``tenant``, any of the tenant's (narrowed per request by ``cache_salt``);
    ``session``, only its own session key's, for a tenant whose key several users share (a keyless request then
    reuses only what requests of the same ``cache_salt`` left, and nothing without one)."""
    session_idle_s: int = Field(86400, ge=0)
    """A keyed session (``POST /v1/sessions`` or a chat key) unused for this long is forgotten: its cells are
    retained for the tenant like any closed session's, its parked file removed, and its id answers 404. 0: never."""

    # -- per request --------------------------------------------------------------------------------
    max_body_kb: int = Field(4096, ge=1)
    """Largest JSON body (413 beyond, before it is parsed)."""
    max_snapshot_mb: int = Field(1024, ge=1)
    """Largest body of ``POST /v1/sessions/{id}/restore``."""
    max_json_depth: int = Field(48, ge=4, le=512)
    """Deepest nesting of a JSON body (arrays and objects); deeper is a 422 before it is parsed."""
    max_chars_per_token: int = Field(32, ge=1)
    """A prompt of more characters than ``n_ctx * max_chars_per_token`` could never fit: refused (413) before it
    is tokenized."""
    max_tokens: int = Field(4096, ge=1)
    """Largest ``max_tokens`` / ``max_completion_tokens`` a request may ask (422 beyond, naming this setting);
    the cells a request reserves beyond its prompt, so one request parks at most that much of others."""
    default_max_tokens: int = Field(512, ge=1)
    """Reply length when a request gives neither ``max_tokens`` nor ``max_completion_tokens``."""
    max_stop: int = Field(4, ge=0)
    max_stop_chars: int = Field(256, ge=1)
    """Stop strings of a request, and the characters of each."""
    max_messages: int = Field(2048, ge=1)
    """Messages of one request (and so of one session's log)."""
    max_fields: int = Field(64, ge=0)
    """Fields one session declares; field values are text of at most ``max_field_chars``."""
    max_field_chars: int = Field(4096, ge=1)
    max_errata: int = Field(32, ge=1)
    """Errata a session keeps; one more folds them back into their fields (``Session.compact``)."""
    retry_after_s: int = Field(1, ge=1)
    """``Retry-After`` of a 503 (every sequence or KV cell busy, nothing idle to park) and of a 429."""

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("the API key is empty: give a key (or no --api-key at all for a local, loopback-only "
                             "server)")
        return key

    @model_validator(mode="after")
    def _one_way_to_authenticate(self) -> TenancySettings:
        if self.api_key is not None and self.keys_file is not None:
            raise ValueError("give either --api-key or --keys, not both (put the key in the keys file as a tenant)")
        return self

    @property
    def authenticated(self) -> bool:
        """Whether callers present keys (``api_key`` or ``keys_file``)."""
        return self.api_key is not None or self.keys_file is not None


class ProxySettings(BaseModel):
    """In front of other engines (``kvagent serve --upstream``, ``kvagent_server.proxy``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    upstream: tuple[str, ...] = ()
    """OpenAI-compatible engines (``http://host:port/v1``) to forward to instead of running ``model`` here; a
    session sticks to one of them. ``model`` then names the model for its tokenizer (the token budget) and for
    clients; ``n_ctx`` is the engines' context."""
    upstream_model: str | None = None
    """The model id the engines serve (vLLM's ``--served-model-name``); default ``model``."""
    upstream_key: SecretStr | None = None
    """The key this server sends to the engines (never a client's)."""
    upstream_salt: bool = True
    """Send each tenant's ``cache_salt`` (vLLM; engines without it ignore the field)."""
    upstream_timeout_s: float = Field(600.0, gt=0)
    """How long a request may wait for its engine (and for its session's previous request)."""
    erratum_role: Literal["system", "user"] = "system"
    """The role of erratum messages: ``user`` for a chat template that takes a system message first only."""
    inplace_tail_chars: int = Field(1024, ge=0)
    """A change within this many characters of the end is forwarded in place, not as an erratum."""

    @field_validator("upstream")
    @classmethod
    def _upstream_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for url in urls:
            url = url.strip().rstrip("/")
            if not re.match(r"^https?://[^/\s]+(/[^\s]*)?$", url):
                raise ValueError(f"--upstream {url[:200]!r}: give an http(s) URL, e.g. http://127.0.0.1:8001/v1")
            out.append(url if url.endswith("/v1") else url + "/v1")
        if len(set(out)) != len(out):
            raise ValueError("--upstream: the same engine is given twice")
        return tuple(out)


class ServerConfig(EngineSettings, TenancySettings, ProxySettings):
    """How ``kvagent serve`` runs: the model, where it listens, and the settings of each concern (the local engine,
    tenancy and limits, the proxy), one flat set of fields as the command line gives them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "smollm2-135m"
    """Registry name or path of a local ``.gguf`` file; also the model id clients send."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    n_ctx: int = Field(16384, ge=64)
    """KV pool shared by every live session (and the longest one session can get); with ``upstream``, the
    engines' context."""

    @property
    def max_prompt_chars(self) -> int:
        """Characters no prompt may exceed: more could never fit ``n_ctx`` (refused before tokenizing)."""
        return self.n_ctx * self.max_chars_per_token
