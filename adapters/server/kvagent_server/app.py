"""The FastAPI application: routes, authentication, error mapping and metrics around the session manager.

``create_app(config)`` loads the model when the app starts (its lifespan); ``create_app(config,
engine=...)`` serves an engine loaded by the caller (tests, embedding) and works without a lifespan
(``httpx.ASGITransport``). Every refusal is an OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` with its status: 400 malformed JSON, 401 missing or
wrong key, 404 unknown model / session / skill, 409 session id taken, 413 prompt too long, 422 a bad
field (named), 503 no capacity (with ``Retry-After``).
"""

from __future__ import annotations

import hmac
import logging
import shutil
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Path as PathParam, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvagent.aio import AsyncEngine
from kvagent.errors import (ChatTemplateError, ContextOverflowError, EvictionError, FieldValueError, KVAgentError,
                            KVBlobError, KVCacheFullError, SegmentOrderError, SessionClosedError, SkillFileError,
                            ToolChoiceError, ToolSpecError)
from kvagent.scheduler import EngineClosedError

from kvagent_server import chat, sessions_api
from kvagent_server.config import ServerConfig
from kvagent_server.errors import Busy, ServerError, error_body
from kvagent_server.metrics import Metrics
from kvagent_server.schemas import SESSION_ID, ChatRequest, FieldsSet, SessionCreate, SkillInclude
from kvagent_server.state import ServerState

log = logging.getLogger(__name__)
UNPROCESSABLE = (FieldValueError, SegmentOrderError, EvictionError, SkillFileError, ChatTemplateError, KVBlobError,
                 ToolSpecError, ToolChoiceError)


def create_app(config: ServerConfig | None = None, *, engine: AsyncEngine | None = None) -> FastAPI:
    """The server as an ASGI app (see the module docstring)."""
    config = config or ServerConfig()
    metrics = Metrics()
    holder: dict[str, Any] = {}

    def start(loaded: AsyncEngine) -> ServerState:
        park = config.park_dir or Path(tempfile.mkdtemp(prefix="kvagent-parked-"))
        park.mkdir(parents=True, exist_ok=True)
        holder["park_tmp"] = config.park_dir is None
        holder["park"] = park
        state = ServerState(config, loaded, metrics, park)
        app.state.kv = state
        return state

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = engine is None
        if owned:
            loaded = await AsyncEngine.load(config.model, n_ctx=config.n_ctx, n_seq_max=config.n_seq_max,
                                            n_threads=config.n_threads, flash_attn=config.flash_attn)
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
    _routes(app)
    _errors(app, metrics)
    app.add_middleware(_Gate, api_key=config.api_key, metrics=metrics)  # type: ignore[arg-type]
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.kv  # type: ignore[no-any-return]


def _routes(app: FastAPI) -> None:
    session_id = PathParam(pattern=SESSION_ID)

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state = _state(request)
        model = {"id": state.model_id, "object": "model", "created": 0, "owned_by": "kvagent"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await chat.complete(_state(request), body, request)

    @app.post("/v1/sessions", status_code=201)
    async def create_session(body: SessionCreate, request: Request) -> dict[str, Any]:
        return await sessions_api.create(_state(request), body, body.id or f"sess-{uuid.uuid4().hex[:20]}")

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        return sessions_api.listing(_state(request))

    @app.get("/v1/sessions/{sid}")
    async def read_session(request: Request, sid: str = session_id) -> dict[str, Any]:
        state = _state(request)
        return sessions_api.view(state, state.sessions.get(sid))

    @app.post("/v1/sessions/{sid}/fields")
    async def set_fields(body: FieldsSet, request: Request, sid: str = session_id) -> dict[str, Any]:
        return await sessions_api.set_fields(_state(request), sid, body)

    @app.post("/v1/sessions/{sid}/skills")
    async def include_skill(body: SkillInclude, request: Request, sid: str = session_id) -> dict[str, Any]:
        return await sessions_api.include(_state(request), sid, body.name)

    @app.post("/v1/sessions/{sid}/save")
    async def save_session(request: Request, sid: str = session_id) -> Response:
        data = await sessions_api.save(_state(request), sid)
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/sessions/{sid}/restore", status_code=201)
    async def restore_session(request: Request, sid: str = session_id) -> dict[str, Any]:
        return await sessions_api.restore(_state(request), sid, await request.body())

    @app.delete("/v1/sessions/{sid}", status_code=204)
    async def delete_session(request: Request, sid: str = session_id) -> Response:
        await _state(request).sessions.delete(sid)
        return Response(status_code=204)


def _errors(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Busy) else None
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            where = detail.get("loc", ())
            ctx = detail.get("ctx", {}).get("error", "")
            message = f"the body is not valid JSON ({ctx or 'parse error'} at {where[-1] if where else '?'})"
            return JSONResponse(error_body(message, "invalid_request_error", None, "json_invalid"), 400)
        parts = []
        first_param = None
        for e in errors:
            loc = [str(x) for x in e.get("loc", ()) if x not in ("body", "path", "query")]
            param = ".".join(loc) or "body"
            first_param = first_param or param
            parts.append(f"{param}: {e.get('msg', 'invalid')}")
        return JSONResponse(error_body("; ".join(parts), "invalid_request_error", first_param, "invalid_value"), 422)

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
        log.error("request failed: %s", message)
        return JSONResponse(error_body(message, "server_error", None, type(exc).__name__), 500)


class _Gate:
    """Pure ASGI middleware: the bearer key (all but ``/health``), response codes and request time.

    (Not ``BaseHTTPMiddleware``: it would hide client disconnects from the routes, which cancel
    generations on them.)"""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        start = time.perf_counter()
        if self.api_key and path != "/health" and not self._authorised(scope):
            response = JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                               "authentication_error", None, "invalid_api_key"), 401,
                                    headers={"WWW-Authenticate": "Bearer"})
            self.metrics.responses.labels("401").inc()
            await response(scope, receive, send)
            return
        status = {"code": 500}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.responses.labels(str(status["code"])).inc()
            self.metrics.request_time.labels(_route(path)).observe(time.perf_counter() - start)

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())  # type: ignore[union-attr]
        return False


def _route(path: str) -> str:
    """A bounded label for a path: session ids become ``{id}``."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[:2] == ["v1", "sessions"]:
        parts[2] = "{id}"
    route = "/" + "/".join(parts)
    return route if route in _ROUTES else "other"


_ROUTES = frozenset({"/v1/chat/completions", "/v1/models", "/v1/sessions", "/v1/sessions/{id}", "/metrics", "/health",
                     *(f"/v1/sessions/{{id}}/{verb}" for verb in ("fields", "skills", "save", "restore"))})
