"""``kvagent bench proxy``: a plain ``openai`` client whose system prompt changes one line per turn, straight to an
engine and through ``kvagent serve --upstream``; and what the proxy adds to a request whose prompt did not change.

The held-out agent (written before the proxy was tuned, never used to tune it): a ~2.9k-token system prompt whose
second line is a clock (``Current time: 09:00``, one minute later each turn), then a support policy and a document;
each turn resends the whole history with the next question (``max_tokens`` 16, greedy, streamed). Two arms on one
engine, one after the other, each with its own conversation (``prompt_cache_key``):

- ``direct``: the official ``openai`` client to the engine;
- ``proxy``: the same client to ``kvagent serve --upstream <engine>`` on 127.0.0.1.

Per turn: the time to the first content token (client side), the engine's ``usage`` (prompt and cached tokens), and,
on vLLM, the growth of its own prefix-cache counters (queries, hits) over the turn.

Overhead: an agent whose prompt does not change (the held-out system prompt; each turn resends the history with
the last reply and a new question, ``max_tokens`` 1, not streamed: what the proxy forwards as ``append``), run
twice side by side, straight to the engine and through the proxy, their requests alternating for ``pairs``
turns; the proxy's added time is the median of (proxy - direct) over the pairs. Measured twice: against the
engine, and against a stub engine on 127.0.0.1 that answers at once (what the proxy itself costs, without the
engine's own noise).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from fastapi import FastAPI, Request  # module level: the stub's annotations resolve here

from kvagent_bench.common import RESULTS_DIR, write_json
from kvagent_bench.server.load import MODEL, document, percentile
from kvagent_bench.server.processes import free_port, start_process, stop_process

TARGETS = ("vllm", "llama-server")
POLICY = ("You are the support agent of Northwind Outdoor. Answer in one short sentence. Use the order records and "
          "the policy document below; never invent an order number.")


def system_prompt(turn: int, doc: str) -> str:
    """The held-out system prompt of ``turn``: its clock line is the only thing that changes."""
    return f"{POLICY}\nCurrent time: 09:{turn:02d}\nStore: Northwind Outdoor, Leeds\n\nPolicy document:\n{doc}"


QUESTIONS = ("Where is my order?", "Can I change the delivery address?", "What is the refund window?",
             "Do you ship abroad?", "How do I return a tent?", "Is there a warranty?", "Can I pay by invoice?",
             "What time is it?", "Who do I call for help?", "Thanks, that is all.")


class _Engine:
    """The engine under test and the proxy in front of it (child processes on 127.0.0.1)."""

    def __init__(self, target: str, log_dir: Path, n_ctx: int) -> None:
        self.target = target
        self.server: Any = None
        self.metrics: Callable[[], dict[str, float]] | None = None
        if target == "vllm":
            from kvagent_bench.server.vllm import VllmServer

            self.server = VllmServer(log_dir, max_model_len=n_ctx)
            self.server.__enter__()
            self.url, self.metrics = self.server.base_url, self.server.metrics
            self.extra: dict[str, Any] = {}
        else:
            from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig

            self.server = LlamaServer(LlamaServerConfig(MODEL, n_ctx=n_ctx, slots=2), log_dir)
            self.url, self.extra = self.server.v1, {"cache_prompt": True}
        self.proxy = _proxy(self.url, log_dir, n_ctx, "proxy.log")

    def close(self) -> None:
        stop_process(self.proxy)
        if self.target == "vllm":
            self.server.__exit__(None, None, None)
        else:
            self.server.close()


def _proxy(upstream: str, log_dir: Path, n_ctx: int, log: str) -> Any:
    port = free_port()
    args = [sys.executable, "-m", "kvagent.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--upstream",
            upstream, "--model", MODEL, "--n-ctx", str(n_ctx), "--log-level", "warning"]
    proc = start_process(args, f"http://127.0.0.1:{port}/health", log_dir / log)
    proc.url = f"http://127.0.0.1:{port}/v1"  # type: ignore[attr-defined]
    return proc


def heldout_turns(url: str, arm: str, doc: str, turns: int, extra: dict[str, Any],
                  metrics: Callable[[], dict[str, float]] | None) -> list[dict[str, Any]]:
    """The held-out agent's turns against ``url`` with the official ``openai`` client."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)
    history: list[dict[str, str]] = []
    rows = []
    for turn in range(turns):
        history.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        messages = [{"role": "system", "content": system_prompt(turn, doc)}, *history]
        before = metrics() if metrics else None
        start = time.perf_counter()
        first, text, usage = None, "", None
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.0,
                                                stream=True, stream_options={"include_usage": True},
                                                prompt_cache_key=f"heldout-{arm}", extra_body=extra or None)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first if first is not None else time.perf_counter()
                    text += choice.delta.content
            usage = chunk.usage or usage
        end = time.perf_counter()
        history.append({"role": "assistant", "content": text})
        details = getattr(usage, "prompt_tokens_details", None)
        row = {"arm": arm, "turn": turn, "ttft_s": (first or end) - start, "total_s": end - start,
               "prompt_tokens": usage.prompt_tokens if usage else None,
               "cached_tokens": getattr(details, "cached_tokens", None) if details else None}
        if metrics and before is not None:
            after = metrics()
            row["vllm_queries"], row["vllm_hits"] = after["queries"] - before["queries"], after["hits"] - before["hits"]
        rows.append(row)
    return rows


def overhead(direct: str, proxied: str, pairs: int, extra: dict[str, Any], doc: str) -> dict[str, Any]:
    """Median added time of the proxy on requests whose prompt did not change (see the module docstring)."""
    import httpx

    system = {"role": "system", "content": system_prompt(0, doc)}
    histories: dict[str, list[dict[str, str]]] = {"direct": [], "proxy": []}
    times: dict[str, list[float]] = {"direct": [], "proxy": []}
    layouts: dict[str, int] = {}
    with httpx.Client(timeout=300, trust_env=False) as client:
        for i in range(pairs + 2):  # two unmeasured pairs: connections opened, the prefix cached
            arms = (("direct", direct), ("proxy", proxied))
            for arm, url in arms if i % 2 else arms[::-1]:
                history = histories[arm]
                history.append({"role": "user", "content": f"Question {i}: is that all?"})
                body = {"model": MODEL, "messages": [system, *history], "max_tokens": 1, "temperature": 0.0,
                        "prompt_cache_key": f"overhead-{arm}", **extra}
                start = time.perf_counter()
                r = client.post(f"{url}/chat/completions", json=body)
                elapsed = time.perf_counter() - start
                r.raise_for_status()
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
                if i >= 2:
                    times[arm].append(elapsed)
                    if arm == "proxy":
                        kind = r.headers.get("x-kvagent-layout", "?")
                        layouts[kind] = layouts.get(kind, 0) + 1
    added = [p - d for p, d in zip(times["proxy"], times["direct"])]
    return {"pairs": pairs, "direct_median_ms": 1e3 * statistics.median(times["direct"]),
            "proxy_median_ms": 1e3 * statistics.median(times["proxy"]),
            "added_median_ms": 1e3 * statistics.median(added), "added_p90_ms": 1e3 * percentile(added, 0.9),
            "proxy_layouts": layouts}


def _stub_app() -> Any:
    """An engine that answers every chat completion at once (what the proxy costs, without an engine's noise)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"id": "stub", "object": "chat.completion", "created": 0, "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Hi"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    return app


@contextmanager
def _stub() -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_stub_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def summarise(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, over the turns after the first: hit rate (vLLM's counters where present, else usage), TTFT."""
    out: dict[str, Any] = {}
    for arm in ("direct", "proxy"):
        rows = [r for r in turns if r["arm"] == arm and r["turn"] > 0]
        if not rows:
            continue
        entry: dict[str, Any] = {"ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
                                 "ttft_p90_s": percentile([r["ttft_s"] for r in rows], 0.9)}
        if all("vllm_queries" in r for r in rows):
            queries = sum(r["vllm_queries"] for r in rows)
            entry["hit_rate"] = sum(r["vllm_hits"] for r in rows) / queries if queries else None
            entry["hit_rate_source"] = "vllm-metrics"
        else:
            prompt = sum(r["prompt_tokens"] or 0 for r in rows)
            entry["hit_rate"] = sum(r["cached_tokens"] or 0 for r in rows) / prompt if prompt else None
            entry["hit_rate_source"] = "usage"
        out[arm] = entry
    if "direct" in out and "proxy" in out and out["proxy"]["ttft_median_s"] > 0:
        out["ttft_median_ratio"] = out["direct"]["ttft_median_s"] / out["proxy"]["ttft_median_s"]
    return out


def run(target: str, json_path: Path, command: str, *, turns: int = 10, pairs: int = 50, doc_chars: int = 11000,
        n_ctx: int = 8192, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """The held-out agent on both arms, then the overhead on the engine and on the stub; writes the JSON."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: use one of {', '.join(TARGETS)}")
    base = document()
    doc = (base * (1 + doc_chars // len(base)))[:doc_chars]
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvagent-proxy-bench-") as tmp:
        log_dir = Path(tmp)
        engine = _Engine(target, log_dir, n_ctx)
        try:
            turns_rows: list[dict[str, Any]] = []
            for arm, url in (("direct", engine.url), ("proxy", engine.proxy.url)):
                progress(f"{target}: held-out agent, {arm}")
                turns_rows += heldout_turns(url, arm, doc, turns, engine.extra, engine.metrics)
                write_json(json_path, command, turns_rows, target=target, model=MODEL, partial=True)
            result["summary"] = summarise(turns_rows)
            progress(f"{target}: proxy overhead on the engine")
            result["overhead_engine"] = overhead(engine.url, engine.proxy.url, pairs, engine.extra, doc)
        finally:
            engine.close()
        progress("proxy overhead on a stub engine")
        with _stub() as stub:
            proxy = _proxy(stub, log_dir, n_ctx, "proxy-stub.log")
            try:
                result["overhead_stub"] = overhead(stub, proxy.url, pairs, {}, doc)
            finally:
                stop_process(proxy)
    write_json(json_path, command, turns_rows, target=target, model=MODEL, doc_chars=doc_chars, turns=turns,
               **result)
    return {"rows": turns_rows, **result}


def default_json(target: str) -> Path:
    return RESULTS_DIR / f"proxy-{target}.json"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per-turn TTFT (log scale) and cached share of the prompt, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm, style in (("direct", "--s"), ("proxy", "-o")):
        mine = [r for r in rows if r["arm"] == arm]
        axes[0].plot([r["turn"] for r in mine], [r["ttft_s"] for r in mine], style, label=arm)
        share = [(r["vllm_hits"] / r["vllm_queries"]) if r.get("vllm_queries") else
                 ((r["cached_tokens"] or 0) / r["prompt_tokens"] if r["prompt_tokens"] else 0.0) for r in mine]
        axes[1].plot([r["turn"] for r in mine], share, style, label=arm)
    axes[0].set(yscale="log", xlabel="turn", ylabel="time to first token (s)", title="TTFT per turn")
    axes[1].set(xlabel="turn", ylabel="prompt tokens from the prefix cache", ylim=(0, 1.05),
                title="prefix-cache hits per turn")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["TARGETS", "default_json", "heldout_turns", "overhead", "plot", "run", "summarise", "system_prompt"]
