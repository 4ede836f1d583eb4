"""``kvagent bench load --target vllm``: a real vLLM (CPU build, prefix caching on), with agents that rewrite their
own system prompt, straight to vLLM and through ``kvagent serve --upstream``.

Both arms run the same client: a plain OpenAI chat client whose system prompt holds the policy, three state lines
(``order_status: processing``, ...) and the document. Its first turn asks with the initial state (every agent
starts from the fleet's shared prompt, which the engine holds); each later turn rewrites one state line in place
(the changes of :mod:`kvagent_bench.server.load`), then resends its whole history with the next question:

- ``inplace``: sent straight to vLLM (what such an agent gets from a prefix cache today);
- ``erratum``: sent to ``kvagent serve --upstream <vLLM>`` in a child process on 127.0.0.1, which forwards the
  prefix-stable layout (``kvagent_server.layout``: the previous request byte for byte, then an erratum line).

The hit rate of a point is vLLM's own: the growth of ``prefix_cache_hits`` over ``prefix_cache_queries`` (tokens)
during that point (the arms' points run one after the other, so each point's growth is its arm's own).
Per-turn prompt and cached tokens are vLLM's ``usage`` (``prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from kvagent_bench.server.load import FIELDS, MODEL, POLICY, Agent, TurnRecord, document
from kvagent_bench.server.processes import free_port, start_process, stop_process
from kvagent_bench.server.streams import astream_chat


def system_prompt(values: dict[str, str], doc: str) -> str:
    """The agent's system prompt: policy, one line per state field (near the top), then the document."""
    lines = "\n".join(f"{name}: {value}" for name, value in values.items())
    return f"{POLICY}\n{lines}\n\nCustomer document:\n{doc}"


class VllmTarget:
    """vLLM (``kvagent_bench.server.vllm``, ``make vllm``) and, in front of it, ``kvagent serve --upstream``."""

    name, hit_source = "vllm", "vllm-metrics"

    def __init__(self, log_dir: Path, n_ctx: int = 8192, doc_chars: int | None = None) -> None:
        import httpx

        from kvagent_bench.server.vllm import VllmServer

        self.vllm = VllmServer(log_dir, max_model_len=n_ctx)
        self.vllm.__enter__()
        try:
            port = free_port()
            args = [sys.executable, "-m", "kvagent.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--upstream", self.vllm.base_url, "--model", MODEL, "--n-ctx", str(n_ctx),
                    "--max-tokens", "512", "--log-level", "warning"]
            self.proxy = start_process(args, f"http://127.0.0.1:{port}/health", log_dir / "proxy.log")
        except BaseException:
            self.vllm.__exit__(None, None, None)
            raise
        self.urls = {"erratum": f"http://127.0.0.1:{port}/v1", "inplace": self.vllm.base_url}
        self.client = httpx.AsyncClient(timeout=900, trust_env=False,
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        doc = document()
        self.doc = doc if doc_chars is None else (doc * (1 + doc_chars // len(doc)))[:doc_chars]
        self._mark: dict[str, float] = {}

    def body(self, messages: list[dict[str, str]], max_tokens: int, key: str) -> dict[str, Any]:
        return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "prompt_cache_key": key}

    async def holder(self) -> Callable[[], Any]:
        """The untouched prompt sent once to each arm's address, as the first agent of a fleet would."""
        messages = [{"role": "system", "content": system_prompt(dict(FIELDS), self.doc)},
                    {"role": "user", "content": "Hello."}]
        for arm, url in self.urls.items():
            await astream_chat(self.client, self.body(messages, 1, f"holder-{arm}"),
                               path=f"{url}/chat/completions")

        async def nothing() -> None:
            return None
        return nothing

    async def agent(self, index: int, arm: str, record: TurnRecord) -> Agent:
        return _ChatAgent(self, index, arm)

    async def point_started(self) -> None:
        self._mark = await self._metrics()

    async def point_row(self, row: dict[str, Any]) -> None:
        """vLLM's own hit rate over the point (its counters' growth since :meth:`point_started`)."""
        now = await self._metrics()
        queries = now["queries"] - self._mark.get("queries", 0.0)
        hits = now["hits"] - self._mark.get("hits", 0.0)
        row["vllm_prefix_queries"], row["vllm_prefix_hits"] = queries, hits
        row["hit_rate_usage"] = row["hit_rate"]
        row["hit_rate"] = hits / queries if queries > 0 else float("nan")

    async def _metrics(self) -> dict[str, float]:
        import asyncio

        return await asyncio.to_thread(self.vllm.metrics)

    async def stop(self) -> None:
        await self.client.aclose()
        stop_process(self.proxy)
        self.vllm.__exit__(None, None, None)


class _ChatAgent:
    """A plain chat client: its system prompt's state lines rewritten in place, its whole history resent."""

    def __init__(self, target: VllmTarget, index: int, arm: str) -> None:
        self.t, self.arm, self.key = target, arm, f"{arm}-{index}"
        self.values = dict(FIELDS)
        self.history: list[dict[str, str]] = []

    async def turn(self, record: TurnRecord, question: str, change: tuple[str, str], max_tokens: int) -> None:
        if self.history:  # the first turn asks with the shared prompt as it is
            self.values[change[0]] = change[1]
        self.history.append({"role": "user", "content": question})
        messages = [{"role": "system", "content": system_prompt(self.values, self.t.doc)}, *self.history]
        got = await astream_chat(self.t.client, self.t.body(messages, max_tokens, self.key),
                                 path=f"{self.t.urls[self.arm]}/chat/completions")
        record.first = got.first if got.text else None
        self.history.append({"role": "assistant", "content": got.text})
        record.prompt_tokens, record.reused_tokens = got.prompt, got.cached

    async def close(self) -> None:
        return None


__all__ = ["VllmTarget", "system_prompt"]
