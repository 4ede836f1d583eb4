"""kvagent's OpenAI-compatible server (``kvagent serve``) and remote engines (:mod:`kvagent_server.remote`).

    from kvagent_server import ServerConfig, create_app, serve
    serve(ServerConfig(model="smollm2-135m", port=8000))      # what `kvagent serve` runs

The server's modules load on first use, so ``kvagent_server.remote`` does not import FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvagent_server.app import create_app
    from kvagent_server.config import ServerConfig


def serve(config: ServerConfig, *, log_level: str = "info") -> None:
    """Run the server with uvicorn until interrupted (the model loads at start-up); refused at once
    (``tenants.ConfigError``) for settings that would open it to others without keys, or a bad keys / secret file."""
    import logging

    import uvicorn

    from kvagent_server.app import create_app

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:    %(name)s: %(message)s"))
    for name in ("kvagent", "kvagent_server"):  # the server's own lines beside uvicorn's
        logger = logging.getLogger(name)
        logger.setLevel(log_level.upper() if log_level.upper() in logging.getLevelNamesMapping() else "INFO")
        logger.addHandler(handler)
        logger.propagate = False

    # no Server header (nothing names the software that answers); a header line beyond 64 KiB is refused
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=log_level,
                timeout_graceful_shutdown=5, server_header=False, h11_max_incomplete_event_size=64 * 1024)


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from kvagent_server.app import create_app

        return create_app
    if name == "ServerConfig":
        from kvagent_server.config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'kvagent_server' has no attribute {name!r}")


__all__ = ["ServerConfig", "create_app", "serve"]
