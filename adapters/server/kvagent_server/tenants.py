"""Tenants: who a request is, from its bearer key, and what it may hold; and the server's signing secret.

Three ways to run (``ServerConfig``):

- **no key**: one tenant, ``local``, for a single user on this machine (the gate answers loopback clients with a
  loopback ``Host`` only, and ``kvagent serve`` refuses a non-loopback address without keys);
- **one key** (``--api-key`` / ``$KVAGENT_API_KEY``): one tenant, ``default``;
- **a keys file** (``--keys FILE``): JSON, keys stored as their sha256, each tenant with its quotas::

      {"tenants": [
        {"name": "alice", "keys": ["sha256:9f86d0..."], "max_sessions": 200, "max_parked_mb": 2048,
         "max_in_flight": 8, "metrics": true, "cache_scope": "session"},
        {"name": "bob", "keys": ["sha256:..."]}
      ]}

  Quotas left out take the server's settings (``--max-sessions``, ``--cache-scope`` ...); ``metrics: true`` lets the tenant read
  ``/metrics`` (counts over every tenant: off by default). ``python -m kvagent_server.tenants new NAME`` prints a
  fresh key and the line to add.

A presented key is hashed (sha256) and looked up by its hash: no key is kept in memory in clear when a keys file is
used, none is ever logged, and the lookup's time does not depend on how much of a key matched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvagent.sessions.snapshot import MIN_SECRET

from kvagent_server.config import ServerConfig, is_loopback

log = logging.getLogger(__name__)
TENANT_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
_HASHED = re.compile(r"^sha256:[0-9a-f]{64}$")
LOCAL, DEFAULT = "local", "default"


class ConfigError(Exception):
    """A keys file or secret file the server cannot start with; the message names the file and the fix."""


@dataclass(frozen=True)
class Tenant:
    """One caller's identity and quotas; its sessions, prefix cache and snapshots are its own."""

    name: str
    max_sessions: int
    max_parked_bytes: int
    max_in_flight: int
    metrics: bool = True
    cache_scope: Literal["tenant", "session"] = "tenant"
    """``session``: a session starts only from its own session key's KV (``TenancySettings.cache_scope``)."""


class _TenantIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TENANT_NAME)
    keys: list[str] = Field(min_length=1)
    max_sessions: int | None = Field(None, ge=1)
    max_parked_mb: int | None = Field(None, ge=0)
    max_in_flight: int | None = Field(None, ge=1)
    metrics: bool = False
    cache_scope: Literal["tenant", "session"] | None = None


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[_TenantIn] = Field(min_length=1)


def key_hash(key: str) -> str:
    """How a keys file stores ``key``: ``sha256:`` and its hex digest."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class Tenants:
    """The tenants of one server and how a request's ``Authorization`` header maps to one."""

    def __init__(self, config: ServerConfig) -> None:
        self.authenticated = config.authenticated
        self._by_hash: dict[str, Tenant] = {}
        self.local: Tenant | None = None

        def quota(name: str, sessions: int | None = None, parked_mb: int | None = None,
                  in_flight: int | None = None, metrics: bool = True,
                  cache_scope: Literal["tenant", "session"] | None = None) -> Tenant:
            return Tenant(name, sessions or config.max_sessions,
                          (config.max_parked_mb if parked_mb is None else parked_mb) << 20,
                          in_flight or config.max_in_flight, metrics, cache_scope or config.cache_scope)

        if config.keys_file is not None:
            for t in load_keys_file(config.keys_file):
                tenant = quota(t.name, t.max_sessions, t.max_parked_mb, t.max_in_flight, t.metrics, t.cache_scope)
                for h in t.keys:
                    self._by_hash[h] = tenant
        elif config.api_key is not None:
            self._by_hash[key_hash(config.api_key.get_secret_value().strip())] = quota(DEFAULT)
        else:
            self.local = quota(LOCAL)
        self.all = sorted({t.name: t for t in self._by_hash.values()}.values(), key=lambda t: t.name) \
            if self._by_hash else [self.local]  # type: ignore[list-item]

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` value; None when it is missing or unknown. Without
        keys, every request is the local tenant."""
        if not self.authenticated:
            return self.local
        if authorization is None:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        # looked up by the key's hash: how long the lookup takes says nothing about how much of a stored key matched
        return self._by_hash.get(key_hash(token))


def check_start(config: ServerConfig) -> None:
    """Refuse, before anything loads, a server that would be open to others without keys."""
    if not config.authenticated and not is_loopback(config.host):
        raise ConfigError(f"--host {config.host} serves other machines, and this server has no keys: give it "
                          "--keys FILE (tenants with hashed keys) or --api-key, or listen on 127.0.0.1")


def load_keys_file(path: Path) -> list[_TenantIn]:
    """The tenants of a keys file; :class:`ConfigError` naming the file and what is wrong (never a key)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--keys {path}: cannot read it ({exc.strerror})") from None
    try:
        parsed = _KeysFile.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        detail = exc.errors(include_input=False) if isinstance(exc, ValidationError) else str(exc)
        raise ConfigError(f"--keys {path}: not a keys file ({detail}); see docs/server.md, \"Tenants\"") from None
    names: set[str] = set()
    seen: set[str] = set()
    for i, tenant in enumerate(parsed.tenants):
        if tenant.name in names:
            raise ConfigError(f"--keys {path}: tenant {tenant.name!r} is listed twice")
        names.add(tenant.name)
        for j, h in enumerate(tenant.keys):
            if not _HASHED.match(h):
                raise ConfigError(f"--keys {path}: tenants.{i}.keys.{j} is not 'sha256:<64 hex digits>': the file "
                                  "holds keys hashed, never in clear (python -m kvagent_server.tenants hash)")
            if h in seen:
                raise ConfigError(f"--keys {path}: tenants.{i}.keys.{j} is also another tenant's key")
            seen.add(h)
    return parsed.tenants


def load_secret(path: Path | None) -> bytes:
    """The snapshot signing secret: ``path``'s bytes (created with 32 random bytes, mode 0600, when missing), or a
    fresh secret for this process (snapshots then do not survive a restart). A secret file that others can read,
    or shorter than 32 bytes, is a :class:`ConfigError`."""
    if path is None:
        return secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"--secret-file {path}: cannot create it ({exc.strerror})") from None
    else:
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
        log.info("created a new snapshot signing secret in %s", path)
    try:
        info = path.stat()
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--secret-file {path}: cannot read it ({exc.strerror})") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"--secret-file {path}: other users can read or write it (mode "
                          f"{stat.filemode(info.st_mode)}): run `chmod 600 {path}`")
    if len(data) < MIN_SECRET:
        raise ConfigError(f"--secret-file {path}: holds {len(data)} bytes, a secret needs at least {MIN_SECRET} "
                          "(delete the file and the server makes a new one)")
    return data


def main(argv: list[str]) -> int:
    """``python -m kvagent_server.tenants new NAME`` (a fresh key and its keys-file entry) or ``hash KEY``."""
    if len(argv) == 2 and argv[0] == "new" and re.match(TENANT_NAME, argv[1]):
        key = "kva-" + secrets.token_urlsafe(32)
        print(f"key (give it to the tenant; it is not stored): {key}")
        print("keys file entry:", json.dumps({"name": argv[1], "keys": [key_hash(key)]}))
        return 0
    if len(argv) == 2 and argv[0] == "hash":
        print(key_hash(argv[1]))
        return 0
    print("usage: python -m kvagent_server.tenants new NAME   (NAME: lowercase letters, digits, _ . -)\n"
          "       python -m kvagent_server.tenants hash KEY", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
