"""Helpers of the server tests: an in-process app over an engine, free loopback ports, server processes
on 127.0.0.1 (``kvagent serve``, ``python -m llama_cpp.server``) stopped at the end, a process's memory."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Iterator, TypeVar

# servers started as the load benchmark starts them (they stop when the tests die); free_port re-exported
from kvagent_bench.server.processes import free_port, start_process, stop_process  # noqa: F401

MODEL = "smollm2-135m"
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run one test's coroutine on a fresh event loop (no asyncio plugin needed)."""
    return asyncio.run(coro)  # type: ignore[arg-type]


@asynccontextmanager
async def served(engine: Any, **config: Any) -> AsyncIterator[tuple[Any, Any]]:
    """(app, client) in process over ``engine``; the app's sessions are closed afterwards."""
    import httpx

    from kvagent.aio import AsyncEngine
    from kvagent_server import ServerConfig, create_app

    app = create_app(ServerConfig(model=MODEL, **config), engine=AsyncEngine(engine))
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 50000))  # a loopback client, as on this machine
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=300) as client:
            yield app, client
    finally:
        await app.state.kv.sessions.close()


@contextmanager
def process(args: list[str], url: str, *, env: dict[str, str] | None = None, ready_s: float = 120.0,
            log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process on loopback, wait until ``url`` answers, stop it afterwards."""
    proc = start_process(args, url, log, ready_s, env)
    try:
        yield proc
    finally:
        stop_process(proc)


OCTETS = {"content-type": "application/octet-stream"}
"""The headers of a restore body (the bytes a save answered)."""


def entry_of(app: Any, key: str, kind: str | None = None) -> Any:
    """The server's entry of ``key`` (of ``kind``, or any kind) among every tenant's keyed sessions; KeyError if none."""
    for entry in app.state.kv.sessions.keyed:
        if entry.key == key and (kind is None or entry.kind == kind):
            return entry
    raise KeyError(key)


def keyed(app: Any) -> list[str]:
    """The keys of the server's keyed sessions (every tenant, every kind)."""
    return [e.key for e in app.state.kv.sessions.keyed]


def tenant_of(app: Any, name: str | None = None) -> Any:
    """A tenant of the app (the only one, without a name)."""
    tenants = app.state.kv.tenants.all
    return tenants[0] if name is None else next(t for t in tenants if t.name == name)


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


LLAMA_SERVER_DEPS = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


def llama_cpp_python_server(port: int, n_ctx: int = 4096) -> list[str]:
    """The command of llama-cpp-python's own server on SmolLM2 (RAM prompt cache on, as the load benchmark runs it),
    or a skip naming what it lacks."""
    import importlib.util

    import pytest

    from kvagent.models import resolve_model
    from kvagent_bench.server.load import LLAMA_SERVER_CACHE

    missing = [m for m in LLAMA_SERVER_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"llama_cpp.server needs {', '.join(missing)} (make installs them)")
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(resolve_model(MODEL).path), "--model_alias", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), *LLAMA_SERVER_CACHE]


def kvagent_serve_args(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvagent.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", MODEL, "--log-level", "warning", *extra]



def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (with ``labels``) in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise KeyError(name)
