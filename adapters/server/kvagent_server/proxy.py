"""``kvagent serve --upstream URL``: the OpenAI-compatible API in front of engines elsewhere (vLLM, SGLang,
llama.cpp's ``llama-server``, any OpenAI-compatible server), forwarding each session in the prefix-stable layout.

What a request goes through (every refusal an OpenAI-shaped error naming the fix; nothing changes before it):

1. The gate (:mod:`kvagent_server.gate`): who asks, body size and shape. Then the front (:mod:`kvagent_server.front`,
   as the local route's): the body (``ProxyRequest``: OpenAI's chat fields; one this proxy cannot pass on
   faithfully is refused, never dropped), the model, the limits and the session key.
2. The session: ``X-KVAgent-Session``, else ``prompt_cache_key``, else ``user`` keys it, per tenant (another
   tenant's key never reaches it). Its requests run one at a time, in arrival order.
3. The layout (:mod:`kvagent_server.layout`): the previous request byte for byte, errata for what the client changed
   inside it, then the new messages. It is counted with the model's own tokenizer (``kvagent_server.tokens``);
   one that would not fit the engine's context (or holds ``max_errata`` errata) is *rebuilt*: forwarded as the
   client wrote it, which folds the errata in (``X-KVAgent-Layout: rebuild``, counted in ``/metrics``); a client
   prompt that does not fit on its own is a 413, never cut.
4. The engine: a replica picked by rendezvous hashing of the session, so a session sticks to one replica and one
   prefix cache. The request carries ``prompt_cache_key`` (the session, keyed per tenant) and vLLM's
   ``cache_salt`` (one per tenant, narrowed by the request's own ``cache_salt`` and, for a tenant of
   ``cache_scope: session``, its session key: tenants never share cache blocks, so one cannot time another's
   prompts).
   A stream is passed through event by event as the engine writes it; tools and tool calls in the engine's own
   format. Its reply is read back by ``kvagent.openai_shape`` (``reply_of``, ``ReplyStream``).
5. The reply joins the layout only once it is complete. An engine that fails, or stops mid-stream, leaves the
   session as it was: the client gets an error (an ``error`` event in a stream) and may resend; nothing is
   retried behind its back, so no request runs twice.

The engine's error bodies are summarised, never relayed with its address or internals.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import threading
import weakref
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from cachetools import FIFOCache, cachedmethod
from fastapi import FastAPI, Request
from httpx_sse import EventSource, ServerSentEvent
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvagent import openai_shape as shape

from kvagent_server import front, handlers
from kvagent_server.config import ServerConfig
from kvagent_server.errors import Busy, ServerError, TooLarge, error_body
from kvagent_server.front import ProxyRequest
from kvagent_server.gate import Gate
from kvagent_server.layout import Forward, Layout, Message, Planner
from kvagent_server.metrics import Metrics
from kvagent_server.schemas import MessageIn
from kvagent_server.tenants import Tenant, Tenants, check_start, load_secret
from kvagent_server.tokens import TokenCounter, counter_for

log = logging.getLogger(__name__)


SLACK = 8
"""Tokens per added message a whole count may differ by from the message counted on its own (template joins)."""
_PASSED = ("temperature", "top_p", "top_k", "seed", "stop", "tools", "tool_choice", "parallel_tool_calls",
           "presence_penalty", "frequency_penalty")


def message_out(message: MessageIn) -> Message:
    """A client's message as forwarded: its role, content, name and calls, nothing its SDK added."""
    out: Message = {"role": "system" if message.role == "developer" else message.role}
    content = message.content
    out["content"] = [p.model_dump() for p in content] if isinstance(content, list) else content
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


class Upstream:
    """One engine: its base URL (ending in ``/v1``) and a connection pool to it."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=url + "/", headers=headers, trust_env=False, transport=transport,
                                        timeout=httpx.Timeout(timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    def rank(self, route: str) -> bytes:
        return hashlib.sha256(f"{route}\0{self.url}".encode()).digest()


class UpstreamFailed(ServerError):
    """The engine could not answer (502/503/504); the message names no address."""

    kind = "server_error"

    def __init__(self, message: str, status: int, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message, code=code, status=status,
                         headers={"Retry-After": str(retry_after_s)} if retry_after_s else None)


class Sessions:
    """Each tenant's layouts, the least recently used forgotten beyond ``max_sessions`` (its client's next request
    starts a new layout: a cold prefix, nothing lost); one lock per session. A session's use is its last completed
    request: reading its layout does not count (the request may yet fail)."""

    def __init__(self) -> None:
        self._layouts: dict[str, FIFOCache[str, Layout]] = {}
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def lock(self, tenant: Tenant, key: str) -> asyncio.Lock:
        lock = self._locks.get((tenant.name, key))
        if lock is None:
            lock = self._locks[(tenant.name, key)] = asyncio.Lock()
        return lock

    def get(self, tenant: Tenant, key: str) -> Layout | None:
        return self._layouts.get(tenant.name, {}).get(key)

    def put(self, tenant: Tenant, key: str, layout: Layout) -> None:
        mine = self._layouts.setdefault(tenant.name, FIFOCache(maxsize=tenant.max_sessions))
        mine.pop(key, None)  # inserted afresh, so the newest: the cache drops in insertion order, a read moves nothing
        mine[key] = layout

    def count(self) -> int:
        return sum(len(v) for v in self._layouts.values())


class Proxy:
    """The state of ``kvagent serve --upstream`` (see the module docstring)."""

    def __init__(self, config: ServerConfig, secret: bytes, metrics: Metrics, counter: TokenCounter | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config, self.secret, self.metrics = config, secret, metrics
        key = config.upstream_key.get_secret_value() if config.upstream_key else None
        self.upstreams = [Upstream(url, key, config.upstream_timeout_s, transport) for url in config.upstream]
        self.model = config.upstream_model or config.model
        self.n_ctx = config.n_ctx
        self.counter = counter if counter is not None else counter_for(config.model)
        self.planner = Planner(role=config.erratum_role, inplace_tail_chars=config.inplace_tail_chars)
        self.sessions = Sessions()
        self._tool_tokens: FIFOCache[Any, int] = FIFOCache(maxsize=64)  # a count never changes: first in, first out
        self._tool_lock = threading.Lock()  # fit() runs in worker threads

    # -- keys ---------------------------------------------------------------------------------------
    def _mac(self, *parts: str) -> str:
        return hmac.new(self.secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()[:32]

    def salt(self, tenant: Tenant, salt: str | None = None, key: str | None = None) -> str:
        """The ``cache_salt`` sent for a request of ``tenant``: the tenant's, narrowed by the request's own ``salt``
        and, for a tenant whose ``cache_scope`` is ``session``, by its session ``key`` (a keyless request without a
        salt then gets one of its own). The same on every replica and restart given ``--secret-file``."""
        parts = ["cache-salt", tenant.name, salt or ""]
        if tenant.cache_scope == "session":
            parts.append(key if key is not None or salt is not None else secrets.token_hex(16))
        return self._mac(*parts)

    def upstream(self, route: str) -> Upstream:
        return max(self.upstreams, key=lambda u: u.rank(route))

    # -- budget -------------------------------------------------------------------------------------
    def count(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> int:
        """Prompt tokens of ``messages`` (the model's template and vocabulary) plus the tools' JSON, as the engine
        renders tools into the prompt (an upper estimate where the template rewrites them)."""
        total = self.counter.count(messages)
        if tools:
            total += self._tool_count(json.dumps(tools, ensure_ascii=False))
        return total

    @cachedmethod(lambda self: self._tool_tokens, lock=lambda self: self._tool_lock)
    def _tool_count(self, text: str) -> int:
        """Tokens of the tools' JSON ``text``, kept: a client resends the same tools with every request (counted
        outside the lock)."""
        tokenize = getattr(self.counter, "tokenize", None)
        return len(tokenize(text)) if tokenize is not None else len(text) // 2

    def bound(self, forward: Forward, previous: Layout | None, tools: str) -> int | None:
        """An upper bound of the forwarded prompt's tokens that tokenizes only what was added: the engine's count of
        the previous request and its reply, the added messages counted on their own (their template's wrapping, a
        generation prompt and any default system prompt included), and :data:`SLACK` tokens per message for the
        joins. None where the layout does not extend the previous request, or its count is unknown."""
        if not _extends(forward, previous) or previous is None or previous.tools != tools:
            return None
        added = forward.messages[len(previous.sent):]
        return previous.tokens + self.counter.count(added) + SLACK * (len(added) + 1)

    def fit(self, forward: Forward, previous: Layout | None, client: list[Message], body: ProxyRequest,
            budget: int, tools: str) -> tuple[Forward, int, bool]:
        """``forward``, or the client's own messages when the layout would not fit or holds too many errata; a 413
        when even those do not fit. With the prompt's tokens, and whether they were counted whole (else a bound,
        which fits with room to spare: a whole count of a long prompt costs milliseconds). ``tools``: the request's
        tools as JSON (what the previous count must have been made under)."""
        if len(forward.layout.errata) > self.config.max_errata:
            forward = Forward(client, Layout.rebuilt(client), "rebuild")
        bound = self.bound(forward, previous, tools)
        if bound is not None and bound + budget <= self.n_ctx:
            return forward, bound, False
        tokens = self.count(forward.messages, body.tools)
        if tokens + budget > self.n_ctx and forward.kind not in ("new", "rebuild"):
            forward = Forward(client, Layout.rebuilt(client), "rebuild")
            tokens = self.count(forward.messages, body.tools)
        if tokens + budget > self.n_ctx:
            how = "counted with the model's tokenizer" if self.counter.exact else "estimated"
            raise TooLarge(f"the prompt is {tokens} tokens ({how}) and max_tokens asks {budget} more: more than the "
                           f"engine's context of {self.n_ctx}; shorten the messages or ask for fewer tokens",
                           param="messages", code="context_length_exceeded")
        return forward, tokens, True

    # -- the request --------------------------------------------------------------------------------
    async def complete(self, tenant: Tenant, body: ProxyRequest, request: Request) -> Response:
        config = self.config
        front.check(body, config, {config.model, self.model}, config.model)
        budget = body.reply_budget(config)
        client = [message_out(m) for m in body.messages]
        kind, name = front.session_key(body, request.headers)
        key = f"{kind}:{name}" if name is not None else None
        hold = _Hold(self.sessions.lock(tenant, key) if key is not None else asyncio.Lock())
        try:
            await asyncio.wait_for(hold.lock.acquire(), config.upstream_timeout_s)
        except TimeoutError:
            raise Busy("this session's previous request is still running: retry when it ends",
                       config.retry_after_s) from None
        handed = False
        try:
            layout = self.sessions.get(tenant, key) if key is not None else None
            forward = self.planner.plan(layout, client)
            tools = json.dumps(body.tools, ensure_ascii=False, sort_keys=True) if body.tools else ""
            if _extends(forward, layout) and not body.tools:  # only the added messages are counted: on the loop
                forward, tokens, exact = self.fit(forward, layout, client, body, budget, tools)
            else:  # a whole prompt may be tokenized: off the event loop
                forward, tokens, exact = await asyncio.to_thread(self.fit, forward, layout, client, body, budget,
                                                                 tools)
            route = self._mac("route", tenant.name, key) if key is not None else self._mac(
                "route", tenant.name, json.dumps(client[0], sort_keys=True))
            upstream_body = self._body(tenant, body, forward, budget, route if key is not None else None, key)
            upstream = self.upstream(route)
            self.metrics.layouts.labels(forward.kind).inc()
            if forward.errata:
                self.metrics.errata.inc(len(forward.errata))
            headers = {"X-KVAgent-Layout": forward.kind, "X-KVAgent-Errata": str(len(forward.layout.errata)),
                       "X-KVAgent-Prompt-Tokens": str(tokens), "X-KVAgent-Prompt-Count": "exact" if exact else "bound"}
            if body.stream:
                response = await self._stream(upstream, upstream_body, tenant, key, forward, headers, hold, tools)
                handed = True
                return response
            data = await self._post(upstream, upstream_body)
            reply = shape.reply_of(data)
            if key is not None and reply is not None:
                forward.layout.commit(reply, shape.used(data.get("usage")).total, tools)
                self.sessions.put(tenant, key, forward.layout)
            data["model"] = body.model
            front.count_usage(self.metrics, data.get("usage"))
            return JSONResponse(data, headers=headers)
        finally:
            if not handed:
                hold.release()

    def _body(self, tenant: Tenant, body: ProxyRequest, forward: Forward, budget: int,
              cache_key: str | None, key: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "messages": forward.messages, "max_tokens": budget}
        for name in _PASSED:
            value = getattr(body, name)
            if value is not None:
                out[name] = value
        if body.response_format is not None:
            out["response_format"] = body.response_format.model_dump(by_alias=True, exclude_none=True)
        if cache_key is not None:
            out["prompt_cache_key"] = cache_key
        if self.config.upstream_salt:
            out["cache_salt"] = self.salt(tenant, body.cache_salt, key)
        if body.stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        return out

    async def _post(self, upstream: Upstream, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await upstream.client.post("chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise _unreachable(exc, self.config.retry_after_s) from None
        if response.status_code >= 400:
            raise _refusal(response.status_code, response.content, self.config.retry_after_s)
        try:
            data = response.json()
        except ValueError:
            raise UpstreamFailed("the engine answered something that is not JSON: retry, and check the engine",
                                 502, "upstream_bad_answer") from None
        if not isinstance(data, dict):
            raise UpstreamFailed("the engine answered an unexpected body", 502, "upstream_bad_answer")
        return data

    async def _stream(self, upstream: Upstream, body: dict[str, Any], tenant: Tenant, key: str | None,
                      forward: Forward, headers: dict[str, str], hold: _Hold, tools: str) -> Response:
        request = upstream.client.build_request("POST", "chat/completions", json=body)
        try:
            response = await upstream.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _unreachable(exc, self.config.retry_after_s) from None
        if response.status_code >= 400:
            content = await response.aread()
            await response.aclose()
            raise _refusal(response.status_code, content, self.config.retry_after_s)

        async def events() -> AsyncIterator[bytes]:
            reply = shape.ReplyStream()
            try:
                async for event in EventSource(response).aiter_sse():
                    yield _sse(event)
                    reply.add(event.data)
                if not reply.done and reply.finish is None:
                    raise httpx.RemoteProtocolError("the stream ended without a finish")
                if key is not None and reply.finish is not None:
                    forward.layout.commit(reply.message(), shape.used(reply.usage).total, tools)
                    self.sessions.put(tenant, key, forward.layout)
                front.count_usage(self.metrics, reply.usage)
            except (httpx.HTTPError, shape.EngineStreamError):
                self.metrics.upstream_errors.labels("interrupted").inc()
                log.warning("the engine stopped mid-stream; the turn was not recorded")
                error = error_body("the engine stopped mid-reply: this turn was not recorded, resend the request",
                                   "server_error", None, "upstream_interrupted")
                yield f"data: {json.dumps(error)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                await response.aclose()
                hold.release()  # the session's next request may run

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})

    async def aclose(self) -> None:
        for upstream in self.upstreams:
            await upstream.client.aclose()
        close = getattr(self.counter, "close", None)
        if close is not None:
            close()


class _Hold:
    """A session's lock, held across the response (a stream's last event) and released once."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock, self._released = lock, False

    def release(self) -> None:
        if not self._released and self.lock.locked():
            self._released = True
            self.lock.release()


def _extends(forward: Forward, previous: Layout | None) -> bool:
    """Whether ``forward`` is the previous request and its reply plus messages, with the engine's count of those."""
    return forward.kind in ("append", "errata") and previous is not None and previous.tokens is not None


def _sse(event: ServerSentEvent) -> bytes:
    """An engine's event as it wrote it (its name where it gave one, its data line by line)."""
    lines = [f"event: {event.event}"] if event.event != "message" else []
    lines += [f"data: {line}" for line in event.data.split("\n")]
    return ("\n".join(lines) + "\n\n").encode()


def _unreachable(exc: httpx.HTTPError, retry: int) -> UpstreamFailed:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamFailed("the engine did not answer in time (--upstream-timeout-s): retry later", 504,
                              "upstream_timeout", retry)
    log.warning("the engine could not be reached: %s", type(exc).__name__)
    return UpstreamFailed("no engine answers right now: retry shortly", 503, "upstream_unavailable", retry)


def _refusal(status: int, content: bytes, retry: int) -> ServerError:
    """The engine's refusal as this server's error: a client's mistake (4xx) with the engine's own reason, a fault
    (5xx) with none of its details."""
    try:
        detail = json.loads(content)
        message = detail.get("error", {}).get("message") if isinstance(detail.get("error"), dict) else None
        message = message or detail.get("message") or detail.get("detail")
    except (ValueError, AttributeError):
        message = None
    if status == 429:
        return Busy("the engine is at capacity: retry shortly", retry)
    if status in (400, 413, 422) and isinstance(message, str):
        return ServerError(f"the engine refused the request: {message[:300]}", code="upstream_refused")
    if status in (401, 403, 404):
        log.error("the engine refused this server (%d): check --upstream, --upstream-model and --upstream-key",
                  status)
    else:
        log.error("the engine failed (%d)", status)
    return UpstreamFailed(f"the engine failed on this request (HTTP {status}): retry, and report it if it happens "
                          "again", 502, "upstream_failed")


def create_proxy_app(config: ServerConfig, *, counter: TokenCounter | None = None,
                     transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy as an ASGI app. ``counter`` replaces the model's own tokenizer, ``transport`` the connections to
    the engines (``httpx.MockTransport``, or a transport that records what is sent)."""
    check_start(config)
    tenants = Tenants(config)
    secret = load_secret(config.secret_file)
    metrics = Metrics()
    proxy = Proxy(config, secret, metrics, counter, transport)
    metrics.watch_sessions(proxy.sessions.count)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.aclose()

    app = FastAPI(title="kvagent (proxy)", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat completions forwarded in a prefix-stable layout.")
    app.state.proxy = proxy

    handlers.install_routes(app, metrics, lambda: config.model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ProxyRequest, request: Request) -> Response:
        return await proxy.complete(request.state.tenant, body, request)

    handlers.install(app, "in front of an engine, this server answers POST /v1/chat/completions, GET /v1/models, "
                          "/health and /metrics")
    app.add_middleware(Gate, config=config, tenants=tenants, metrics=metrics,  # type: ignore[arg-type]
                       route=lambda path: path if path in ("/v1/chat/completions", "/v1/models", "/metrics",
                                                           "/health") else "other")
    return app


__all__ = ["Proxy", "UpstreamFailed", "create_proxy_app"]

