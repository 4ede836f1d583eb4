"""The FastAPI application: routes, the gate (``kvagent_server.gate``), error mapping and metrics around the session
manager.

``create_app(config)`` loads the model when the app starts (its lifespan); ``create_app(config,
engine=...)`` serves an engine loaded by the caller (tests, embedding) and works without a lifespan
(``httpx.ASGITransport``). Every refusal is an OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` with its status: 400 malformed JSON, 401 missing or
wrong key, 403 a host, origin or route this server does not serve to the caller, 404 unknown model / session /
skill (another tenant's session is unknown), 409 session id taken, 413 a body or prompt too large, 415 a body that
is not JSON (or not bytes, on restore), 422 a bad field (named), 429 a tenant's quota (with ``Retry-After``), 503 no
capacity (with ``Retry-After``). A client's mistake is logged at INFO at most, never with a traceback; a 500 is a
fault of the server's own, logged at ERROR with its traceback.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Path as PathParam, Query, Request
from starlette.responses import JSONResponse, Response

from kvagent.aio import AsyncEngine
from kvagent.errors import (ChatTemplateError, ContextOverflowError, EvictionError, FieldValueError, KVAgentError,
                            KVBlobError, KVCacheFullError, MemoryEditError, SegmentOrderError, SessionClosedError,
                            SkillFileError, ToolChoiceError, ToolSpecError)
from kvagent.models import private_dir
from kvagent.scheduler import EngineClosedError

from kvagent_server import chat, handlers, sessions_api
from kvagent_server.config import ServerConfig
from kvagent_server.errors import error_body
from kvagent_server.front import ChatRequest
from kvagent_server.gate import Gate
from kvagent_server.metrics import Metrics
from kvagent_server.schemas import SESSION_ID, FieldsSet, MemoryEditIn, SessionCreate, SkillInclude
from kvagent_server.state import ServerState
from kvagent_server.tenants import ConfigError, Tenant, Tenants, check_start, load_secret

log = logging.getLogger(__name__)
UNPROCESSABLE = (FieldValueError, SegmentOrderError, EvictionError, SkillFileError, ChatTemplateError, KVBlobError,
                 ToolSpecError, ToolChoiceError, MemoryEditError)
Kind = Literal["session", "prompt_cache_key", "user"]
_RESTORE_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary"}}}}}


def create_app(config: ServerConfig | None = None, *, engine: AsyncEngine | None = None) -> FastAPI:
    """The server as an ASGI app (see the module docstring); :class:`ConfigError` for settings it cannot start with.
    With ``config.upstream``: the proxy in front of those engines (``kvagent_server.proxy``)."""
    config = config or ServerConfig()
    if config.upstream and engine is None:
        from kvagent_server.proxy import create_proxy_app

        return create_proxy_app(config)
    check_start(config)
    tenants = Tenants(config)  # ConfigError naming the keys file
    secret = load_secret(config.secret_file)
    metrics = Metrics()
    holder: dict[str, Any] = {}

    def start(loaded: AsyncEngine) -> ServerState:
        park = park_folder(config.park_dir)
        holder["park_tmp"] = config.park_dir is None
        holder["park"] = park
        state = ServerState(config, loaded, metrics, park, tenants, secret)
        app.state.kv = state
        return state

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = engine is None
        if owned:
            loaded = await AsyncEngine.load(config.model, n_ctx=config.n_ctx, n_seq_max=config.n_seq_max,
                                            n_threads=config.n_threads, flash_attn=config.flash_attn,
                                            prefill_chunk_alone=config.prefill_chunk_alone,
                                            cache_ram_mb=config.cache_ram_mb, cache_disk_mb=config.cache_disk_mb,
                                            cache_disk_format=config.cache_disk_format)
            start(loaded)
        try:
            yield
        finally:
            state: ServerState | None = getattr(app.state, "kv", None)
            if state is not None:
                await state.sessions.close()
                if owned:
                    await state.engine.aclose()
            if holder.get("park_tmp"):
                shutil.rmtree(holder["park"], ignore_errors=True)

    app = FastAPI(title="kvagent", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat completions over sessions whose KV cache stays alive.")
    if engine is not None:
        start(engine)
    handlers.install_routes(app, metrics, lambda: app.state.kv.model_id)
    _routes(app)
    _errors(app)
    app.add_middleware(Gate, config=config, tenants=tenants, metrics=metrics, route=_route)  # type: ignore[arg-type]
    return app


def park_folder(given: Path | None) -> Path:
    """Where parked KV goes: a fresh temporary folder (0700), or ``given``, made 0700 and refused when another user
    could write it (``kvagent.models.private_dir``)."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix="kvagent-parked-"))
    given.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        given.chmod(0o700)
    except OSError as exc:
        raise ConfigError(f"--park-dir {given}: cannot make it private ({exc.strerror})") from None
    return private_dir(given, "--park-dir")


def _state(request: Request) -> ServerState:
    return request.app.state.kv  # type: ignore[no-any-return]


def _tenant(request: Request) -> Tenant:
    return request.state.tenant  # type: ignore[no-any-return]


def _routes(app: FastAPI) -> None:
    session_id = PathParam(pattern=SESSION_ID)
    kind_query = Query("session", description="the kind of session: made by POST /v1/sessions (session), or keyed "
                                              "by chat requests' prompt_cache_key or user")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await chat.complete(_state(request), _tenant(request), body, request)

    @app.post("/v1/sessions", status_code=201)
    async def create_session(body: SessionCreate, request: Request) -> dict[str, Any]:
        return await sessions_api.create(_state(request), _tenant(request), body,
                                         body.id or f"sess-{uuid.uuid4().hex[:20]}")

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        return sessions_api.listing(_state(request), _tenant(request))

    @app.get("/v1/sessions/{sid}")
    async def read_session(request: Request, sid: str = session_id, kind: Kind = kind_query) -> dict[str, Any]:
        return await sessions_api.read(_state(request), _tenant(request), sid, kind)

    @app.post("/v1/sessions/{sid}/fields")
    async def set_fields(body: FieldsSet, request: Request, sid: str = session_id,
                         kind: Kind = kind_query) -> dict[str, Any]:
        return await sessions_api.set_fields(_state(request), _tenant(request), sid, kind, body)

    @app.get("/v1/sessions/{sid}/memory")
    async def read_memory(request: Request, sid: str = session_id, kind: Kind = kind_query) -> dict[str, Any]:
        return await sessions_api.read_memory(_state(request), _tenant(request), sid, kind)

    @app.post("/v1/sessions/{sid}/memory")
    async def edit_memory(body: MemoryEditIn, request: Request, sid: str = session_id,
                          kind: Kind = kind_query) -> dict[str, Any]:
        return await sessions_api.edit_memory(_state(request), _tenant(request), sid, kind, body)

    @app.post("/v1/sessions/{sid}/skills")
    async def include_skill(body: SkillInclude, request: Request, sid: str = session_id,
                            kind: Kind = kind_query) -> dict[str, Any]:
        return await sessions_api.include(_state(request), _tenant(request), sid, kind, body.name)

    @app.post("/v1/sessions/{sid}/save", response_class=Response,
              responses={200: {"content": {"application/octet-stream": {}}}})
    async def save_session(request: Request, sid: str = session_id, kind: Kind = kind_query) -> Response:
        data = await sessions_api.save(_state(request), _tenant(request), sid, kind)
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/sessions/{sid}/restore", status_code=201, openapi_extra=_RESTORE_BODY)
    async def restore_session(request: Request, sid: str = session_id) -> dict[str, Any]:
        return await sessions_api.restore(_state(request), _tenant(request), sid, await request.body())

    @app.delete("/v1/sessions/{sid}", status_code=204)
    async def delete_session(request: Request, sid: str = session_id, kind: Kind = kind_query) -> Response:
        await _state(request).sessions.delete(_tenant(request), sid, kind)
        return Response(status_code=204)


def _errors(app: FastAPI) -> None:
    handlers.install(app, "see GET /openapi.json")

    @app.exception_handler(KVAgentError)
    async def kvagent_error(request: Request, exc: KVAgentError) -> JSONResponse:
        message = str(exc)
        if isinstance(exc, ContextOverflowError):
            body = error_body(message, "invalid_request_error", "messages", "context_length_exceeded")
            return JSONResponse(body, 413)
        if isinstance(exc, UNPROCESSABLE):
            return JSONResponse(error_body(message, "invalid_request_error", None, type(exc).__name__), 422)
        if isinstance(exc, SessionClosedError):
            return JSONResponse(error_body(message, "invalid_request_error", "session", "session_not_found"), 404)
        if isinstance(exc, (KVCacheFullError, EngineClosedError)):
            retry = _state(request).config.retry_after_s
            return JSONResponse(error_body(message, "server_busy", None, type(exc).__name__), 503,
                                headers={"Retry-After": str(retry)})
        log.error("request failed: %s", message, exc_info=exc)
        return JSONResponse(error_body(message, "server_error", None, type(exc).__name__), 500)


def _route(path: str) -> str:
    """A bounded label for a path: session ids become ``{id}``."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[:2] == ["v1", "sessions"]:
        parts[2] = "{id}"
    route = "/" + "/".join(parts)
    return route if route in _ROUTES else "other"


_ROUTES = frozenset({"/v1/chat/completions", "/v1/models", "/v1/sessions", "/v1/sessions/{id}", "/metrics", "/health",
                     *(f"/v1/sessions/{{id}}/{verb}" for verb in ("fields", "memory", "skills", "save", "restore"))})
