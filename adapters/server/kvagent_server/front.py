"""The front of ``POST /v1/chat/completions``, one for both routes: the request body, the session it names and the
limits it is held to. Only what follows differs: a local turn (``kvagent_server.chat``) or a forwarded layout
(``kvagent_server.proxy``).

Both routes read OpenAI's chat fields (:class:`ChatRequestBase`); an option neither can honour is refused with
422 naming it, never ignored: ``n > 1``, ``logprobs``, ``logit_bias``, ``functions`` / ``function_call``, audio,
... (any field the model does not declare). A few fields that change nothing are accepted as OpenAI's clients
send them (``metadata``, ``store: false``, ``service_tier: auto``, ``safety_identifier``). The routes differ only in
sampling: the local route samples with kvagent's sampler (:class:`ChatRequest`: greedy by default, no penalties),
the proxy passes what the client sent to the engine (:class:`ProxyRequest`: the engine's defaults and ranges).

:func:`check` refuses, before anything changes, what depends on the server's settings: the model name (404), a
reply longer than ``--max-tokens``, stop strings, ``--max-messages`` and a prompt of more characters than the
context could ever hold (413). :func:`session_key` reads the session: the ``X-KVAgent-Session`` header, else
``prompt_cache_key``, else ``user``, else none.
"""

from __future__ import annotations

import json
import re
from typing import Any, Collection, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kvagent import openai_shape as shape

from kvagent_server.config import ServerConfig
from kvagent_server.errors import InvalidRequest, NotFound, TooLarge
from kvagent_server.metrics import Metrics
from kvagent_server.schemas import SESSION_ID, MessageIn, ResponseFormat, StreamOptions

SESSION = "session"
"""The kind of a session the ``X-KVAgent-Session`` header names (the kinds of a key never meet)."""


class ChatRequestBase(BaseModel):
    """The fields both routes read alike (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=512)
    messages: list[MessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """A non-negative seed (llama.cpp's ``-1`` for "random" is refused: leave ``seed`` out for fresh entropy)."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    """Only 1: a session records one reply per turn (more is refused naming ``n``)."""
    user: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    """vLLM's: KV is reused only between requests of the same salt (within the tenant); a session keeps the salt
    of the request that made it."""
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    """Only false or absent."""
    # accepted as OpenAI's clients send them; they change nothing here
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = Field(None, max_length=256)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def reply_budget(self, config: ServerConfig) -> int:
        """The reply's tokens: as asked, else the server's default (never past its cap)."""
        return self.max_completion_tokens or self.max_tokens or min(config.default_max_tokens, config.max_tokens)


class ChatRequest(ChatRequestBase):
    """``POST /v1/chat/completions``. Sampling is greedy unless ``temperature`` > 0 (kvagent's default,
    not OpenAI's 1.0). Session key: ``prompt_cache_key``, else ``user`` (or the ``X-KVAgent-Session``
    header, which wins).

    Tools: ``tools`` are OpenAI function tools (``{"type": "function", "function": {"name", "description",
    "parameters"}}``; at most 128), checked before anything runs (a bad name, a duplicate, a schema the grammar
    cannot express: 422 naming it). ``tool_choice``: ``auto`` (default with tools: text or a call), ``none``,
    ``required`` or ``{"type": "function", "function": {"name": ...}}``. A turn that calls is decoded under a
    grammar, so its calls always parse and follow the tools' schemas. ``parallel_tool_calls``: absent or false,
    **one call per turn** (kvagent's default; OpenAI's is true): on the small models this server runs, a grammar
    that allows another call makes them repeat the same call until ``max_tokens``; send true to allow several.
    ``response_format``: ``text``, ``json_object`` or ``json_schema`` (the reply is held to the schema)."""

    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)
    report_edits: bool = False
    """kvagent's extension (send it in the openai client's ``extra_body``): ``usage.kvagent_edits`` lists what the
    changes of the resent prompt became (``replace`` / ``delete`` / ``insert`` in place, or ``fallback``)."""
    tools: list[Any] | None = None
    """Checked by the server (``kvagent_server.tools``), so that a refusal names the tool and the fix."""
    tool_choice: Any = None
    """Checked by the server against ``tools`` (an unknown name is a 422 naming the bound ones)."""
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0)
    """Only 0 (no penalty): kvagent's sampler has none."""
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0)
    """Only 0 (no penalty)."""


class ProxyRequest(ChatRequestBase):
    """``POST /v1/chat/completions`` in front of an engine: OpenAI's fields, passed on as given (sampling defaults are
    the engine's)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1_000_000)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)


def session_key(body: ChatRequestBase, headers: Mapping[str, str]) -> tuple[str, str | None]:
    """``(kind, key)`` of the request's session: the ``X-KVAgent-Session`` header (kind :data:`SESSION`), else
    ``prompt_cache_key``, else ``user`` (kinds of those names); ``(SESSION, None)``: none, a request of its own.
    The kinds never meet, so a header's session can never be the one another client's ``prompt_cache_key`` lands
    in."""
    header = headers.get("x-kvagent-session")
    if header is not None:
        if not re.match(SESSION_ID, header):
            raise InvalidRequest("the X-KVAgent-Session header names a session: 1-128 letters, digits and . _ : @ -",
                                 param="X-KVAgent-Session")
        return SESSION, header
    if body.prompt_cache_key:
        return "prompt_cache_key", body.prompt_cache_key
    if body.user:
        return "user", body.user
    return SESSION, None


def check(body: ChatRequestBase, config: ServerConfig, models: Collection[str], served: str) -> None:
    """Refuse what this server cannot do as asked (nothing has changed yet): a model not in ``models`` (404 naming
    ``served``), ``n``, logprobs, ``max_tokens`` past the cap, stop strings, message count and a prompt of more
    characters than the context could ever hold (413, before tokenizing)."""
    if body.model not in models:
        raise NotFound(f"unknown model {body.model!r}: this server runs {served!r} (GET /v1/models)",
                       param="model", code="model_not_found")
    if body.n != 1:
        raise InvalidRequest(f"n: only 1 choice per request is supported, got {body.n}", param="n")
    if body.logprobs:
        raise InvalidRequest("logprobs: not supported by kvagent serve", param="logprobs")
    for name in ("max_tokens", "max_completion_tokens"):
        wanted = getattr(body, name)
        if wanted is not None and wanted > config.max_tokens:
            raise InvalidRequest(f"{name}: {wanted} is more than this server's cap of {config.max_tokens} "
                                 "(--max-tokens): ask for fewer", param=name, code="max_tokens_too_large")
    stops = body.stops()
    if len(stops) > config.max_stop:
        raise InvalidRequest(f"stop: at most {config.max_stop} stop strings", param="stop")
    for i, stop in enumerate(stops):
        if not 0 < len(stop) <= config.max_stop_chars:
            raise InvalidRequest(f"stop.{i}: a stop string holds 1-{config.max_stop_chars} characters",
                                 param=f"stop.{i}")
    if len(body.messages) > config.max_messages:
        raise InvalidRequest(f"messages: {len(body.messages)} messages, at most {config.max_messages} "
                             "(--max-messages)", param="messages")
    texts = [m.text() or "" for m in body.messages]
    texts += [c.function.arguments for m in body.messages for c in m.tool_calls or ()]
    tools = getattr(body, "tools", None)
    if tools:
        texts.append(json.dumps(tools, ensure_ascii=False))
    check_chars(config, texts, "the prompt")


def check_chars(config: ServerConfig, texts: Sequence[str], what: str) -> None:
    """413 before tokenizing when ``texts`` hold more characters than the context could ever hold."""
    n, limit = sum(len(t) for t in texts), config.max_prompt_chars
    if n > limit:
        raise TooLarge(f"{what} holds {n} characters, more than a context of {config.n_ctx} tokens could ever "
                       f"hold ({limit}): shorten it (nothing was changed)", param="messages",
                       code="context_length_exceeded")


def count_usage(metrics: Metrics, usage: Any) -> None:
    """An engine's ``usage`` in the metrics, as a local turn's counts: cached prompt tokens as reused, the rest as
    computed, and the reply's tokens."""
    got = shape.used(usage)
    prompt = got.prompt or 0
    metrics.count_generation(min(got.cached, prompt), max(prompt - got.cached, 0), 0, got.completion or 0)


__all__ = ["SESSION", "ChatRequest", "ChatRequestBase", "ProxyRequest", "check", "check_chars", "count_usage",
           "session_key"]
