"""The server's refusals, each with its HTTP status and OpenAI's error shape; raised before any session or KV
changes."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ServerError(Exception):
    """A refusal with an HTTP status and an OpenAI-style error ``type`` / ``param`` / ``code`` (the class's status
    and type unless given)."""

    status = 400
    kind = "invalid_request_error"

    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.kind = status or self.status, kind or self.kind
        self.headers = headers or self.headers

    def response(self) -> JSONResponse:
        """The refusal as sent: its error body, status and headers."""
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), self.status,
                            headers=self.headers)


class InvalidRequest(ServerError):
    """A request the schema accepts but the server cannot serve as asked (422, naming the field)."""

    status = 422


class NotFound(ServerError):
    """An unknown session, model or skill (404)."""

    status = 404


class Conflict(ServerError):
    """A session id that is already taken (409)."""

    status = 409


class TooLarge(ServerError):
    """A prompt, body or snapshot beyond what this server takes (413)."""

    status = 413


class Quota(ServerError):
    """A tenant's quota (sessions, requests in flight) is used up (429, with ``Retry-After``)."""

    status = 429
    kind = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="quota_exceeded")
        self.headers = {"Retry-After": str(retry_after_s)}


class Busy(ServerError):
    """Every sequence or KV cell is held by a session that is working and none is idle to park (503);
    the response carries ``Retry-After``."""

    status = 503
    kind = "server_busy"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, code="no_capacity")
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s)}
