"""``kvagent bench agents --framework openai-agents``: an OpenAI Agents SDK agent (``openai-agents``, the ``agents``
extra) with three function tools, run over a few support tasks against ``kvagent serve`` with no session key, as an
application built on the SDK calls a local server: how much of each of the SDK's requests the server reuses.

The agent: the ``agents`` traces' support-agent system prompt (:func:`kvagent_bench.agent_traces.system_prompt`, no
clock line) as its instructions; the tools ``check_stock``, ``get_order`` and ``find_workshop_slots`` (fixed
answers, :data:`TOOL_ANSWERS`); temperature 0, ``max_tokens`` :data:`MAX_TOKENS`; ``OpenAIChatCompletionsModel`` on
an ``AsyncOpenAI`` client; one ``Runner.run`` per task of :data:`TASKS` (at most :data:`MAX_TURNS` model calls), the
tasks in order on one server. The SDK sends no ``prompt_cache_key``, no ``user`` and no ``X-KVAgent-Session``
(checked on every request: ``keyed`` in a row), so each request runs on a temporary session whose cells the server
retains when it ends.

Per request, read by an httpx response hook on the SDK's client: ``prompt_tokens`` and ``cached``
(``usage.prompt_tokens_details.cached_tokens``), ``computed`` = prompt - cached, the server's ``X-KVAgent-Cache``
header (``resumed|prefix|none; reused=N; computed=M``: ``how``), ``resumed`` (the tokens the server's INFO log says
it kept from a resumed retained conversation), ``wall_s``. Per task: the run's wall time, its model calls, how it
ended (``final``, ``max_turns`` or an error's name).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from kvagent_bench.common import RESULTS_DIR, median, write_json

FRAMEWORKS = ("openai-agents",)
MAX_TOKENS = 64
MAX_TURNS = 4
TASKS = (
    "Do you have a Heron in size M at the Leeds shop? I'd like to see it on Saturday.",
    "Where is my order LC-60218? Email tom.hale@example.com, postcode G12 8QQ.",
    "Can I get a Safety Check at the Bristol workshop this week?",
    "Is the Marten Cargo in stock in Glasgow, and could I test ride it?",
    "What's happening with order LC-60377? Email ana.silva@example.net, postcode BS8 1TH.",
    "When can the Leeds workshop do an E-Drive Diagnostic on my Tern 2?",
    "Do you have the Swift Fold in Bristol? I need it before Christmas.",
    "Could the Glasgow workshop fit me in for a Full Service next week?",
)
"""The customers' requests, one agent run each (written for this benchmark)."""
TOOL_ANSWERS = {
    "check_stock": {"in_stock": 2, "sizes": ["S", "M", "L"], "test_ride_bike": True, "next_delivery": "2026-12-11"},
    "get_order": {"status": "dispatched", "courier": "two-person courier", "delivery_window": "Tuesday 8 December, "
                  "10:00-11:00", "email_match": True, "postcode_match": True},
    "find_workshop_slots": {"slots": ["Thursday 10 December 10:00", "Thursday 10 December 14:30",
                                      "Friday 11 December 09:30"]},
}
"""What each tool answers (the arguments are recorded, not checked)."""


def default_json(model: str) -> Path:
    return RESULTS_DIR / f"agents-openai-agents-{model}.json"


def parse_cache_header(value: str | None) -> dict[str, Any]:
    """``X-KVAgent-Cache`` (``"prefix; reused=3012; computed=40"``) as ``{"how", "reused", "computed"}``; all None
    when the header is missing (a streamed reply, another server)."""
    if not value:
        return {"how": None, "reused": None, "computed": None}
    how, *pairs = [p.strip() for p in value.split(";")]
    counts = dict(p.split("=", 1) for p in pairs if "=" in p)
    return {"how": how, "reused": int(counts["reused"]) if "reused" in counts else None,
            "computed": int(counts["computed"]) if "computed" in counts else None}


def keyed(body: dict[str, Any], headers: Any) -> bool:
    """Whether a chat request names a session: ``prompt_cache_key``, ``user`` or ``X-KVAgent-Session``."""
    return bool(body.get("prompt_cache_key") or body.get("user") or headers.get("x-kvagent-session"))


class Recorder:
    """httpx event hooks that keep one row per chat completion the SDK's client sends."""

    def __init__(self, log: Path | None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.task = -1
        self._log = log
        self._started: dict[int, float] = {}
        self._resumes = 0

    async def on_request(self, request: Any) -> None:
        self._started[id(request)] = time.perf_counter()

    async def on_response(self, response: Any) -> None:
        request = response.request
        if not request.url.path.endswith("/chat/completions"):
            return
        await response.aread()  # the body is read once here; the SDK reads it from the buffer
        wall = time.perf_counter() - self._started.pop(id(request), time.perf_counter())
        body = json.loads(request.content or b"{}")
        reply = response.json() if response.status_code < 400 else {}
        usage = reply.get("usage") or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.rows.append({"task": self.task, "call": sum(r["task"] == self.task for r in self.rows),
                          "status": response.status_code, "keyed": keyed(body, request.headers),
                          "messages": len(body.get("messages") or ()), "tools": len(body.get("tools") or ()),
                          "prompt_tokens": prompt, "cached": cached, "computed": prompt - cached,
                          **parse_cache_header(response.headers.get("x-kvagent-cache")),
                          "resumed": self._new_resumes(), "wall_s": wall})

    def _new_resumes(self) -> int | None:
        if self._log is None:
            return None
        from kvagent_bench.agents import resumes

        found = resumes(self._log.read_text(errors="replace"))
        new, self._resumes = sum(found[self._resumes:]), len(found)
        return new


def tool_functions() -> list[Any]:
    """The agent's three function tools (the SDK reads their schemas from the signatures and docstrings)."""
    from agents import function_tool

    @function_tool
    def check_stock(product: str, shop: str) -> str:
        """Stock of a product in a shop (Bristol, Leeds, Glasgow or warehouse), by size, and whether a test-ride bike
        is there."""
        return json.dumps({"product": product, "shop": shop, **TOOL_ANSWERS["check_stock"]})

    @function_tool
    def get_order(order_id: str) -> str:
        """An order's status and delivery, and whether the email and postcode given match the account."""
        return json.dumps({"order_id": order_id, **TOOL_ANSWERS["get_order"]})

    @function_tool
    def find_workshop_slots(shop: str, service: str) -> str:
        """Free workshop slots in a shop for a service (Safety Check, Full Service, E-Drive Diagnostic)."""
        return json.dumps({"shop": shop, "service": service, **TOOL_ANSWERS["find_workshop_slots"]})

    return [check_stock, get_order, find_workshop_slots]


async def run_tasks(base_url: str, model: str, tasks: int, recorder: Recorder,
                    progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run the first ``tasks`` of :data:`TASKS` one after the other on the server at ``base_url`` (``/v1``): a row
    per task."""
    import httpx
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from agents.exceptions import AgentsException, MaxTurnsExceeded
    from openai import AsyncOpenAI

    from kvagent_bench.agent_traces import system_prompt

    set_tracing_disabled(True)  # the SDK would send its traces to OpenAI
    http = httpx.AsyncClient(trust_env=False, timeout=900,
                             event_hooks={"request": [recorder.on_request], "response": [recorder.on_response]})
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, http_client=http)
    agent = Agent(name="Juniper", instructions=system_prompt(), tools=tool_functions(),
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
    out = []
    try:
        for k, task in enumerate(TASKS[:tasks]):
            progress(f"openai-agents: task {k + 1}/{tasks}")
            recorder.task = k
            start = time.perf_counter()
            try:
                result = await Runner.run(agent, task, max_turns=MAX_TURNS)
                ended, final = "final", str(result.final_output)[:300]
            except MaxTurnsExceeded:
                ended, final = "max_turns", None
            except AgentsException as exc:  # a model that writes a malformed call ends the task, not the run
                ended, final = type(exc).__name__, str(exc)[:300]
            out.append({"task": k, "question": task, "wall_s": time.perf_counter() - start, "ended": ended,
                        "final_output": final, "calls": sum(r["task"] == k for r in recorder.rows)})
    finally:
        await client.close()
    return out


def summarise(calls: list[dict[str, Any]], tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every request but the first (cold): medians of prompt and computed tokens and of the request wall time,
    the hit rate (cached / prompt tokens, summed), how the server says each prompt's KV was found; the median task
    wall time; whether any request carried a session key."""
    warm = calls[1:]
    prompt = sum(r["prompt_tokens"] for r in warm)
    hows: dict[str, int] = {}
    for r in warm:
        hows[str(r["how"])] = hows.get(str(r["how"]), 0) + 1
    return {"requests": len(calls), "tasks": len(tasks),
            "cold_computed": calls[0]["computed"] if calls else None,
            "prompt_median": median([r["prompt_tokens"] for r in warm]),
            "computed_median": median([r["computed"] for r in warm]),
            "computed_per_request": [r["computed"] for r in calls],
            "hit_rate": sum(r["cached"] for r in warm) / prompt if prompt else None,
            "request_wall_s_median": median([r["wall_s"] for r in warm]),
            "task_wall_s_median": median([t["wall_s"] for t in tasks]),
            "task_wall_s": [t["wall_s"] for t in tasks],
            "how": hows, "resumed_requests": sum(1 for r in warm if r["resumed"]),
            "any_keyed": any(r["keyed"] for r in calls),
            "ended": [t["ended"] for t in tasks]}


def run(model: str, tasks: int, json_path: Path, command: str, progress: Callable[[str], None] = lambda m: None,
        log_dir: Path | None = None) -> dict[str, Any]:
    """The agent over the first ``tasks`` tasks against a fresh ``kvagent serve`` (keyless, INFO log); writes and
    returns the document."""
    import asyncio
    import tempfile

    from kvagent_bench.agents import N_CTX, ServeArm

    if not 1 <= tasks <= len(TASKS):
        raise ValueError(f"tasks must be 1 to {len(TASKS)}, got {tasks}")
    with tempfile.TemporaryDirectory(prefix="kvagent-oa-agents-") as tmp:
        progress("openai-agents: starting kvagent serve")
        server = ServeArm(model, log_dir or Path(tmp), log_resumes=True)
        recorder = Recorder(server.log)
        try:
            done = asyncio.run(run_tasks(f"{server.base}/v1", server.model, tasks, recorder, progress))
        finally:
            server.close()
    doc = {"model": model, "framework": "openai-agents",
           "plan": {"tasks": tasks, "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS, "n_ctx": N_CTX,
                    "server": f"kvagent serve --n-ctx {N_CTX} --log-level info, no session key"},
           "tasks": done, "summary": summarise(recorder.rows, done)}
    write_json(json_path, command, recorder.rows, **doc)
    return {**doc, "rows": recorder.rows}


__all__ = ["FRAMEWORKS", "TASKS", "Recorder", "default_json", "keyed", "parse_cache_header", "run", "summarise"]
