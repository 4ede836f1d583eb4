"""What both apps share (``kvagent serve`` and ``kvagent serve --upstream``): the exception handlers (every refusal
an OpenAI-style error body with its status, a fault of the server's own a 500 logged with its traceback and
answered without it), and the routes that are not the chat: ``/health``, ``/metrics`` and ``/v1/models``."""

from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from kvagent_server.errors import ServerError, error_body
from kvagent_server.metrics import Metrics

log = logging.getLogger(__name__)


def validation_message(e: dict[str, Any], param: str) -> str:
    """One of pydantic's errors as a sentence naming ``param`` and the fix."""
    kind = e.get("type")
    if kind == "extra_forbidden":
        return f"{param}: not supported by kvagent serve (refused, never ignored): leave it out"
    if kind == "none_required":
        return f"{param}: not supported by kvagent serve: leave it out or send null"
    if param == "seed" and kind == "greater_than_equal":
        return ("seed: a non-negative integer (leave seed out for a random one; -1 is llama.cpp's 'random', not "
                "OpenAI's)")
    return f"{param}: {e.get('msg', 'invalid')}"


def install(app: FastAPI, routes_hint: str) -> None:
    """The handlers on ``app``; ``routes_hint`` ends the message of an unknown route (where the routes are listed)."""

    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        log.info("refused (%d): %s", exc.status, exc.message)
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path[:200]}: {routes_hint}",
                   405: f"{request.method} is not allowed on {request.url.path[:200]}"}.get(exc.status_code,
                                                                                            str(exc.detail))
        return JSONResponse(error_body(message, kind, None, str(exc.status_code)), exc.status_code,
                            headers=getattr(exc, "headers", None))

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
        for e in errors[:8]:
            loc = [str(x) for x in e.get("loc", ()) if x not in ("body", "path", "query")]
            param = ".".join(loc) or "body"
            first_param = first_param or param
            parts.append(validation_message(e, param))
        return JSONResponse(error_body("; ".join(parts), "invalid_request_error", first_param, "invalid_value"), 422)

    @app.exception_handler(Exception)
    async def fault(request: Request, exc: Exception) -> JSONResponse:
        log.error("request to %s failed", request.url.path, exc_info=exc)
        return JSONResponse(error_body("the server failed on this request: retry, and report it if it happens again",
                                       "server_error", None, "internal_error"), 500)


def install_routes(app: FastAPI, metrics: Metrics, model_id: Callable[[], str]) -> None:
    """``/health``, ``/metrics`` (Prometheus' text format) and ``/v1/models`` (the one model, ``model_id()``)."""

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def read_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id(), "object": "model", "created": 0, "owned_by": "kvagent"}]}
