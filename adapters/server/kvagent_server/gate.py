"""The gate every request passes before a route sees it (pure ASGI middleware).

In order, each refusal an OpenAI-style error body (``errors.error_body``) and none of them touching a session:

1. **Local only without keys** (DNS rebinding): a server run without keys answers loopback clients whose ``Host``
   is ``localhost``, ``127.0.0.1`` or ``[::1]`` (any port); anything else is a 403.
2. **No other site** (CSRF): a request whose ``Origin`` is not the server's own (nor one of ``allowed_origins``)
   is a 403, with keys or without.
3. **Who** (``tenants.Tenants``): the bearer key's tenant (401 without a known one; ``GET /health`` needs none);
   ``/metrics`` only for tenants allowed to read it (403).
4. **How much at once**: a tenant's requests in flight beyond its quota are a 429 with ``Retry-After``.
5. **What kind of body**: ``POST`` bodies are ``application/json`` (``application/octet-stream`` on ``restore``),
   else 415, so an HTML form cannot post to the server.
6. **How big**: a body beyond ``max_body_kb`` (``max_snapshot_mb`` on restore) is a 413, read no further.
7. **Well-formed JSON**: nested deeper than ``max_json_depth`` (measured before parsing), ``NaN`` / ``Infinity``,
   text with a lone surrogate: 422 naming it; malformed JSON is left to the route's 400.

The route then sees the body, already read, and ``request.state.tenant``. Response codes and request time go to the
metrics. (Not ``BaseHTTPMiddleware``: it would hide client disconnects from the routes, which cancel generations.)
"""

from __future__ import annotations

import json
import re
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvagent_server.config import LOOPBACK_NAMES, ServerConfig, is_loopback
from kvagent_server.errors import ServerError
from kvagent_server.metrics import Metrics
from kvagent_server.tenants import Tenant, Tenants

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_SUSPECT = re.compile(rb"NaN|Infinity|\\u[dD][89a-fA-F]")  # what only a parse can tell apart
_OPEN, _CLOSE = np.zeros(256, np.int32), np.zeros(256, np.int32)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE[[ord("]"), ord("}")]] = 1
JSON_TYPES = ("application/json",)
OPEN_ROUTES = ("/health",)


def _refused(status: int, message: str, kind: str, code: str, param: str | None = None,
             headers: dict[str, str] | None = None) -> ServerError:
    """A refusal of the gate (the routes' own type: ``errors.ServerError``)."""
    return ServerError(message, param=param, code=code, status=status, kind=kind, headers=headers)


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in ``body`` (JSON text), strings skipped; computed without parsing."""
    bare = _STRING.sub(b"", body)
    if not bare:
        return 0
    codes = np.frombuffer(bare, np.uint8)
    return int(np.cumsum(_OPEN[codes] - _CLOSE[codes]).max(initial=0))


def _no_constant(name: str) -> Any:
    raise _refused(422, f"the body holds {name}, which is not JSON: send a number", "invalid_request_error",
                   "invalid_number")


def _surrogate_at(value: Any, where: str = "") -> str | None:
    """The path of the first text holding a lone surrogate (only called once one is known to be there)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _surrogate_at(key) is not None:
            return f"{where}.{key!r}".lstrip(".")
        found = _surrogate_at(item, f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def check_json(body: bytes, max_depth: int) -> None:
    """Refuse (``errors.ServerError``, 422) a JSON body nested deeper than ``max_depth``, holding ``NaN`` /
    ``Infinity``, invalid UTF-8 or a lone surrogate; malformed JSON passes (the route answers it with a 400 naming
    where).

    Cheap for ordinary bodies: the nesting is measured only where the body holds more brackets than ``max_depth``,
    and the body is parsed here only where it may hold a constant (``NaN``, ``Infinity``) or a surrogate escape
    (a lone surrogate cannot be written in UTF-8 itself, only as ``\\udXXX``)."""
    if body.count(b"[") + body.count(b"{") > max_depth:
        depth = json_depth(body)
        if depth > max_depth:
            raise _refused(422, f"the body nests arrays and objects {depth} deep; at most {max_depth} are accepted",
                           "invalid_request_error", "json_too_deep")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refused(400, f"the body is not UTF-8 (byte {exc.start}): send JSON in UTF-8", "invalid_request_error",
                       "json_invalid") from None
    if not _SUSPECT.search(body):
        return
    try:
        parsed = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError:
        return  # malformed: the route's own parse answers 400 with the position
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more digits than Python converts
        raise _refused(422, f"the body cannot be read: {str(exc)[:200]}", "invalid_request_error",
                       "invalid_value") from None
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        where = _surrogate_at(parsed) or "body"
        raise _refused(422, f"{where}: text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); send "
                       "valid Unicode", "invalid_request_error", "invalid_text", where) from None


def _host_name(host: str) -> str:
    """``Host`` without its port (``[::1]:8000`` -> ``[::1]``)."""
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Gate:
    """The checks of the module docstring, then the app; response codes and request times counted."""

    def __init__(self, app: ASGIApp, config: ServerConfig, tenants: Tenants, metrics: Metrics,
                 route: Any) -> None:
        self.app, self.config, self.tenants, self.metrics, self.route = app, config, tenants, metrics, route
        self.origins = {o.rstrip("/").lower() for o in config.allowed_origins}
        self.in_flight: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        start = time.perf_counter()
        status = {"code": 500}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        tenant: Tenant | None = None
        try:
            try:
                headers = _headers(scope)
                tenant = self._admit(scope, path, headers)
                if tenant is not None:
                    scope.setdefault("state", {})["tenant"] = tenant
                    self.in_flight[tenant.name] = self.in_flight.get(tenant.name, 0) + 1
                receive = await self._body(scope, receive, path, headers)
            except ServerError as refused:
                await refused.response()(scope, receive, sending)
                return
            await self.app(scope, receive, sending)
        finally:
            if tenant is not None and scope.get("state", {}).get("tenant") is tenant:
                self.in_flight[tenant.name] -= 1
            self.metrics.responses.labels(str(status["code"])).inc()
            self.metrics.request_time.labels(self.route(path)).observe(time.perf_counter() - start)

    # -- checks ------------------------------------------------------------------------------------
    def _admit(self, scope: Scope, path: str, headers: dict[str, str]) -> Tenant | None:
        """The tenant of the request (None: an open route), after the host, origin and key checks."""
        host = headers.get("host", "")
        if not self.tenants.authenticated:
            client = scope.get("client")
            if client is not None and not is_loopback(str(client[0])):
                raise _refused(403, "this server runs without keys and answers this machine only: start it with "
                               "--keys FILE (or --api-key) to serve other machines", "permission_error",
                               "loopback_only")
            if _host_name(host.lower()) not in LOOPBACK_NAMES:
                raise _refused(403, f"Host {host[:100]!r} is not this machine: a server without keys answers "
                               "localhost, 127.0.0.1 and [::1] only (start it with --keys to serve other names)",
                               "permission_error", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._same_site(origin, host):
            raise _refused(403, f"Origin {origin[:100]!r} is another site: kvagent serve answers no web page of "
                           "another origin (allow one with --allow-origin)", "permission_error", "origin_not_allowed")
        if path in OPEN_ROUTES:
            return None
        tenant = self.tenants.authenticate(headers.get("authorization"))
        if tenant is None:
            raise _refused(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error",
                           "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if path == "/metrics" and not tenant.metrics:
            raise _refused(403, "this key may not read /metrics (it counts every tenant's requests): the keys file "
                           "gives a tenant \"metrics\": true", "permission_error", "metrics_not_allowed")
        if self.in_flight.get(tenant.name, 0) >= tenant.max_in_flight:
            retry = str(self.config.retry_after_s)
            raise _refused(429, f"{tenant.max_in_flight} requests of this key are in flight already: wait for one "
                           "to finish (the quota is max_in_flight)", "rate_limit_error", "too_many_requests",
                           headers={"Retry-After": retry})
        return tenant

    def _same_site(self, origin: str, host: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == host.lower()

    async def _body(self, scope: Scope, receive: Receive, path: str, headers: dict[str, str]) -> Receive:
        """``receive`` replaying the body, read here in full after the type and size checks."""
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return receive
        restore = path.endswith("/restore")
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        limit = self.config.max_snapshot_mb << 20 if restore else self.config.max_body_kb << 10
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_big(limit, restore)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _refused(400, "the client left before its body arrived", "invalid_request_error", "disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_big(limit, restore)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if restore:
            if kind != "application/octet-stream":
                raise _refused(415, f"restore takes the bytes save answered as application/octet-stream, not "
                               f"{kind or 'no Content-Type'}", "invalid_request_error", "unsupported_media_type")
        elif body or kind:
            if kind not in JSON_TYPES:
                raise _refused(415, f"send the body as application/json, not {kind or 'no Content-Type'}",
                               "invalid_request_error", "unsupported_media_type")
            check_json(body, self.config.max_json_depth)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    def _too_big(self, limit: int, restore: bool) -> ServerError:
        what = "a saved session" if restore else "a JSON body"
        setting = "--max-snapshot-mb" if restore else "--max-body-kb"
        return _refused(413, f"the body is larger than {limit >> 10} KiB, the most this server takes for {what} "
                        f"({setting})", "invalid_request_error", "body_too_large")


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lowercase name (the first of repeated ones), decoded as latin-1."""
    out: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out
