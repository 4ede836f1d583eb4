"""llama.cpp's own ``llama-server``, started on 127.0.0.1 for the benchmarks and tests that compare with it.

The binary is built by ``make llama-server`` from the same pinned llama-cpp-python sdist, kvagent's patches and
portable flags as kvagent's wheel (``scripts/build_llama_server.sh``), and cached beside the wheel as
``~/.cache/kvagent/bin/llama-server-<the installed llama-cpp-python version>`` (e.g.
``llama-server-0.3.36+kvagent.5fbbeac2``): the same llama.cpp on both sides of a comparison. ``$KVAGENT_LLAMA_SERVER``
points at another binary. Nothing here is imported by kvagent's library: only benchmarks and tests use it.

    with LlamaServer(LlamaServerConfig("smollm2-135m", cache_reuse=256), log_dir) as server:
        reply = server.post("/v1/chat/completions", {"messages": [...], "cache_prompt": True})
        reply["timings"]["prompt_n"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx

from kvagent.errors import KVAgentError
from kvagent.models import cache_dir, resolve_model
from kvagent_bench.server.processes import free_port, start_process, stop_process

ENV = "KVAGENT_LLAMA_SERVER"
# registry models whose GGUF ships no chat template: llama.cpp's built-in template of the family (the turn
# format kvagent builds in for them); without it llama-server falls back to ChatML
BUILTIN_TEMPLATES = {"gemma3-270m": "gemma"}


class LlamaServerMissing(KVAgentError):
    """No ``llama-server`` binary: the message says how to build one."""


def default_path() -> Path:
    """Where ``make llama-server`` puts the binary for the installed llama-cpp-python build."""
    try:
        built = version("llama_cpp_python")
    except PackageNotFoundError:
        built = "unknown"
    return cache_dir() / "bin" / f"llama-server-{built}"


def find_binary() -> Path | None:
    """``$KVAGENT_LLAMA_SERVER`` when set, else :func:`default_path`, if it is an executable file; else None."""
    path = Path(os.environ[ENV]) if os.environ.get(ENV) else default_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def binary() -> Path:
    """The ``llama-server`` binary; :class:`LlamaServerMissing` naming the fix when there is none."""
    found = find_binary()
    if found is not None:
        return found
    if os.environ.get(ENV):
        raise LlamaServerMissing(f"${ENV}={os.environ[ENV]} is not an executable file: point it at a llama-server "
                                 "binary, or unset it and run `make llama-server`")
    raise LlamaServerMissing(f"llama-server is not built ({default_path()} is missing): run `make llama-server` "
                             "(builds it once from the pinned llama-cpp-python sdist with kvagent's patches, about "
                             f"half an hour on 2 busy cores), or set ${ENV} to a binary")


def missing_reason() -> str | None:
    """Why llama-server cannot be started here (for ``pytest.skip``), or None when it can."""
    try:
        binary()
    except LlamaServerMissing as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class LlamaServerConfig:
    """How ``llama-server`` is started: one model, ``slots`` parallel slots sharing ``n_ctx`` tokens of KV.

    Defaults are the server's own except where a comparison needs them fixed: the thread count (kvagent's: all
    cores), ``cache_reuse`` (``--cache-reuse N``: reuse cached chunks of at least N tokens behind a change by
    shifting their KV; 0 = off, the server's default), and the chat template for GGUFs that ship none
    (Gemma-3-270M: llama.cpp's built-in ``gemma`` template, the turn format kvagent builds in). Token counts
    are checked against kvagent's rendering by the remote-session tests.
    """

    model: str = "smollm2-135m"
    """Registry name or path of a ``.gguf`` file."""
    n_ctx: int = 4096
    """Total KV tokens (``-c``); each slot gets ``n_ctx / slots`` unless ``kv_unified``."""
    slots: int = 1
    """Parallel slots (``-np``)."""
    cache_reuse: int = 0
    """``--cache-reuse``: the least chunk (tokens) shifted into place behind a change; 0 = off."""
    threads: int = 0
    """``-t`` and ``-tb``; 0 = every core, as kvagent's engine."""
    flash_attn: str = "auto"
    """``-fa``: on, off or auto (the server's default)."""
    kv_unified: bool = False
    """``-kvu``: one KV pool shared by all slots (on: a slot may use the whole context)."""
    cache_ram_mib: int | None = None
    """``--cache-ram``: the host-RAM prompt cache (MiB; None = the server's default, 8192; 0 = off)."""
    chat_template: str | None = None
    """``--chat-template``; None = the GGUF's own, or :data:`BUILTIN_TEMPLATES`' for a registry model without one."""
    alias: str | None = None
    """The model name the server answers to (default: the registry name or the file's stem)."""
    extra: tuple[str, ...] = ()
    """More command-line options, passed as they are."""

    def __post_init__(self) -> None:
        if self.flash_attn not in ("on", "off", "auto"):
            raise ValueError(f"flash_attn={self.flash_attn!r}: use on, off or auto")
        for name in ("n_ctx", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_reuse < 0 or self.threads < 0:
            raise ValueError("cache_reuse and threads must be >= 0")

    @property
    def name(self) -> str:
        return self.alias or (self.model if "/" not in self.model and not self.model.endswith(".gguf")
                              else Path(self.model).stem)

    def args(self, port: int) -> list[str]:
        """The command line (without the binary) for ``port`` on 127.0.0.1."""
        ref = resolve_model(self.model)
        threads = str(self.threads or os.cpu_count() or 1)
        out = ["-m", str(ref.path), "--alias", self.name, "--host", "127.0.0.1", "--port", str(port),
               "-c", str(self.n_ctx), "-np", str(self.slots), "-t", threads, "-tb", threads, "-fa", self.flash_attn,
               "--metrics", "--slots", "--no-webui", "-kvu" if self.kv_unified else "-no-kvu"]
        if self.cache_reuse:
            out += ["--cache-reuse", str(self.cache_reuse)]
        if self.cache_ram_mib is not None:
            out += ["--cache-ram", str(self.cache_ram_mib)]
        template = self.chat_template or BUILTIN_TEMPLATES.get(self.model)
        if template in BUILTIN_TEMPLATES.values():
            # a built-in template by name: llama-server reads --chat-template as Jinja source while Jinja is on (its
            # default), which turned "gemma" into a 3-token prompt; the name is honoured only without Jinja
            out += ["--no-jinja", "--chat-template", template]
        elif template:
            out += ["--chat-template", template]
        return [*out, *self.extra]


class LlamaServer:
    """A running ``llama-server`` (a context manager: stopped on exit, also when this process dies)."""

    def __init__(self, config: LlamaServerConfig, log_dir: Path, *, ready_s: float = 180.0) -> None:
        self.config = config
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"llama-server-{self.port}.log"
        self.proc = start_process([str(binary()), *config.args(self.port)], f"{self.base}/health", self.log, ready_s)
        self.client = httpx.Client(base_url=self.base, timeout=600, trust_env=False)

    @property
    def v1(self) -> str:
        """The OpenAI-compatible base URL (``RemoteEngine``'s ``base_url``)."""
        return f"{self.base}/v1"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON to ``path`` and return the answer; a status >= 400 raises with the server's message."""
        r = self.client.post(path, json={"model": self.config.name, **body})
        if r.status_code >= 400:
            raise KVAgentError(f"llama-server {path} answered {r.status_code}: {r.text[:500]}")
        return r.json()  # type: ignore[no-any-return]

    def get(self, path: str) -> Any:
        r = self.client.get(path)
        r.raise_for_status()
        return r.json() if "json" in r.headers.get("content-type", "") else r.text

    def close(self) -> None:
        self.client.close()
        stop_process(self.proc)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ENV", "LlamaServer", "LlamaServerConfig", "LlamaServerMissing", "binary", "default_path", "find_binary",
           "missing_reason"]
